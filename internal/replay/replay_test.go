package replay_test

import (
	"context"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/replay"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/schemas"
)

// TestReplaySyntheticRun: every batch of a synthetic run rebuilt from its
// snapshot is byte-identical to the recorded one.
func TestReplaySyntheticRun(t *testing.T) {
	run := testkit.StartRun(t, testkit.LoadContract(t, "../../testdata/contracts/conformance.yaml"), "")
	dir := run.SnapshotRun(t, 40)
	runDir, err := parquet.FindRun(dir, "")
	if err != nil {
		t.Fatal(err)
	}
	rep, err := replay.Run(context.Background(), runDir, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range rep.Notes {
		t.Log(n)
	}
	t.Logf("%d of %d batches identical", rep.Identical, rep.Batches)
	if rep.Diff != "" || rep.Batches == 0 || rep.Identical != rep.Batches {
		t.Fatalf("replay: %d of %d batches identical, diff %q", rep.Identical, rep.Batches, rep.Diff)
	}
	for _, stage := range []string{"validate", "reward", "advantage"} {
		found := false
		for _, n := range rep.Notes {
			found = found || strings.HasPrefix(n, stage)
		}
		if !found {
			t.Errorf("no note for %s: %v", stage, rep.Notes)
		}
	}
}

func TestBatchDiffNamesField(t *testing.T) {
	b := schemas.PackedBatch{BatchID: "b", RunID: "r", TokenBudget: 4, Rows: []schemas.PackedRow{{
		InputIDs: []int32{1, 2}, PositionIDs: []int32{0, 1}, SegmentIDs: []int32{0, 0}, ActionMask: []uint8{1, 0},
		OldLogprobs: []float32{-1, 0}, Advantages: []float32{0.5, 0}, ValueTargets: []float32{0, 0},
		TurnIDs: []int32{0, -1}, PolicyVersions: []int32{0, -1}, SegTrajectoryIDs: []string{"t"}, SegGroupIDs: []string{"g"},
		SegPolicyVersions: []int64{0}, SegLengths: []int32{2}, SegWeights: []float32{1}, SegTruncated: []bool{false},
	}}}
	want, err := schemas.PackedBatches.Encode(nil, b)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		mutate func(*schemas.PackedBatch)
		field  string
	}{
		{"advantage", func(b *schemas.PackedBatch) { b.Rows[0].Advantages = []float32{0.25, 0} }, "Rows[0].advantages[0]"},
		{"trainer version", func(b *schemas.PackedBatch) { b.TrainerVersion = 3 }, "trainer_version"},
		{"mask", func(b *schemas.PackedBatch) { b.Rows[0].ActionMask = []uint8{0, 0} }, "Rows[0].action_mask[0]"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := b
			c.Rows = []schemas.PackedRow{b.Rows[0]}
			tc.mutate(&c)
			got, err := schemas.PackedBatches.Encode(nil, c)
			if err != nil {
				t.Fatal(err)
			}
			if d := replay.BatchDiff(want, got); !strings.Contains(d, tc.field) {
				t.Fatalf("diff %q does not name %s", d, tc.field)
			}
		})
	}
}
