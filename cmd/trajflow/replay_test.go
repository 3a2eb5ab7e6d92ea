package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

const conformanceContract = "../../testdata/contracts/conformance.yaml"

// highWaterMarks returns the end offset of every partition of the run's
// topics.
func highWaterMarks(t testing.TB, run *testkit.Run) map[string]map[int]int64 {
	t.Helper()
	out := map[string]map[int]int64{}
	for _, spec := range operators.TopicSpecs(run.Contract, run.Topics) {
		out[spec.Name] = map[int]int64{}
		for p := range spec.Partitions {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			conn, err := kafkago.DialLeader(ctx, "tcp", run.Addr, spec.Name, p)
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

// covered reports whether the snapshot files hold every offset below the
// high-water marks, and the first partition that is behind.
func covered(t testing.TB, run *testkit.Run, dir string, hwm map[string]map[int]int64) (bool, string) {
	t.Helper()
	files, err := parquet.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	last := map[string]int64{}
	for _, f := range files {
		k := f.Topic + "/" + string(rune('0'+f.Partition))
		if f.LastOffset+1 > last[k] {
			last[k] = f.LastOffset + 1
		}
	}
	for topic, parts := range hwm {
		for p, end := range parts {
			k := parquet.ShortTopic(run.Contract.RunID, topic) + "/" + string(rune('0'+p))
			if last[k] < end {
				return false, k
			}
		}
	}
	return true, ""
}

func waitCovered(t testing.TB, run *testkit.Run, dir string, timeout time.Duration) {
	t.Helper()
	hwm := highWaterMarks(t, run)
	deadline := time.Now().Add(timeout)
	for {
		ok, behind := covered(t, run, dir, hwm)
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("snapshot does not cover %s after %v", behind, timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// startSnapshot runs the snapshot stage in-process.
func startSnapshot(t testing.TB, run *testkit.Run, dir string) (stop func() error) {
	t.Helper()
	st, err := operators.New("snapshot", operators.Deps{
		Contract: run.Contract, Topics: run.Topics, VocabSize: 32000,
		SnapshotDir: dir, SnapshotRollBytes: 256 << 10, SnapshotRollInterval: 200 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	cfg := run.Config("snapshot", t.TempDir())
	cfg.TickInterval = 50 * time.Millisecond
	op, err := pipeline.NewOperator(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- op.Run(ctx) }()
	stopped := false
	stop = func() error {
		if stopped {
			return nil
		}
		stopped = true
		cancel()
		if err := <-done; err != pipeline.ErrStopped {
			return err
		}
		return nil
	}
	t.Cleanup(func() { stop() })
	return stop
}

// syntheticRun runs validate, reward, advantage, pack and the snapshot
// over synthetic groups and returns the snapshot directory once it holds
// every message of the run.
func syntheticRun(t *testing.T, groups int64) (*testkit.Run, string) {
	c := testkit.LoadContract(t, conformanceContract)
	run := testkit.StartRun(t, c, "")
	dir := t.TempDir()
	stopSnap := startSnapshot(t, run, dir)
	s := run.Synth(300, 3000)
	ids := run.Produce(t, s, 0, groups)
	var stops []func() error
	for _, name := range []string{"validate", "reward", "advantage", "pack"} {
		stops = append(stops, run.StartOperator(t, name, t.TempDir()))
	}
	counts := run.WaitAccounted(t, ids, 30*time.Second)
	if counts.Lost != 0 {
		t.Fatalf("pipeline lost records: %v", counts)
	}
	for i := len(stops) - 1; i >= 0; i-- {
		if err := stops[i](); err != nil {
			t.Fatal(err)
		}
	}
	waitCovered(t, run, dir, 30*time.Second)
	if err := stopSnap(); err != nil {
		t.Fatal(err)
	}
	return run, dir
}

func TestReplaySyntheticRun(t *testing.T) {
	_, dir := syntheticRun(t, 40)
	rep, err := replayRun(context.Background(), mustRunDir(t, dir), "")
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

	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"replay", dir}, &out, &errb); code != 0 {
		t.Fatalf("trajflow replay: exit %d: %s", code, errb.String())
	}
	if want := "batches identical"; !strings.Contains(out.String(), want) {
		t.Fatalf("output %q lacks %q", out.String(), want)
	}

	t.Run("census", func(t *testing.T) {
		var out, errb bytes.Buffer
		if code := run(context.Background(), []string{"census", dir}, &out, &errb); code != 0 {
			t.Fatalf("trajflow census: exit %d: %s", code, errb.String())
		}
		for _, want := range []string{"launched", "admitted", "filtered", "by task", "reward"} {
			if !strings.Contains(out.String(), want) {
				t.Fatalf("census output lacks %q:\n%s", want, out.String())
			}
		}
		t.Log(out.String())
	})

	t.Run("to-brokers", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		b, err := kafka.StartBroker(ctx, kafka.BrokerConfig{})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		var out, errb bytes.Buffer
		if code := run(ctx, []string{"replay", dir, "--to-brokers", b.Addr()}, &out, &errb); code != 0 {
			t.Fatalf("replay --to-brokers: exit %d: %s", code, errb.String())
		}
		snap, err := parquet.ReadRun(mustRunDir(t, dir), []string{"batches"}, parquet.ReadOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cfg := pipeline.Config{Brokers: []string{b.Addr()}}
		var got []pipeline.Message
		err = pipeline.ScanTail(ctx, &cfg, snap.FullTopics["batches"], 1<<20, func(m pipeline.Message) error {
			got = append(got, m)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		want := snap.Topics["batches"]
		if len(got) != len(want) {
			t.Fatalf("%d batches re-emitted, snapshot holds %d", len(got), len(want))
		}
		for i := range got {
			if !bytes.Equal(got[i].Value, want[i].Value) || got[i].Offset != want[i].Offset {
				t.Fatalf("re-emitted batch %d differs", i)
			}
		}
	})

	t.Run("corrupt byte names the file", func(t *testing.T) {
		files, err := parquet.List(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, topic := range []string{"scored", "batches", "windows"} {
			var path string
			for _, f := range files {
				if f.Topic == topic {
					path = f.Path
					break
				}
			}
			if path == "" {
				t.Fatalf("no %s file", topic)
			}
			orig, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			b := bytes.Clone(orig)
			b[len(b)/2] ^= 1
			if err := os.WriteFile(path, b, 0o644); err != nil {
				t.Fatal(err)
			}
			var out, errb bytes.Buffer
			code := run(context.Background(), []string{"replay", dir}, &out, &errb)
			if err := os.WriteFile(path, orig, 0o644); err != nil {
				t.Fatal(err)
			}
			if code != 1 || !strings.Contains(errb.String(), path) {
				t.Fatalf("%s corrupted: exit %d, stderr %q; want exit 1 naming %s", topic, code, errb.String(), path)
			}
		}
	})
	t.Run("wrong contract", func(t *testing.T) {
		other := filepath.Join(t.TempDir(), "c.yaml")
		b, err := os.ReadFile(filepath.Join(mustRunDir(t, dir), parquet.ContractFile))
		if err != nil {
			t.Fatal(err)
		}
		changed := regexp.MustCompile(`(?m)^seed: .*$`).ReplaceAll(b, []byte("seed: 987654"))
		if bytes.Equal(changed, b) {
			t.Fatal("recorded contract has no seed line")
		}
		if err := os.WriteFile(other, changed, 0o644); err != nil {
			t.Fatal(err)
		}
		var out, errb bytes.Buffer
		if code := run(context.Background(), []string{"replay", dir, "--contract", other}, &out, &errb); code != 1 || !strings.Contains(errb.String(), "hash") {
			t.Fatalf("replay under another contract: exit %d, %q", code, errb.String())
		}
	})

	t.Run("missing trajectories name the batch", func(t *testing.T) {
		files, err := parquet.List(dir)
		if err != nil {
			t.Fatal(err)
		}
		var victim parquet.File
		for _, f := range files {
			if f.Topic == "trajectories" {
				victim = f
				break
			}
		}
		moved := filepath.Join(t.TempDir(), "x")
		if err := os.Rename(victim.Path, moved); err != nil {
			t.Fatal(err)
		}
		defer os.Rename(moved, victim.Path)
		var out, errb bytes.Buffer
		code := run(context.Background(), []string{"replay", dir}, &out, &errb)
		if code != 1 || !strings.Contains(errb.String(), "first difference: batch ") {
			t.Fatalf("replay without %s: exit %d, stdout %q, stderr %q", victim.Path, code, out.String(), errb.String())
		}
		t.Log(strings.TrimSpace(errb.String()))
	})
}

func mustRunDir(t testing.TB, dir string) string {
	t.Helper()
	d, err := parquet.FindRun(dir, "")
	if err != nil {
		t.Fatal(err)
	}
	return d
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
			if d := batchDiff(want, got); !strings.Contains(d, tc.field) {
				t.Fatalf("diff %q does not name %s", d, tc.field)
			}
		})
	}
}

// TestSnapshotSIGKILL kills `trajflow run snapshot` (a separate process)
// with SIGKILL while the run is producing, restarts it, and checks that
// the files hold every offset of every partition exactly once.
func TestSnapshotSIGKILL(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "trajflow")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	c := testkit.LoadContract(t, conformanceContract)
	run := testkit.StartRun(t, c, "")
	dir := t.TempDir()
	state := t.TempDir()
	start := func() *exec.Cmd {
		cmd := exec.Command(bin, "run", "snapshot", "--brokers", run.Addr, "--contract", conformanceContract,
			"--snapshot-dir", dir, "--snapshot-roll-bytes", "65536", "--snapshot-roll-interval", "150ms",
			"--state", state, "--log-level", "warn")
		var errb bytes.Buffer
		cmd.Stderr = &errb
		cmd.Stdout = &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if cmd.ProcessState == nil {
				cmd.Process.Kill()
				cmd.Wait()
			}
		})
		return cmd
	}
	s := run.Synth(300, 3000)
	run.Produce(t, s, 0, 30)
	for _, name := range []string{"validate", "reward", "advantage", "pack"} {
		run.StartOperator(t, name, t.TempDir())
	}
	cmd := start()
	// Kill it once it has written some files but not all.
	deadline := time.Now().Add(30 * time.Second)
	for {
		files, err := parquet.List(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(files) >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no snapshot files after 30s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	run.Produce(t, s, 30, 45)
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	before, _ := parquet.List(dir)
	run.Produce(t, s, 45, 60)
	cmd = start()
	waitCovered(t, run, dir, 40*time.Second)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	files, err := parquet.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d files before the kill, %d after the restart", len(before), len(files))
	if len(files) <= len(before) {
		t.Fatalf("restart wrote no file")
	}
	if gaps := parquet.Contiguity(files); len(gaps) > 0 {
		t.Fatalf("offsets not contiguous after SIGKILL and restart: %v", gaps)
	}
	first := map[string]int64{}
	for _, f := range files {
		k := f.Topic + "/" + string(rune('0'+f.Partition))
		if _, ok := first[k]; !ok {
			first[k] = f.FirstOffset
		}
	}
	for k, off := range first {
		if off != 0 {
			t.Fatalf("%s starts at offset %d", k, off)
		}
	}
	// Every file verifies, and no message appears twice.
	snap, err := parquet.ReadRun(mustRunDir(t, dir), nil, parquet.ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for topic, msgs := range snap.Topics {
		seen := map[[2]int64]bool{}
		for _, m := range msgs {
			k := [2]int64{int64(m.Partition), m.Offset}
			if seen[k] {
				t.Fatalf("%s/%d@%d written twice", topic, m.Partition, m.Offset)
			}
			seen[k] = true
		}
	}
}
