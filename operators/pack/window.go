package pack

import (
	"errors"
	"fmt"
	"hash/maphash"
	"math"
	"slices"
	"strings"
	"unsafe"

	"github.com/trajflow/trajflow/internal/idset"
	"github.com/trajflow/trajflow/schemas"
)

// ErrWindowFull is returned by Add when the window has reached its close
// condition: the caller must Close it first. The record is not consumed.
var ErrWindowFull = errors.New("pack: window ready, close it before adding")

// Outcome of Window.Add.
type Outcome uint8

// Outcomes.
const (
	Admitted  Outcome = iota + 1 // the segment joins the open batch
	Filtered                     // not packed; Result.Filter says why
	Duplicate                    // the record id was already decided; nothing changed
)

// String returns "admitted", "filtered" or "duplicate".
func (o Outcome) String() string {
	switch o {
	case Admitted:
		return "admitted"
	case Filtered:
		return "filtered"
	case Duplicate:
		return "duplicate"
	}
	return fmt.Sprintf("Outcome(%d)", uint8(o))
}

// Result reports what Add did with one record.
type Result struct {
	Outcome   Outcome
	Filter    Filter // the reason, when Outcome is Filtered
	Tokens    int    // segment length, when Admitted
	Trained   int    // trained target tokens, when Admitted
	Truncated bool   // the segment was cut by OverflowTruncate
	Ready     bool   // the window has reached its close condition
}

// Admission locates one admitted record in a closed batch (for the census
// and lineage).
type Admission struct {
	RecordID      string
	GroupID       string
	Row           int   // index in PackedBatch.Rows
	Segment       int   // segment id within the row
	Tokens        int   // segment length
	Trained       int   // trained target tokens
	PolicyVersion int64 // oldest behavior version among the trained tokens
	Truncated     bool
	Stale         int // target tokens of stale turns kept as context (StaleMaskTurns)
}

// Decision is a record filtered when the window closed.
type Decision struct {
	RecordID string
	GroupID  string
	Filter   Filter
	Tokens   int // its target tokens
}

// Closed reports a closed window.
type Closed struct {
	// Admitted lists the records in the batch, sorted by RecordID.
	Admitted []Admission
	// Filtered lists records admitted by Add that the lag rule filters
	// under the closing trainer version (asynchronous mode: the trainer
	// moved on while the window was open), sorted by RecordID.
	Filtered []Decision
	Stats    Stats
}

// Window is the pack stage's admission window (docs/PIPELINE.md §15, "Determinism"). It is in-memory and does no I/O: the runtime
// feeds it scored records, closes it when Ready, and publishes the batch.
//
// Every record id is decided once in the window's lifetime: admitted,
// filtered, or rejected with an error. A later delivery of the same id
// with the same content is a Duplicate (counted, Duplicates) and is never
// admitted twice (at-least-once delivery with deduplication); with other
// content it is malformed input (ErrMalformed), and the first decision
// stands. Content is what the window and the pack stage read of a record
// (fingerprint): its group, run, task, split, upstream filter, reward
// total, every turn's prompt, action, log-prob and observation lists and
// policy version, and the turn advantages and value targets. Ids restored
// with MarkSeen have no content to compare: their deliveries are
// Duplicates. (The advantage Assembler treats redeliveries the same way;
// testdata/dedup holds the table both are tested with.) The window remembers decided ids across closes; a runtime
// that restarts restores that memory with MarkSeen and re-adds the records
// of the open batch (Pending) from its input topic.
//
// The open batch holds only compact segments (tokens, spans and log-probs),
// not the scored records. Closing on a policy-version boundary is the
// runtime's call: Close when a release arrives. A Window is not safe for
// concurrent use.
type Window struct {
	opts           Options
	trainerVersion int64
	seen           *idset.Set // decided ids and their fingerprints (not scanned by the collector)
	duplicates     int64      // Duplicate outcomes of Add
	pending        []Segment
	pendingIDs     map[idset.Key]struct{} // the record ids of pending
	groups         map[string]struct{}    // groups with an admitted member in the open batch
	decided        map[string]struct{}    // groups with an admitted or filtered member in the open batch
	countDecided   bool
	tokens         int
	cols           *Columns // ReuseColumns: the closed batches' arrays
}

