package testkit

import (
	"context"
	"strconv"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
)

// HighWaterMarks returns the end offset of every partition of the run's
// topics.
func (r *Run) HighWaterMarks(t testing.TB) map[string]map[int]int64 {
	t.Helper()
	out := map[string]map[int]int64{}
	for _, spec := range operators.TopicSpecs(r.Contract, r.Topics) {
		out[spec.Name] = map[int]int64{}
		for p := range spec.Partitions {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			conn, err := kafkago.DialLeader(ctx, "tcp", r.Addr, spec.Name, p)
			if err != nil {
				cancel()
				t.Fatalf("dial %s/%d: %v", spec.Name, p, err)
			}
			hwm, err := conn.ReadLastOffset()
			conn.Close()
			cancel()
			if err != nil {
				t.Fatalf("last offset %s/%d: %v", spec.Name, p, err)
			}
			out[spec.Name][p] = hwm
		}
	}
	return out
}

// covered reports whether the snapshot files in dir hold every offset
// below the high-water marks, and the first partition that is behind.
func (r *Run) covered(t testing.TB, dir string, hwm map[string]map[int]int64) (bool, string) {
	t.Helper()
	files, err := parquet.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	last := map[string]int64{}
	for _, f := range files {
		k := f.Topic + "/" + strconv.Itoa(f.Partition)
		if f.LastOffset+1 > last[k] {
			last[k] = f.LastOffset + 1
		}
	}
	for topic, parts := range hwm {
		for p, end := range parts {
			k := parquet.ShortTopic(r.Contract.RunID, topic) + "/" + strconv.Itoa(p)
			if last[k] < end {
				return false, k
			}
		}
	}
	return true, ""
}

// WaitCovered waits until the snapshot files in dir hold every message the
// run's topics hold now.
func (r *Run) WaitCovered(t testing.TB, dir string, timeout time.Duration) {
	t.Helper()
	hwm := r.HighWaterMarks(t)
	deadline := time.Now().Add(timeout)
	for {
		ok, behind := r.covered(t, dir, hwm)
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("snapshot does not cover %s after %v", behind, timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// StartSnapshot runs the snapshot operator writing the run's topics under
// dir (small files, rolled often) until the returned stop function is
// called; stop returns Run's error (nil after a graceful stop).
func (r *Run) StartSnapshot(t testing.TB, dir string) (stop func() error) {
	t.Helper()
	cfg := r.Config("snapshot", t.TempDir())
	cfg.TickInterval = 50 * time.Millisecond
	op, err := operators.NewOperator("snapshot", operators.Deps{
		Contract: r.Contract, Topics: r.Topics, VocabSize: 32000,
		SnapshotDir: dir, SnapshotRollBytes: 256 << 10, SnapshotRollInterval: 200 * time.Millisecond,
	}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- op.Run(ctx) }()
	stopped := false
	var result error
	stop = func() error {
		if stopped {
			return result
		}
		stopped = true
		cancel()
		if err := <-done; err != pipeline.ErrStopped {
			result = err
		}
		return result
	}
	t.Cleanup(func() { stop() })
	return stop
}

// SnapshotRun runs validate, reward, advantage, pack and the snapshot
// over synthetic groups [0, groups) of the run's contract and returns the
// snapshot directory once it holds every message of the run.
func (r *Run) SnapshotRun(t *testing.T, groups int64) string {
	t.Helper()
	dir := t.TempDir()
	stopSnap := r.StartSnapshot(t, dir)
	ids := r.Produce(t, r.Synth(300, 3000), 0, groups)
	var stops []func() error
	for _, name := range []string{"validate", "reward", "advantage", "pack"} {
		stops = append(stops, r.StartOperator(t, name, t.TempDir()))
	}
	if counts := r.WaitAccounted(t, ids, 30*time.Second); counts.Lost != 0 {
		t.Fatalf("pipeline lost records: %v", counts)
	}
	for i := len(stops) - 1; i >= 0; i-- {
		if err := stops[i](); err != nil {
			t.Fatal(err)
		}
	}
	r.WaitCovered(t, dir, 30*time.Second)
	if err := stopSnap(); err != nil {
		t.Fatal(err)
	}
	return dir
}
