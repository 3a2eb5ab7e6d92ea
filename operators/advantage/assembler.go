package advantage

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"

	"github.com/trajflow/trajflow/internal/idset"
	"github.com/trajflow/trajflow/schemas"
)

// CheckMember reports why r cannot join a group, wrapping ErrInvalid: an
// empty RecordID or GroupID, a GroupSize < 1 or a Member outside
// [0, GroupSize). A StatusInfra record wraps ErrInfra. The stage calls it
// before Assembler.Add to route such records to quarantine or retry; Add
// itself only counts and ignores them.
func CheckMember(r *schemas.Rewarded) error {
	switch {
	case r.RecordID == "":
		return fmt.Errorf("%w: record without id (group %q)", ErrInvalid, r.GroupID)
	case r.GroupID == "":
		return fmt.Errorf("%w: record %s has no group id", ErrInvalid, r.RecordID)
	case r.GroupSize < 1:
		return fmt.Errorf("%w: record %s: group size %d", ErrInvalid, r.RecordID, r.GroupSize)
	case r.Member < 0 || r.Member >= r.GroupSize:
		return fmt.Errorf("%w: record %s is member %d of %d", ErrInvalid, r.RecordID, r.Member, r.GroupSize)
	case r.Status == schemas.StatusInfra:
		return fmt.Errorf("%w: record %s", ErrInfra, r.RecordID)
	}
	return nil
}

// AssemblerStats counts what an Assembler did with the records it was given.
// Every record passed to Add or Offer lands in exactly one counter, the
// one of its Outcome.
type AssemblerStats struct {
	Added      int64 // joined an open group
	Duplicates int64 // identical to the record of the same RecordID in its open group (redelivery); ignored
	Malformed  int64 // same RecordID as a record in its open group, other content; ignored (Offer: ErrInvalid)
	Conflicts  int64 // another record already holds its Member slot, or its GroupSize differs from the group's; ignored
	Late       int64 // its group was already emitted or closed (remembered); ignored
	Rejected   int64 // CheckMember failed with ErrInvalid; ignored
	Infra      int64 // StatusInfra: retried upstream, never contributes; ignored

	// Declared counts member slots declared absent (Absent) that now count
	// toward their group's completion; declarations are not records.
	Declared int64
}

// Outcome says what Offer did with a record; each has its counter in
// AssemblerStats.
type Outcome uint8

// Outcomes.
const (
	Added     Outcome = iota + 1 // joined its open group (the group may be complete)
	Duplicate                    // an identical redelivery of a member of its open group; nothing changed
	Malformed                    // the RecordID of a member of its open group with other content; nothing changed
	Conflict                     // its Member slot is held by another record, or its GroupSize differs; nothing changed
	Late                         // its group was emitted or closed (remembered); nothing changed
	Rejected                     // CheckMember failed with ErrInvalid; nothing changed
	Infra                        // StatusInfra; nothing changed
)

// String returns the outcome's name in lower case.
func (o Outcome) String() string {
	switch o {
	case Added:
		return "added"
	case Duplicate:
		return "duplicate"
	case Malformed:
		return "malformed"
	case Conflict:
		return "conflict"
	case Late:
		return "late"
	case Rejected:
		return "rejected"
	case Infra:
		return "infra"
	}
	return fmt.Sprintf("Outcome(%d)", uint8(o))
}

// OpenGroup describes a group still waiting for members.
type OpenGroup struct {
	GroupID  string
	Have     int32  // distinct members present
	Expected int32  // declared group size
	FirstSeq uint64 // sequence number (1-based count of Add calls) of its first record
}

type openGroup struct {
	expected int32
	first    uint64
	members  []schemas.Rewarded
	absent   []int32 // member slots declared never to arrive
}

// maxPreallocMembers bounds the member slots allocated when a group
// opens. A group's size is a field of its records, up to MaxInt32 (the
// contract's bound on sampler.group_size), so a larger group grows as its
// members arrive rather than by what its first record claims. 64 slots
// hold a group of any usual size (16 by default) without growing.
const maxPreallocMembers = 64

// filled reports whether every member slot is present or declared absent.
func (g *openGroup) filled() bool { return int32(len(g.members)+len(g.absent)) >= g.expected }

