package audit

import (
	"testing"

	"github.com/trajflow/trajflow/schemas"
)

// TestAccountAttemptsFollowsRetries: an attempt that failed for the
// infrastructure is accounted by the attempt that ran it again (once or
// twice), not lost; one whose retry was never decided is lost.
func TestAccountAttemptsFollowsRetries(t *testing.T) {
	att := func(member int32) schemas.TaskAttempt {
		return schemas.TaskAttempt{RunID: "run", TaskID: "task", GroupID: "g", Member: member,
			AttemptID: schemas.AttemptID("run", "task", "g", member, 0)}
	}
	id := func(member, n int32) string { return schemas.AttemptID("run", "task", "g", member, n) }
	r := &Report{Admitted: map[string]int{}, Filtered: map[string]string{}, Quarantined: map[string]string{},
		FailedInfra: map[string]bool{}, BatchIDs: map[string]int{}}
	r.Admitted[id(0, 0)] = 1                                                   // never failed
	r.FailedInfra[id(1, 0)], r.Admitted[id(1, 1)] = true, 1                    // retried once
	r.FailedInfra[id(2, 0)], r.FailedInfra[id(2, 1)] = true, true              // retried twice
	r.Filtered[id(2, 2)] = "zero_variance"                                     //
	r.FailedInfra[id(3, 0)] = true                                             // retry never decided
	r.FailedInfra[id(4, 0)], r.Quarantined[id(4, 0)] = true, "infra_exhausted" // decided itself
	c := r.AccountAttempts([]schemas.TaskAttempt{att(0), att(1), att(2), att(3), att(4)})
	if c.Launched != 5 || c.Admitted != 2 || c.Filtered != 1 || c.Quarantined != 1 || c.Lost != 1 || c.Retried != 3 || c.LostIDs[0] != id(3, 1) {
		t.Fatalf("%v retried %d lost %v", c, c.Retried, c.LostIDs)
	}
	if plain := r.Account([]string{id(1, 0)}); plain.Lost != 1 {
		t.Fatalf("Account does not follow retries: %v", plain)
	}
}

// TestAccountExcluded: an attempt admitted to a batch and excluded by the
// trainer's lag rule is neither lost nor admitted (trained): it is
// excluded; every launched attempt is in exactly one category.
func TestAccountExcluded(t *testing.T) {
	r := &Report{
		BatchIDs: map[string]int{"b0": 1},
		Admitted: map[string]int{"a": 1, "b": 1},
		Filtered: map[string]string{"c": "zero_variance"},
		Excluded: map[string]string{"b": "stale_at_update"},
	}
	c := r.Account([]string{"a", "b", "c", "d"})
	if c.Admitted != 1 || c.Excluded != 1 || c.Filtered != 1 || c.Lost != 1 || c.Duplicated != 0 {
		t.Fatalf("counts %v, want admitted 1, excluded 1, filtered 1, lost 1", c)
	}
	if c.Admitted+c.Excluded+c.Filtered+c.Quarantined+c.Lost != c.Launched {
		t.Fatalf("categories do not partition the launched attempts: %v", c)
	}
}
