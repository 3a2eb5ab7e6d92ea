package schemas

import "testing"

func TestIDsAreDeterministicAndDistinct(t *testing.T) {
	g := GroupID("run", "task-1", 3)
	if g != GroupID("run", "task-1", 3) {
		t.Fatal("GroupID is not deterministic")
	}
	if len(g) != 32 {
		t.Fatalf("id %q has %d hex digits, want 32", g, len(g))
	}
	a := AttemptID("run", "task-1", g, 2, 0)
	ids := map[string]string{
		"group":            g,
		"attempt":          a,
		"retry":            AttemptID("run", "task-1", g, 2, 1),
		"other member":     AttemptID("run", "task-1", g, 3, 0),
		"turn 0":           TurnID(a, 0),
		"turn 1":           TurnID(a, 1),
		"batch":            BatchID("run", 3),
		"other run batch":  BatchID("run2", 3),
		"derived":          DerivedID("reward", a),
		"other stage":      DerivedID("pack", a),
		"other group":      GroupID("run", "task-1", 4),
		"split boundary 1": GroupID("ru", "ntask-1", 3), // length prefixes keep ("ru","ntask-1") apart from ("run","task-1")
	}
	seen := map[string]string{}
	for name, id := range ids {
		if other, dup := seen[id]; dup {
			t.Fatalf("%s and %s share id %s", name, other, id)
		}
		seen[id] = name
	}
}

func TestSeedForSeparatesStreams(t *testing.T) {
	id := TurnID(AttemptID("r", "t", GroupID("r", "t", 0), 0, 0), 0)
	a, b := SeedFor(1, id, "sample"), SeedFor(1, id, "sample")
	if a != b {
		t.Fatal("SeedFor is not deterministic")
	}
	for _, other := range []uint64{SeedFor(2, id, "sample"), SeedFor(1, id, "env"), SeedFor(1, id+"x", "sample")} {
		if other == a {
			t.Fatalf("distinct inputs give the same seed %d", a)
		}
	}
}

// TestReleaseConsumed: the batches a release says were consumed, and the
// version for a trainer that does not say.
func TestReleaseConsumed(t *testing.T) {
	for _, tc := range []struct{ version, next, want int64 }{
		{0, 0, 0},
		{3, 0, 3}, // one batch per version
		{8, 7, 7}, // a rollback published release 6 without a batch
		{9, 8, 8},
	} {
		if got := (PolicyRelease{PolicyVersion: tc.version, NextBatch: tc.next}).Consumed(); got != tc.want {
			t.Errorf("release %d, next_batch %d: consumed %d, want %d", tc.version, tc.next, got, tc.want)
		}
	}
}