// ReuseColumns makes Close build each batch's token-aligned columns in the
// arrays of the previous batch: a closed batch's rows are then valid only
// until the next Close (the pack stage encodes a batch before it closes
// the next window).
func (w *Window) ReuseColumns() { w.cols = &Columns{} }

// NewWindow returns an empty window that judges lag against
// trainerVersion.
func NewWindow(opts Options, trainerVersion int64) (*Window, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	return &Window{
		opts:           opts,
		trainerVersion: trainerVersion,
		seen:           idset.New(),
		pendingIDs:     make(map[idset.Key]struct{}),
		groups:         make(map[string]struct{}),
		decided:        make(map[string]struct{}),
	}, nil
}

// CountDecidedGroups selects what BatchGroups counts: with on, every group
// with a member decided in the open window, admitted or filtered (stop and
// synchronize mode, docs/PIPELINE.md §15: a round whose groups are all filtered
// still closes a window, with an empty batch, so the loop moves on); with
// off (the default), only groups with an admitted member.
func (w *Window) CountDecidedGroups(on bool) { w.countDecided = on }

// HasGroup reports whether a member of group id was decided (admitted or
// filtered) in the open window. Members of such a group are accepted by
// Add even when the window is Ready, so a group is never split across
// batches by the group count.
func (w *Window) HasGroup(id string) bool {
	_, ok := w.decided[id]
	return ok
}

// DecidedGroups returns the groups with a member decided (admitted or
// filtered) in the open window, sorted.
func (w *Window) DecidedGroups() []string {
	out := make([]string, 0, len(w.decided))
	for g := range w.decided {
		out = append(out, g)
	}
	slices.Sort(out)
	return out
}

// SetTrainerVersion sets the trainer version that later Adds are judged
// against (the runtime calls it when a policy release arrives).
func (w *Window) SetTrainerVersion(v int64) { w.trainerVersion = v }

// TrainerVersion is the version Add judges lag against.
func (w *Window) TrainerVersion() int64 { return w.trainerVersion }

// Add reconstructs s (Reconstruct with the window's trainer version) and
// admits it to the open batch unless it is filtered or a duplicate.
// Errors wrap ErrMalformed or ErrEvalSplit (route the record to
// quarantine; its id counts as decided) or are ErrWindowFull (nothing
// changed). A record without a RecordID, and a decided id delivered again
// with other content, are ErrMalformed errors.
func (w *Window) Add(s schemas.Scored) (Result, error) {
	id := s.RecordID
	if id == "" {
		return Result{}, fmt.Errorf("%w: record without id (group %s)", ErrMalformed, s.GroupID)
	}
	fp := fingerprint(&s)
	if prev, ok := w.seen.Get(id); ok {
		if prev != 0 && prev != fp {
			return Result{Ready: w.Ready()}, fmt.Errorf("%w: record %s of group %s delivered again with other content", ErrMalformed, id, s.GroupID)
		}
		w.duplicates++
		return Result{Outcome: Duplicate, Ready: w.Ready()}, nil
	}
	if !w.Accepts(s.GroupID) {
		return Result{Ready: true}, fmt.Errorf("%w: record %s", ErrWindowFull, id)
	}
	seg, f, err := Reconstruct(&s, w.trainerVersion, w.opts)
	if err != nil {
		if !errors.Is(err, ErrOptions) {
			w.seen.Put(id, fp)
		}
		return Result{Ready: w.Ready()}, err // it names the record and the package
	}
	key := w.seen.Put(id, fp)
	w.decided[s.GroupID] = struct{}{}
	if f != FilterNone {
		return Result{Outcome: Filtered, Filter: f, Ready: w.Ready()}, nil
	}
	w.pending = append(w.pending, seg)
	w.pendingIDs[key] = struct{}{}
	w.tokens += seg.Len()
	w.groups[seg.GroupID] = struct{}{}
	return Result{
		Outcome:   Admitted,
		Tokens:    seg.Len(),
		Trained:   int(seg.Trained),
		Truncated: seg.Truncated,
		Ready:     w.Ready(),
	}, nil
}

