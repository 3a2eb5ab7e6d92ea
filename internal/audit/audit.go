// Package audit reads a run's batches and census topics back and accounts
// for every attempt: admitted (how many times), excluded at the update
// (admitted to a batch, then not trained: the lag rule at the optimizer
// step), filtered, quarantined. The
// conformance and fault-injection tests and `trajflow bench` use it to
// report launched / admitted / lost / duplicated.
package audit

import (
	"context"
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
	// environment call) by reason; InfraFailed the failed events of the
	// infrastructure, whose attempts the rollout stage runs again under
	// the next attempt number (FailedInfra: their attempt ids).
	EnvRetries  map[string]int
	InfraFailed int
	FailedInfra map[string]bool
}

// Collect reads the batches and census topics of t from the beginning.
func Collect(ctx context.Context, cfg *pipeline.Config, t pipeline.Topics) (*Report, error) {
	r := &Report{
		BatchIDs: map[string]int{}, Admitted: map[string]int{}, Filtered: map[string]string{}, Excluded: map[string]string{},
		Quarantined: map[string]string{}, Census: map[string]int{}, EnvRetries: map[string]int{},
		FailedInfra: map[string]bool{},
	}
	err := pipeline.ScanTail(ctx, cfg, t.Batches, 0, func(m pipeline.Message) error {
		b, err := schemas.PackedBatches.Decode(nil, m.Value)
		if err != nil {
			return fmt.Errorf("audit: batch at %s: %w", m.Ref, err)
		}
		r.Batches++
		r.BatchIDs[b.BatchID]++
		for _, row := range b.Rows {
			for _, id := range row.SegTrajectoryIDs {
				r.Admitted[id]++
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
		case schemas.CensusFailed:
			if ev.Infra {
				r.InfraFailed++
				r.FailedInfra[ev.AttemptID] = true
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
	// Retried counts the launched attempts (AccountAttempts) that failed
	// for the infrastructure and are accounted by the attempt that ran
	// them again.
	Retried int
	LostIDs []string
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

// AccountAttempts is Account over the launched attempts, following
// infrastructure retries: an attempt with a failed event of the
// infrastructure was run again as the next attempt number
// (schemas.AttemptID(run, task, group, member, n+1)), whose fate is then
// its fate (Counts.Retried counts those).
func (r *Report) AccountAttempts(launched []schemas.TaskAttempt) Counts {
	ids := make([]string, len(launched))
	retried := 0
	for i, a := range launched {
		id := a.AttemptID
		for n := a.Attempt + 1; r.FailedInfra[id] && !r.decided(id); n++ {
			id = schemas.AttemptID(a.RunID, a.TaskID, a.GroupID, a.Member, n)
		}
		if id != a.AttemptID {
			retried++
		}
		ids[i] = id
	}
	c := r.Account(ids)
	c.Retried = retried
	return c
}

// decided reports whether attempt id was admitted, filtered or
// quarantined.
func (r *Report) decided(id string) bool {
	return r.Admitted[id] > 0 || r.Filtered[id] != "" || r.Quarantined[id] != ""
}

func (c Counts) String() string {
	return fmt.Sprintf("launched=%d admitted=%d excluded=%d filtered=%d quarantined=%d lost=%d duplicated=%d",
		c.Launched, c.Admitted, c.Excluded, c.Filtered, c.Quarantined, c.Lost, c.Duplicated)
}
