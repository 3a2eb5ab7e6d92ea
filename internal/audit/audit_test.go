package audit

import "testing"

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