// Ready reports whether the open batch has reached its close condition:
// admitted tokens >= BatchTokens (when set), or distinct groups >=
// BatchGroups (when set; admitted groups, or decided groups under
// CountDecidedGroups). A group counts from its first admitted (or decided)
// member; later members of a group already in the window are still
// accepted while it is Ready, and members arriving after a close go to the
// next batch.
// Accepts reports whether a record of group groupID may join the open
// window: always before the window is ready; once it is ready, only a
// member of a group already in it, and only while the token budget is not
// full. When Accepts is false the caller closes the window first.
func (w *Window) Accepts(groupID string) bool {
	return !w.Ready() || (!w.tokensFull() && w.HasGroup(groupID))
}

func (w *Window) Ready() bool {
	if w.tokensFull() {
		return true
	}
	return w.opts.BatchGroups > 0 && w.Count() >= w.opts.BatchGroups
}

// Count is the number of groups Ready compares with BatchGroups: the
// admitted groups, or the decided ones under CountDecidedGroups.
func (w *Window) Count() int {
	if w.countDecided {
		return len(w.decided)
	}
	return len(w.groups)
}

func (w *Window) tokensFull() bool {
	return w.opts.BatchTokens > 0 && w.tokens >= w.opts.BatchTokens
}

// Tokens is the number of tokens admitted to the open batch.
func (w *Window) Tokens() int { return w.tokens }

// Groups is the number of distinct groups admitted to the open batch.
func (w *Window) Groups() int { return len(w.groups) }

// Pending returns the record ids of the open batch, sorted.
func (w *Window) Pending() []string {
	ids := make([]string, len(w.pending))
	for i := range w.pending {
		ids[i] = w.pending[i].TrajectoryID
	}
	slices.Sort(ids)
	return ids
}

// Duplicates is the number of Adds that were Duplicates.
func (w *Window) Duplicates() int64 { return w.duplicates }

// fingerprintSeed seeds the fingerprints of one process; they are never
// stored or compared across processes.
var fingerprintSeed = maphash.MakeSeed()

// fingerprint hashes what the window and the pack stage read of s (see
// Window); never 0, which marks an id decided without content (MarkSeen).
// Every list is hashed in one call (maphash.Bytes), its hash mixed in
// with its position and length.
func fingerprint(s *schemas.Scored) uint64 {
	var f fp
	f.str(s.GroupID)
	f.str(s.RunID)
	f.str(s.TaskID)
	f.str(s.Split)
	f.str(s.Group.Filtered)
	f.mix(math.Float64bits(s.RewardTotal))
	f.mix(uint64(len(s.Turns)))
	for i := range s.Turns {
		t := &s.Turns[i]
		words(&f, t.PromptIDs)
		words(&f, t.ActionIDs)
		words(&f, t.ActionLogprobs)
		words(&f, t.ObservationIDs)
		f.mix(uint64(t.PolicyVersion))
	}
	words(&f, s.TurnAdvantages)
	words(&f, s.TurnValueTargets)
	return max(f.h, 1)
}

// fp accumulates a fingerprint: each value is mixed in order (a
// multiply-xorshift step), so equal sequences and only those (up to 2^-64
// collisions) give equal fingerprints.
type fp struct{ h uint64 }

func (f *fp) mix(v uint64) {
	f.h = (f.h ^ v) * 0x9e3779b97f4a7c15
	f.h ^= f.h >> 29
}

func (f *fp) str(x string) {
	f.mix(uint64(len(x)))
	f.mix(maphash.String(fingerprintSeed, x))
}

// words mixes in the length and the hash of the bytes of a list of 4-byte
// values (the bits of floats: a NaN hashes like itself).
func words[V int32 | float32](f *fp, xs []V) {
	f.mix(uint64(len(xs)))
	if len(xs) > 0 {
		f.mix(maphash.Bytes(fingerprintSeed, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(xs))), 4*len(xs))))
	}
}

// Seen reports whether id was already decided.
func (w *Window) Seen(id string) bool { return w.seen.Has(id) }

// MarkSeen records ids as decided (restoring deduplication memory after a
// restart); later Adds of them are Duplicates.
func (w *Window) MarkSeen(ids ...string) {
	for _, id := range ids {
		w.seen.Add(id)
	}
}

// Forget drops the id of key k (idset.KeyOf) from the deduplication
// memory, which otherwise grows by one entry per decided record. Call it
// only for ids that can no longer be redelivered (for example beyond the
// runtime's redelivery horizon); an id of the open batch stays decided
// until Close.
func (w *Window) Forget(k idset.Key) {
	if _, open := w.pendingIDs[k]; !open {
		w.seen.Delete(k)
	}
}

