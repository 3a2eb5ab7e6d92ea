package offline_test

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/ipc"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/offline"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

func demoDeps(t *testing.T) operators.Deps {
	t.Helper()
	c := contract.Default()
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	d, err := operators.BuiltinDeps(c)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestTrainIsTheLiveTrainer: `trajflow stage train` over the batches of a
// demo run publishes the releases the demo's trainer published, checkpoint
// for checkpoint.
func TestTrainIsTheLiveTrainer(t *testing.T) {
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	sum, err := loop.Run(ctx, loop.Options{Updates: 2, Seed: 1, Out: out, EvalSamples: 1, Quiet: true}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	runDir, err := parquet.FindRun(out, "")
	if err != nil {
		t.Fatal(err)
	}
	snap, err := parquet.ReadRun(t.Context(), runDir, []string{"batches", "policy"}, parquet.ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := map[int64]string{}
	for _, m := range snap.Topics["policy"] {
		rel, err := schemas.DecodeRelease(m.Value)
		if err != nil {
			t.Fatal(err)
		}
		want[rel.PolicyVersion] = rel.CheckpointHash
	}
	in := filepath.Join(t.TempDir(), "batches.arrow")
	f, err := os.Create(in)
	if err != nil {
		t.Fatal(err)
	}
	w := ipc.NewWriter(f, ipc.WithSchema(schemas.PackedBatches.Schema()))
	for _, m := range snap.Topics["batches"] {
		b, err := schemas.PackedBatches.Decode(nil, m.Value)
		if err != nil {
			t.Fatal(err)
		}
		rec, err := schemas.PackedBatches.ToRecord(nil, b)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Write(rec); err != nil {
			t.Fatal(err)
		}
		rec.Release()
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	// The same messages as the topic carried them: the raw values one
	// after the other (as saved from Kafka), and the snapshot's own
	// Parquet file of the batches topic (one partition).
	var raw []byte
	for _, m := range snap.Topics["batches"] {
		raw = append(raw, m.Value...)
	}
	concatenated := filepath.Join(t.TempDir(), "messages.arrows")
	if err := os.WriteFile(concatenated, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	pq, err := filepath.Glob(filepath.Join(runDir, "topic=batches", "partition=*", "*.parquet"))
	if err != nil || len(pq) != 1 {
		t.Fatalf("the batches topic's snapshot files: %v %v, want one", pq, err)
	}
	for _, input := range []string{in, concatenated, pq[0]} {
		checkTrainFrom(t, ctx, input, sum.Updates, len(snap.Topics["batches"]), want)
	}
}

// checkTrainFrom runs train offline over in and checks its releases'
// checkpoints against want (version -> checkpoint hash of the live run).
func checkTrainFrom(t *testing.T, ctx context.Context, in string, updates, batches int, want map[int64]string) {
	t.Helper()
	deps := demoDeps(t)
	deps.ReleaseDir = t.TempDir()
	manifests := filepath.Join(t.TempDir(), "releases.jsonl")
	rep, err := offline.Run(ctx, offline.Options{Stage: "train", In: in, Out: manifests, Deps: deps, TrainerVersion: -1})
	if err != nil {
		t.Fatalf("train over %s: %v", in, err)
	}
	if len(rep.Releases) != updates+1 || rep.Inputs != batches || len(rep.Refusals) != 0 {
		t.Fatalf("%s: %d releases from %d batches (%d refused), want the initial one and %d", in, len(rep.Releases), rep.Inputs, len(rep.Refusals), updates)
	}
	for _, rel := range rep.Releases {
		if want[rel.PolicyVersion] == "" || rel.CheckpointHash != want[rel.PolicyVersion] {
			t.Fatalf("version %d: checkpoint %s offline, %s in the demo", rel.PolicyVersion, rel.CheckpointHash, want[rel.PolicyVersion])
		}
		if _, err := os.Stat(strings.TrimPrefix(rel.CheckpointURI, "file://")); err != nil {
			t.Fatalf("version %d: %v", rel.PolicyVersion, err)
		}
	}
	lines, err := os.ReadFile(manifests)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(lines), "\n"); n != len(rep.Releases) {
		t.Fatalf("%d manifest lines for %d releases", n, len(rep.Releases))
	}
}

func TestInputErrors(t *testing.T) {
	deps := demoDeps(t)
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage.arrow")
	if err := os.WriteFile(garbage, []byte("not arrow"), 0o644); err != nil {
		t.Fatal(err)
	}
	v, err := schemas.PackedBatches.Encode(nil, schemas.PackedBatch{BatchID: "b", Rows: []schemas.PackedRow{{}}})
	if err != nil {
		t.Fatal(err)
	}
	wrongKind := filepath.Join(dir, "batches.arrow")
	if err := os.WriteFile(wrongKind, v, 0o644); err != nil {
		t.Fatal(err)
	}
	empty, fakeParquet := filepath.Join(dir, "empty.arrow"), filepath.Join(dir, "cut.parquet")
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(fakeParquet, []byte("PAR1 and nothing else"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		o    offline.Options
		want string
	}{
		{offline.Options{Stage: "rollout", In: garbage}, "no offline stage"},
		{offline.Options{Stage: "validate", In: filepath.Join(dir, "missing.arrow")}, "missing.arrow"},
		{offline.Options{Stage: "validate", In: garbage}, garbage},
		{offline.Options{Stage: "validate", In: wrongKind}, "record batch 0"},
		{offline.Options{Stage: "validate", In: empty}, "empty file: want an Arrow IPC stream of the records of demo.trajectories"},
		{offline.Options{Stage: "validate", In: fakeParquet}, fakeParquet},
	}
	for _, tc := range cases {
		tc.o.Deps = deps
		_, err := offline.Run(context.Background(), tc.o)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s over %s: %v, want an error naming %q", tc.o.Stage, tc.o.In, err, tc.want)
		}
	}
	if _, err := offline.Run(context.Background(), offline.Options{Stage: "dispatch", Deps: deps}); !errors.Is(err, offline.ErrStage) {
		t.Errorf("dispatch: %v, want ErrStage", err)
	}
}
