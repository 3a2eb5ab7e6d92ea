// Package census reads the attempt census of a run from its Parquet
// snapshots (docs/PIPELINE.md §6, §9; docs/SYSTEMS.md §6): the funnel of every attempt
// from dispatched to trained, with the quarantine and filter reasons, and
// the selection-bias check — what was admitted against what was launched,
// by task and by reward, length and latency, with the denominators.
package census

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// Report is the attempt census of a run.
type Report struct {
	Events      int                        // distinct census events
	Kinds       map[string]map[string]bool // kind -> attempts
	Reasons     map[string]map[string]bool // "kind/reason" -> attempts
	FailedInfra map[string]bool
	FailedTask  map[string]bool
	Launched    []Attempt // attempts whose trajectory was recorded, by id
	Admitted    map[string]bool
	// StaleTokens sums the census events' stale tokens (the lag rule, at
	// pack or at the update); GeneratedTokens are the policy-sampled
	// tokens of the recorded trajectories.
	StaleTokens     int64
	GeneratedTokens int64

	lives         map[string]*life
	updateStart   map[int64]int64 // update -> when the trainer began it (µs)
	updateVersion map[int64]int64
	// Retried counts the retried events (one per retry of an environment
	// call by the rollout stage's client), by reason.
	Retried map[string]int
	// QuarantineRecords counts the records of the quarantine topic;
	// Unattributed, by reason, those the census cannot tie to an attempt
	// (a whole message refused before its rows were read: its id is the
	// message's, not an attempt's, and no census event names it).
	QuarantineRecords int
	Unattributed      map[string]int
	// Warnings says what the snapshot lacks (parquet.Holes, gaps between
	// files): the counts are those of what it holds.
	Warnings []string
	// Unreadable lists the files of the topics the census reads that are
	// missing (their checksum sidecar remains) or did not verify, each
	// error naming its path: when it is not empty every count is partial,
	// short of those files' records.
	Unreadable []parquet.FileError
}

// Partial reports whether files the census reads were unreadable, so that
// its counts are partial.
func (r *Report) Partial() bool { return len(r.Unreadable) > 0 }

// Attempt is what the selection-bias check compares of one attempt.
type Attempt struct {
	ID        string
	Task      string
	Reward    float64
	HasReward bool
	Tokens    int
	LatencyMS float64
}

// Count is the number of attempts with a census event of kind.
func (r *Report) Count(kind string) int { return len(r.Kinds[kind]) }

// ErrIncomplete marks a snapshot the census cannot be counted from.
var ErrIncomplete = errors.New("census: incomplete snapshot")

// read are the topics the census reads.
var read = []string{"census", "trajectories", "rewarded", "quarantine"}

// Collect reads the census, trajectories, rewarded and quarantine topics
// of the run snapshot in runDir. A file of those topics that is missing
// (its sidecar remains) or does not verify is skipped and listed in
// Unreadable, every one of them: the report counts the others, and the
// caller decides whether partial counts will do. A missing file of
// another topic is a Warning. A snapshot with
// trajectories or batches but no census file is refused (ErrIncomplete):
// its funnel would read zero everywhere. Partitions without a file and
// missing offsets are Warnings (checked against the contract the snapshot
// recorded). A cancelled ctx stops the reading between files.
func Collect(ctx context.Context, runDir string) (*Report, error) {
	snap, err := parquet.ReadRun(ctx, runDir, read, parquet.ReadOptions{Partial: true})
	if err != nil {
		return nil, err
	}
	files, err := parquet.List(runDir)
	if err != nil {
		return nil, err
	}
	censusUnreadable := slices.ContainsFunc(snap.Unreadable, func(f parquet.FileError) bool { return f.File.Topic == "census" })
	if len(snap.Topics["census"]) == 0 && !censusUnreadable {
		held := map[string]int{}
		for _, f := range files {
			held[f.Topic]++
		}
		for _, t := range []string{"trajectories", "batches", "windows", "rewarded"} {
			if held[t] > 0 {
				return nil, fmt.Errorf("%w: %s holds no census record but %d file(s) of topic %s: the census topic was not "+
					"snapshotted (or its files were removed), so every count would read 0; snapshot every topic of the run "+
					"(trajflow run snapshot, or trajflow demo --out)", ErrIncomplete, runDir, held[t], t)
			}
		}
	}
	r := &Report{Kinds: map[string]map[string]bool{}, Reasons: map[string]map[string]bool{},
		FailedInfra: map[string]bool{}, FailedTask: map[string]bool{}, Admitted: map[string]bool{}, Retried: map[string]int{},
		Unattributed: map[string]int{},
		lives:        map[string]*life{}, updateStart: map[int64]int64{}, updateVersion: map[int64]int64{}}
	r.Unreadable = snap.Unreadable
	r.Warnings = holes(runDir, files)
	missing, err := parquet.Missing(runDir)
	if err != nil {
		return nil, err
	}
	for _, f := range missing {
		if !slices.Contains(read, f.Topic) { // those of the topics read are Unreadable
			r.Warnings = append(r.Warnings, fmt.Sprintf("%v; the census does not read topic %s", parquet.MissingError(f), f.Topic))
		}
	}
	for _, g := range snap.Gaps {
		if slices.Contains(read, g.Topic) {
			r.Warnings = append(r.Warnings, g.String())
		}
	}
	if err := r.addEvents(snap.Topics["census"]); err != nil {
		return nil, err
	}
	r.addAttempts(snap.Topics["trajectories"], rewards(snap.Topics["rewarded"]))
	r.addQuarantine(snap.Topics["quarantine"])
	return r, nil
}