// Close packs the open batch and starts a new one. The admitted segments are
// ordered by record id, the lag rule is applied again against
// trainerVersion (segments that became stale are reported in
// Closed.Filtered), and the rest are packed with Pack into rows of
// TokenBudget. The batch gets BatchID = schemas.BatchID(runID,
// batchIndex) and records trainerVersion; later Adds are judged against
// trainerVersion. The batch is a pure function of the admitted set, the
// options and the arguments: arrival order never changes it. Closing an
// empty window returns a batch without rows.
func (w *Window) Close(batchIndex int64, runID, contractHash string, trainerVersion int64) (schemas.PackedBatch, Closed) {
	segs := w.pending
	slices.SortFunc(segs, func(a, b Segment) int { return strings.Compare(a.TrajectoryID, b.TrajectoryID) })
	var closed Closed
	kept := segs[:0]
	drop := w.opts.StalePolicy == StaleDrop
	for i := range segs {
		if f := admit(&segs[i], trainerVersion, w.opts.MaxLag, drop); f != FilterNone {
			closed.Filtered = append(closed.Filtered, Decision{RecordID: segs[i].TrajectoryID, GroupID: segs[i].GroupID, Filter: f,
				Tokens: segs[i].targets()})
			continue
		}
		kept = append(kept, segs[i])
	}
	rows, st := PackInto(w.cols, kept, w.opts.TokenBudget)
	closed.Stats = st
	closed.Admitted = make([]Admission, len(kept))
	index := make(map[string]int, len(kept))
	for i := range kept {
		index[kept[i].TrajectoryID] = i
	}
	for r := range rows {
		for k, id := range rows[r].SegTrajectoryIDs {
			seg := &kept[index[id]]
			closed.Admitted[index[id]] = Admission{
				RecordID:      id,
				GroupID:       seg.GroupID,
				Row:           r,
				Segment:       k,
				Tokens:        seg.Len(),
				Trained:       int(seg.Trained),
				PolicyVersion: rows[r].SegPolicyVersions[k],
				Truncated:     seg.Truncated,
				Stale:         seg.staleTargets(),
			}
		}
	}
	batch := schemas.PackedBatch{
		BatchID:        schemas.BatchID(runID, batchIndex),
		BatchIndex:     batchIndex,
		RunID:          runID,
		ContractHash:   contractHash,
		TrainerVersion: trainerVersion,
		TokenBudget:    int32(w.opts.TokenBudget),
		Rows:           rows,
	}
	w.pending = nil
	clear(w.pendingIDs)
	w.tokens = 0
	clear(w.groups)
	clear(w.decided)
	w.trainerVersion = trainerVersion
	return batch, closed
}

// NewestKept is the behavior version that decides how long batch stays
// trainable under the stale policy: the trainer's lag rule (operators/train
// LagRule, docs/PIPELINE.md §15) leaves some trained token of batch at
// trainer version v if and only if v - NewestKept(batch) <= max_lag. Under
// StaleMaskTurns a token survives on its own, so it is the newest version of
// a trained token; under StaleDrop a segment goes whole with its oldest
// trained token, so it is the newest among the segments' oldest versions.
// It is -1 when batch has no trained token. The pack stage takes the same
// version from the spans it packed (Stats.NewestKept); this reads it from a
// batch alone.
func NewestKept(batch *schemas.PackedBatch, stalePolicy string) int64 {
	newest := int64(-1)
	var oldest []int64 // per segment of a row, its oldest trained version (StaleDrop)
	for r := range batch.Rows {
		row := &batch.Rows[r]
		oldest = oldest[:0]
		for i, m := range row.ActionMask {
			if m != 1 {
				continue
			}
			v := int64(row.PolicyVersions[i])
			if stalePolicy != StaleDrop {
				newest = max(newest, v)
				continue
			}
			k := int(row.SegmentIDs[i])
			for len(oldest) <= k {
				oldest = append(oldest, -1)
			}
			if oldest[k] < 0 || v < oldest[k] {
				oldest[k] = v
			}
		}
		for _, v := range oldest {
			newest = max(newest, v)
		}
	}
	return newest
}