// Assembler collects rewarded trajectories into groups by GroupID (the Kafka
// key of every record of a group, so one instance sees the whole group). It
// is in-memory, single-goroutine and deterministic: its answers depend only
// on the sequence of calls, never on a clock or on map order. Durability is
// the caller's: it can rebuild an Assembler by replaying the records of its
// open groups through Add.
//
// A group is complete when GroupSize distinct members (by Member index) have
// arrived, or some have and the rest were declared absent (Absent). The
// first record or declaration for a Member slot wins. A later record with
// the same RecordID and the same content is a redelivery (Duplicate,
// counted in Duplicates); with the same RecordID and other content it is
// malformed input (Malformed: Offer returns an error wrapping ErrInvalid
// for the caller to refuse it). One with another RecordID for a held or
// declared slot is a conflict (Conflicts). All of them are ignored: the
// group keeps its first record. (The pack Window treats redeliveries the
// same way; testdata/dedup holds the table both are tested with.)
//
// Groups that were emitted (complete) or closed are remembered, up to the
// capacity given to NewAssembler, oldest forgotten first; a record of a
// remembered group is counted Late and ignored, so a redelivered tail of an
// already-scored group does not reopen it as a partial group.
type Assembler struct {
	open     map[string]*openGroup
	buffered int
	seq      uint64
	stats    AssemblerStats

	done     *idset.Set  // remembered group ids (not scanned by the collector)
	doneRing *idset.Ring // the order in which they are forgotten
	capacity int
}

// NewAssembler returns an empty Assembler that remembers the ids of up to
// remember emitted or closed groups (0: none; negative counts as 0).
func NewAssembler(remember int) *Assembler {
	return &Assembler{
		open:     make(map[string]*openGroup),
		done:     idset.New(),
		doneRing: idset.NewRing(remember),
		capacity: max(remember, 0),
	}
}

// Add offers one record. When it completes its group, Add returns the
// group's members sorted by (Member, RecordID) and done = true, and the
// group is no longer open; otherwise it returns nil, false. Ignored records
// (see AssemblerStats) return nil, false. The record is stored by value; its
// slices are shared with the caller. Add is Offer without the outcome and
// the error.
func (a *Assembler) Add(r schemas.Rewarded) (group []schemas.Rewarded, done bool) {
	_, group, _ = a.Offer(r)
	return group, group != nil
}

// Offer is Add reporting what happened to r: its Outcome, and the complete
// group (non-nil only when r completed it). The error is non-nil for
// records the caller must refuse rather than ignore: CheckMember's error
// (Rejected, Infra), and for Malformed an error wrapping ErrInvalid naming
// the record and its group.
func (a *Assembler) Offer(r schemas.Rewarded) (Outcome, []schemas.Rewarded, error) {
	a.seq++
	if err := CheckMember(&r); err != nil {
		if errors.Is(err, ErrInfra) {
			a.stats.Infra++
			return Infra, nil, err
		}
		a.stats.Rejected++
		return Rejected, nil, err
	}
	if a.done.Has(r.GroupID) {
		a.stats.Late++
		return Late, nil, nil
	}
	g := a.open[r.GroupID]
	if g != nil {
		for i := range g.members {
			if m := &g.members[i]; m.RecordID == r.RecordID {
				if sameValue(reflect.ValueOf(m).Elem(), reflect.ValueOf(&r).Elem()) {
					a.stats.Duplicates++
					return Duplicate, nil, nil
				}
				a.stats.Malformed++
				return Malformed, nil, fmt.Errorf("%w: record %s of group %s delivered again with other content", ErrInvalid, r.RecordID, r.GroupID)
			}
		}
	}
	if g == nil {
		g = &openGroup{expected: r.GroupSize, first: a.seq, members: make([]schemas.Rewarded, 0, min(r.GroupSize, maxPreallocMembers))}
		a.open[r.GroupID] = g
	}
	if r.GroupSize != g.expected || slices.Contains(g.absent, r.Member) ||
		slices.ContainsFunc(g.members, func(m schemas.Rewarded) bool { return m.Member == r.Member }) {
		a.stats.Conflicts++
		return Conflict, nil, nil
	}
	g.members = append(g.members, r)
	a.buffered++
	a.stats.Added++
	if !g.filled() {
		return Added, nil, nil
	}
	return Added, a.finish(r.GroupID, g), nil
}

