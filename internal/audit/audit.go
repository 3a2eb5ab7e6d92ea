// Package audit reads a run's batches and census topics back and accounts
// for every attempt: admitted (how many times), excluded at the update
// (admitted to a batch, then not trained: the lag rule at the optimizer
// step), filtered, quarantined. The
// conformance and fault-injection tests and `trajflow bench` use it to
// report launched / admitted / lost / duplicated.
package audit

import (
	"context"
	"crypto/sha256"
	"fmt"
	"sort"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Report is the accounting of a run.
type Report struct {
	Batches  int
	BatchIDs map[string]int    // batch id -> occurrences in the batches topic
	Admitted map[string]int    // trajectory id -> occurrences in batches
	Filtered map[string]string // trajectory id -> filter reason (census, before a batch)
	// Excluded are trajectories the train stage did not train after their
	// batch was admitted (census "filtered" of stage train, e.g.
	// schemas.ReasonStaleAtUpdate): trajectory id -> reason.
	Excluded    map[string]string
	Quarantined map[string]string // attempt id -> reason (census)
	Census      map[string]int    // census kind -> distinct events
	// StaleTokens sums the stale tokens of the distinct census events:
	// policy tokens the lag rule took out of training, at pack or at the
	// trainer's update (schemas.CensusEvent.StaleTokens).
	StaleTokens int64
	// EnvRetries counts the retried events (one per retry of an
	// environment call) by reason; InfraFailed the failed and timed_out
	// events of the infrastructure, whose attempts the rollout stage runs
	// again under the next attempt number (FailedInfra: attempt id ->
	// reason).
	EnvRetries  map[string]int
	InfraFailed int
	FailedInfra map[string]string
	// Copies counts batch messages that repeat an earlier one byte for byte
	// (same batch id, same content): a producer's retry of a write whose
	// acknowledgement was lost, which the trainer skips by batch id.
	// Conflicts counts batch ids seen again with other content.
	Copies, Conflicts int
	// distinct counts trajectory ids over the first copy of each batch.
	distinct map[string]int
}

// Collect reads the batches and census topics of t from the beginning.
func Collect(ctx context.Context, cfg *pipeline.Config, t pipeline.Topics) (*Report, error) {
	r := &Report{
		BatchIDs: map[string]int{}, Admitted: map[string]int{}, Filtered: map[string]string{}, Excluded: map[string]string{},
		Quarantined: map[string]string{}, Census: map[string]int{}, EnvRetries: map[string]int{},
		FailedInfra: map[string]string{}, distinct: map[string]int{},
	}
	firstCopy := map[string][32]byte{}
	err := pipeline.ScanTail(ctx, cfg, t.Batches, 0, func(m pipeline.Message) error {
		b, err := schemas.PackedBatches.Decode(nil, m.Value)
		if err != nil {
			return fmt.Errorf("audit: batch at %s: %w", m.Ref, err)
		}
		r.Batches++
		r.BatchIDs[b.BatchID]++
		h := sha256.Sum256(m.Value)
		first, seen := firstCopy[b.BatchID]
		switch {
		case !seen:
			firstCopy[b.BatchID] = h
		case first == h:
			r.Copies++
		default:
			r.Conflicts++
		}
		for _, row := range b.Rows {
			for _, id := range row.SegTrajectoryIDs {
				r.Admitted[id]++
				if !seen {
					r.distinct[id]++
				}
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	err = pipeline.ScanTail(ctx, cfg, t.Census, 0, func(m pipeline.Message) error {
		ev, err := schemas.DecodeCensus(m.Value)
		if err != nil {
			return fmt.Errorf("audit: census at %s: %w", m.Ref, err)
		}
		if seen[ev.EventID] {
			return nil
		}
		seen[ev.EventID] = true
		r.Census[ev.Kind]++
		r.StaleTokens += ev.StaleTokens
		switch ev.Kind {
		case schemas.CensusFiltered:
			if ev.Stage == TrainStage {
				r.Excluded[ev.AttemptID] = ev.Reason
			} else {
				r.Filtered[ev.AttemptID] = ev.Reason
			}
		case schemas.CensusQuarantined:
			r.Quarantined[ev.AttemptID] = ev.Reason
		case schemas.CensusRetried:
			r.EnvRetries[ev.Reason]++
		case schemas.CensusFailed, schemas.CensusTimedOut:
			if ev.Infra {
				r.InfraFailed++
				r.FailedInfra[ev.AttemptID] = ev.Reason
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return r, nil
}

// TrainStage is the stage name of the trainer's census events.
const TrainStage = "train"

// Counts is the accounting of a set of launched attempts. Every launched
// attempt is in exactly one of Admitted, Excluded, Filtered, Quarantined
// and Lost.
type Counts struct {
	Launched int
	Admitted int // distinct ids in batches, not excluded at the update
	// Excluded: admitted to a batch, then not trained (the trainer's lag
	// rule took every token out: census filtered by the train stage).
	// Neither lost nor trained.
	Excluded    int
	Filtered    int
	Quarantined int
	Lost        int // launched, never admitted, filtered or quarantined
	Duplicated  int // extra occurrences of admitted ids, plus repeated batch ids
	LostIDs     []string
	// Retried counts the launched attempts (AccountAttempts) that failed
	// for the infrastructure and are accounted by the try that ran them
	// again; RetriedTries counts those failed tries by reason.
	Retried      int
	RetriedTries map[string]int
}

// Account compares the report with the launched attempt ids.
func (r *Report) Account(launched []string) Counts {
	c := Counts{Launched: len(launched)}
	for _, id := range launched {
		switch {
		case r.Admitted[id] > 0 && r.Excluded[id] != "":
			c.Excluded++
		case r.Admitted[id] > 0:
			c.Admitted++
		case r.Filtered[id] != "":
			c.Filtered++
		case r.Quarantined[id] != "":
			c.Quarantined++
		default:
			c.Lost++
			c.LostIDs = append(c.LostIDs, id)
		}
	}
	for _, n := range r.Admitted {
		if n > 1 {
			c.Duplicated += n - 1
		}
	}
	for _, n := range r.BatchIDs {
		if n > 1 {
			c.Duplicated += n - 1
		}
	}
	sort.Strings(c.LostIDs)
	return c
}

// AccountAttempts is Account over launched attempts, following each try
// that failed for a reason of the infrastructure to its retry (rollout
// runs the group again under the next attempt number,
// schemas.AttemptID(run, task, group, member, n+1)): an attempt is
// accounted by the fate of its last try. A failed try whose retry has no
// fate is lost.
func (r *Report) AccountAttempts(launched []schemas.TaskAttempt) Counts {
	last := make([]string, len(launched))
	retried, tries := 0, map[string]int{}
	for i, a := range launched {
		id := a.AttemptID
		for n := a.Attempt; ; n++ {
			reason, failed := r.FailedInfra[id]
			if !failed || r.decided(id) {
				break
			}
			tries[reason]++
			id = schemas.AttemptID(a.RunID, a.TaskID, a.GroupID, a.Member, n+1)
		}
		if id != a.AttemptID {
			retried++
		}
		last[i] = id
	}
	c := r.Account(last)
	c.RetriedTries = tries
	c.Retried = retried
	return c
}

// decided reports whether attempt id was admitted, filtered or
// quarantined.
func (r *Report) decided(id string) bool {
	return r.Admitted[id] > 0 || r.Filtered[id] != "" || r.Quarantined[id] != ""
}

// AccountDistinct is Account over the batches as the trainer takes them:
// the first copy of each batch id. Identical copies (Copies) are not
// duplicates there; a trajectory in two batches, or a batch id with two
// contents (Conflicts), still is.
func (r *Report) AccountDistinct(launched []string) Counts {
	d := *r
	d.Admitted, d.BatchIDs = r.distinct, map[string]int{}
	c := d.Account(launched)
	c.Duplicated += r.Conflicts
	return c
}

func (c Counts) String() string {
	return fmt.Sprintf("launched=%d admitted=%d excluded=%d filtered=%d quarantined=%d lost=%d duplicated=%d",
		c.Launched, c.Admitted, c.Excluded, c.Filtered, c.Quarantined, c.Lost, c.Duplicated)
}
