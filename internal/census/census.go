// Package census reads the attempt census of a run from its Parquet
// snapshots (pipeline §6, §9; systems §6): the funnel of every attempt
// from dispatched to trained, with the quarantine and filter reasons, and
// the selection-bias check — what was admitted against what was launched,
// by task and by reward, length and latency, with the denominators.
package census

import (
	"fmt"
	"slices"
	"strings"

	"github.com/trajflow/trajflow/connectors/parquet"
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
}

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

// Collect reads the census, trajectories and rewarded topics of the run
// snapshot in runDir.
func Collect(runDir string) (*Report, error) {
	snap, err := parquet.ReadRun(runDir, []string{"census", "trajectories", "rewarded"}, parquet.ReadOptions{})
	if err != nil {
		return nil, err
	}
	r := &Report{Kinds: map[string]map[string]bool{}, Reasons: map[string]map[string]bool{},
		FailedInfra: map[string]bool{}, FailedTask: map[string]bool{}, Admitted: map[string]bool{}, Retried: map[string]int{},
		lives: map[string]*life{}, updateStart: map[int64]int64{}, updateVersion: map[int64]int64{}}
	if err := r.addEvents(snap.Topics["census"]); err != nil {
		return nil, err
	}
	r.addAttempts(snap.Topics["trajectories"], rewards(snap.Topics["rewarded"]))
	return r, nil
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