// sameValue reports whether a and b (of one type) hold the same values:
// floats compare by their bits (a NaN critic value equals itself, as in a
// byte-identical redelivery), nil and empty slices alike (the decoder reads
// an empty list as nil).
func sameValue(a, b reflect.Value) bool {
	switch a.Kind() {
	case reflect.Struct:
		for i := range a.NumField() {
			if !sameValue(a.Field(i), b.Field(i)) {
				return false
			}
		}
		return true
	case reflect.Slice:
		if a.Len() != b.Len() {
			return false
		}
		for i := range a.Len() {
			if !sameValue(a.Index(i), b.Index(i)) {
				return false
			}
		}
		return true
	case reflect.Float32:
		return math.Float32bits(float32(a.Float())) == math.Float32bits(float32(b.Float()))
	case reflect.Float64:
		return math.Float64bits(a.Float()) == math.Float64bits(b.Float())
	}
	return a.Equal(b)
}

// Absent declares that member slot member of the open group groupID will
// never arrive: it was refused upstream (validate or reward quarantined
// it). When the members present and the declared slots fill the group,
// Absent ends it and returns its members sorted like Close, with done =
// true, for ScoreGroup to score or filter under the partial-group policy
// at once rather than after the partial-group timeout. A declaration for a
// group that is not open, for a slot outside [0, GroupSize), or for a slot
// already held by a member or declared, changes nothing.
func (a *Assembler) Absent(groupID string, member int32) (group []schemas.Rewarded, done bool) {
	g := a.open[groupID]
	if g == nil || member < 0 || member >= g.expected || slices.Contains(g.absent, member) ||
		slices.ContainsFunc(g.members, func(m schemas.Rewarded) bool { return m.Member == member }) {
		return nil, false
	}
	g.absent = append(g.absent, member)
	a.stats.Declared++
	if !g.filled() {
		return nil, false
	}
	return a.finish(groupID, g), true
}

// Close ends an open group before it is complete (the partial-group timeout
// of the stage) and returns its members sorted by (Member, RecordID), for
// ScoreGroup to score or filter under the declared partial-group policy. It
// returns nil, false when groupID is not open.
func (a *Assembler) Close(groupID string) ([]schemas.Rewarded, bool) {
	g := a.open[groupID]
	if g == nil {
		return nil, false
	}
	return a.finish(groupID, g), true
}

func (a *Assembler) finish(id string, g *openGroup) []schemas.Rewarded {
	delete(a.open, id)
	a.buffered -= len(g.members)
	a.remember(id)
	slices.SortFunc(g.members, func(x, y schemas.Rewarded) int {
		if c := cmp.Compare(x.Member, y.Member); c != 0 {
			return c
		}
		return cmp.Compare(x.RecordID, y.RecordID)
	})
	return g.members
}

func (a *Assembler) remember(id string) {
	if a.capacity == 0 {
		return
	}
	if oldest, dropped := a.doneRing.Push(idset.KeyOf(id)); dropped {
		a.done.Delete(oldest)
	}
	a.done.Add(id)
}

// Open lists the open groups ordered by FirstSeq (oldest first), then
// GroupID. The caller applies its partial-group timeout to this list and
// calls Close.
func (a *Assembler) Open() []OpenGroup {
	out := make([]OpenGroup, 0, len(a.open))
	for id, g := range a.open {
		out = append(out, OpenGroup{GroupID: id, Have: int32(len(g.members)), Expected: g.expected, FirstSeq: g.first})
	}
	slices.SortFunc(out, func(x, y OpenGroup) int {
		if c := cmp.Compare(x.FirstSeq, y.FirstSeq); c != 0 {
			return c
		}
		return cmp.Compare(x.GroupID, y.GroupID)
	})
	return out
}

// Pending returns the number of open groups.
func (a *Assembler) Pending() int { return len(a.open) }

// Buffered returns the number of records held in open groups.
func (a *Assembler) Buffered() int { return a.buffered }

// Stats returns the counters so far.
func (a *Assembler) Stats() AssemblerStats { return a.stats }

// Remember marks groupID as already emitted, as if it had completed: later
// records of it are counted Late and ignored. A stage calls it while
// rebuilding from its output topic after losing its local state.
func (a *Assembler) Remember(groupID string) {
	if a.done.Has(groupID) {
		return
	}
	a.remember(groupID)
}

// Known reports whether groupID is open or remembered as emitted.
func (a *Assembler) Known(groupID string) bool {
	if _, ok := a.open[groupID]; ok {
		return true
	}
	return a.done.Has(groupID)
}