// holes checks the files of the topics the census reads against the
// layout of the contract the snapshot recorded (none when it recorded
// none, or one that does not load).
func holes(runDir string, files []parquet.File) []string {
	path := filepath.Join(runDir, parquet.ContractFile)
	c, err := contract.Load(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return []string{fmt.Sprintf("partitions not checked: %v", err)}
	}
	if err := c.Recorded().Resolve(); err != nil {
		return []string{fmt.Sprintf("partitions not checked: contract %s: %v", path, err)}
	}
	parts, fromStart := operators.SnapshotLayout(c)
	for t := range parts {
		if !slices.Contains(read, t) || t == "quarantine" {
			delete(parts, t) // a quarantine partition without a record is the normal case
		}
	}
	var out []string
	for _, h := range parquet.Holes(files, parts, fromStart) {
		out = append(out, h.String())
	}
	return out
}

// addQuarantine counts the quarantine records and, by reason, those no
// census event ties to an attempt: a refused row carries its attempt's
// id (trajflow-id) and a quarantined event; a refused message carries
// its own id.
func (r *Report) addQuarantine(msgs []parquet.Message) {
	attempts := map[string]bool{}
	for _, ids := range r.Kinds {
		for id := range ids {
			attempts[id] = true
		}
	}
	for _, m := range msgs {
		r.QuarantineRecords++
		id, reason := "", ""
		for _, h := range m.Headers {
			switch h.Key {
			case schemas.HeaderID:
				id = string(h.Value)
			case schemas.HeaderReason:
				reason = string(h.Value)
			}
		}
		if id == "" || !attempts[id] {
			if reason == "" {
				reason = "(no reason header)"
			}
			r.Unattributed[reason]++
		}
	}
}

// addEvents counts the census events; a redelivered event (same id)
// counts once.
func (r *Report) addEvents(msgs []parquet.Message) error {
	seen := map[string]bool{}
	add := func(m map[string]map[string]bool, k, id string) {
		if m[k] == nil {
			m[k] = map[string]bool{}
		}
		m[k][id] = true
	}
	for _, m := range msgs {
		ev, err := schemas.DecodeCensus(m.Value)
		if err != nil {
			return fmt.Errorf("census event at %d@%d: %w", m.Partition, m.Offset, err)
		}
		if ev.EventID != "" && seen[ev.EventID] {
			continue // redelivered
		}
		seen[ev.EventID] = true
		r.Events++
		add(r.Kinds, ev.Kind, ev.AttemptID)
		r.observe(&ev)
		switch ev.Kind {
		case schemas.CensusQuarantined, schemas.CensusFiltered:
			add(r.Reasons, ev.Kind+"/"+ev.Reason, ev.AttemptID)
		case schemas.CensusFailed:
			if ev.Infra {
				r.FailedInfra[ev.AttemptID] = true
			} else {
				r.FailedTask[ev.AttemptID] = true
			}
		case schemas.CensusAdmitted:
			r.Admitted[ev.AttemptID] = true
		case schemas.CensusRetried:
			r.Retried[ev.Reason]++
		}
	}
	return nil
}

// rewards maps a record id to its total reward.
func rewards(msgs []parquet.Message) map[string]float64 {
	out := map[string]float64{}
	for _, m := range msgs {
		rows, err := schemas.RewardedTrajectories.Decode(nil, m.Value)
		if err != nil {
			continue // quarantined upstream of nothing: a rewarded message always decodes
		}
		for _, row := range rows {
			out[row.RecordID] = row.RewardTotal
		}
	}
	return out
}

// addAttempts records the facts of every recorded trajectory, once.
func (r *Report) addAttempts(msgs []parquet.Message, rewards map[string]float64) {
	done := map[string]bool{}
	for _, m := range msgs {
		rows, err := schemas.Trajectories.Decode(nil, m.Value)
		if err != nil {
			continue // the validate stage quarantined it; the census counts it
		}
		for _, t := range rows {
			if done[t.RecordID] {
				continue
			}
			done[t.RecordID] = true
			f := Attempt{ID: t.RecordID, Task: t.TaskID, LatencyMS: float64(t.FinishedAt-t.StartedAt) / 1000}
			for _, turn := range t.Turns {
				f.Tokens += len(turn.PromptIDs) + len(turn.ActionIDs) + len(turn.ObservationIDs)
			}
			f.Reward, f.HasReward = rewards[t.RecordID]
			r.Launched = append(r.Launched, f)
			for _, turn := range t.Turns {
				r.GeneratedTokens += int64(len(turn.ActionIDs))
			}
			if l := r.lives[t.RecordID]; l != nil {
				l.reward, l.hasReward = f.Reward, f.HasReward
				if l.tokens == 0 {
					l.tokens = int64(f.Tokens)
				}
			}
		}
	}
	slices.SortFunc(r.Launched, func(a, b Attempt) int { return strings.Compare(a.ID, b.ID) })
}
