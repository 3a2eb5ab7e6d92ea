package replay_test

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/replay"
)

// TestReplayAsyncRun: the batches of an asynchronous run (max_lag 1: two
// rounds in flight, windows mixing them, the trainer's lag rule at every
// update) depend on timing, yet replay rebuilds every one byte for byte
// from the snapshot: the window records hold the decisions and the
// trainer version each window closed with, and the recorded trajectories
// the behavior versions of their turns.
func TestReplayAsyncRun(t *testing.T) {
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s, err := loop.Run(ctx, loop.Options{Updates: 6, Seed: 2, Async: true, MaxLag: 1, EvalSamples: 1, Quiet: true, Out: out}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if s.Lost != 0 || s.DuplicatesAdmitted != 0 || s.Updates == 0 {
		t.Fatalf("async run: %d updates, lost %d, duplicates %d", s.Updates, s.Lost, s.DuplicatesAdmitted)
	}
	runDir, err := parquet.FindRun(out, "")
	if err != nil {
		t.Fatal(err)
	}
	rep, err := replay.Run(ctx, runDir, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range rep.Notes {
		t.Log(n)
	}
	if rep.Diff != "" || rep.Batches != len(s.BatchHashes) || rep.Identical != rep.Batches {
		t.Fatalf("replay of the async run: %d of %d batches identical (%d recorded), diff %q",
			rep.Identical, rep.Batches, len(s.BatchHashes), rep.Diff)
	}
}
