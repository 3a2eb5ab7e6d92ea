package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/ipc"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// testContractFile writes the conformance contract with each old -> new
// replacement applied and returns its path and the resolved contract.
func testContractFile(t *testing.T, repl ...string) (string, *contract.Contract) {
	t.Helper()
	b, err := os.ReadFile(conformance)
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	for i := 0; i+1 < len(repl); i += 2 {
		if !strings.Contains(s, repl[i]) {
			t.Fatalf("contract has no %q", repl[i])
		}
		s = strings.Replace(s, repl[i], repl[i+1], 1)
	}
	path := filepath.Join(t.TempDir(), "contract.yaml")
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := contract.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	return path, c
}

// synthGroups are groups [from, to) of the contract's synthetic
// distribution, every turn sampled at behavior version `version`.
func synthGroups(c *contract.Contract, from, to, version int64) [][]schemas.Trajectory {
	s := synth.Default()
	s.RunID, s.ContractHash, s.GroupSize, s.MaxTurns = c.RunID, c.Hash(), c.Sampler.GroupSize, c.Sampler.MaxTurns
	s.MeanTokens, s.MaxTokens, s.PolicyVersion, s.MeanLag = 300, 3000, version, 0
	var out [][]schemas.Trajectory
	for g := from; g < to; g++ {
		out = append(out, s.Group(g))
	}
	return out
}

// testWriteBatches writes one record batch per element of batches, as one
// Arrow IPC stream file.
func testWriteBatches[T any](t *testing.T, c *schemas.Codec[T], path string, batches [][]T) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	w := ipc.NewWriter(f, ipc.WithSchema(c.Schema()))
	for _, rows := range batches {
		rec, err := c.ToRecord(nil, rows)
		if err != nil {
			t.Fatal(err)
		}
		err = w.Write(rec)
		rec.Release()
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}

// testReadRecords reads every record batch of an Arrow IPC stream file with
// Arrow's reader and hands each to use.
func testReadRecords(t *testing.T, path string, use func(arrow.RecordBatch)) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r, err := ipc.NewReader(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	defer r.Release()
	n := 0
	for r.Next() {
		use(r.RecordBatch())
		n++
	}
	if err := r.Err(); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return n
}

// stageCLI runs `trajflow stage ARGS...` and returns its exit status,
// stdout and stderr.
func stageCLI(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	code := run(ctx, append([]string{"stage"}, args...), &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// offlineChain runs validate -> reward -> advantage with `trajflow stage`
// over one trajectories file and returns the scored file.
func offlineChain(t *testing.T, cpath, trajectories string) string {
	t.Helper()
	dir := filepath.Dir(trajectories)
	in := trajectories
	for _, name := range []string{"validate", "reward", "advantage"} {
		out := filepath.Join(dir, name+".arrow")
		if code, _, stderr := stageCLI(t, name, "--in", in, "--out", out, "--contract", cpath); code != 0 {
			t.Fatalf("stage %s: exit %d: %s", name, code, stderr)
		}
		in = out
	}
	return in
}

// liveBatches drives validate -> reward -> advantage -> pack, the
// registered stages, through pipeline.Drive over one trajectories message
// per group (as rollout produces them), and returns the batches produced.
func liveBatches(t *testing.T, c *contract.Contract, groups [][]schemas.Trajectory) []schemas.PackedBatch {
	t.Helper()
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		t.Fatal(err)
	}
	deps, err := operators.BuiltinDeps(c)
	if err != nil {
		t.Fatal(err)
	}
	var msgs []pipeline.Message
	for i, g := range groups {
		v, err := schemas.Trajectories.Encode(nil, g)
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, pipeline.Message{Ref: pipeline.Ref{Topic: topics.Trajectories, Offset: int64(i)}, Key: []byte(g[0].GroupID), Value: v})
	}
	chain := []struct{ name, out string }{
		{"validate", topics.Valid}, {"reward", topics.Rewarded}, {"advantage", topics.Scored}, {"pack", topics.Batches},
	}
	for _, step := range chain {
		st, err := operators.New(step.name, deps)
		if err != nil {
			t.Fatal(err)
		}
		d, err := pipeline.Drive(context.Background(), st, msgs, pipeline.DriveConfig{QuarantineTopic: topics.Quarantine,
			Env: pipeline.EnvConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}})
		if err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		if len(d.Held) > 0 {
			t.Fatalf("live %s still holds %v", step.name, d.Held)
		}
		msgs = d.Messages(step.out)
	}
	var out []schemas.PackedBatch
	for _, m := range msgs {
		b, err := schemas.PackedBatches.Decode(nil, m.Value)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, b)
	}
	return out
}

// offlineBatches reads the batches of a `trajflow stage pack --out` file
// with Arrow's reader.
func offlineBatches(t *testing.T, path string) []schemas.PackedBatch {
	t.Helper()
	var out []schemas.PackedBatch
	testReadRecords(t, path, func(rec arrow.RecordBatch) {
		b, err := schemas.PackedBatches.FromRecord(rec)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, b)
	})
	return out
}

// TestStagePackMatchesLive: `trajflow stage pack` decides exactly as the
// live pack stage on the same input. Two 2-member groups with
// batch_groups 1 are two windows of one group each (the live stage counts
// decided groups and keeps a group's members in one window): two batches,
// the same bytes.
func TestStagePackMatchesLive(t *testing.T) {
	cpath, c := testContractFile(t, "group_size: 8", "group_size: 2", "batch_groups: 0", "batch_groups: 1")
	groups := synthGroups(c, 0, 2, 0)
	dir := t.TempDir()
	in := filepath.Join(dir, "trajectories.arrow")
	testWriteBatches(t, schemas.Trajectories, in, groups)
	scored := offlineChain(t, cpath, in)
	out := filepath.Join(dir, "batches.arrow")
	if code, stdout, stderr := stageCLI(t, "pack", "--in", scored, "--out", out, "--contract", cpath); code != 0 {
		t.Fatalf("stage pack: exit %d: %s%s", code, stdout, stderr)
	}
	got := offlineBatches(t, out)
	want := liveBatches(t, c, groups)
	if len(want) != 2 {
		t.Fatalf("the live pack stage made %d batches of two groups with batch_groups 1, want 2", len(want))
	}
	if len(got) != len(want) {
		t.Fatalf("trajflow stage pack made %d batches, the live stage %d", len(got), len(want))
	}
	for i := range want {
		if !reflect.DeepEqual(got[i], want[i]) {
			t.Fatalf("batch %d differs:\noffline %+v\nlive    %+v", i, got[i].Rows[0].SegTrajectoryIDs, want[i].Rows[0].SegTrajectoryIDs)
		}
	}
}

// pyarrowPython finds a Python with pyarrow: $TRAJFLOW_PYTHON, the
// repository's .venv (examples/analyst/setup.sh), or python3.
func pyarrowPython(t *testing.T) string {
	t.Helper()
	for _, c := range []string{os.Getenv("TRAJFLOW_PYTHON"), "../../.venv/bin/python", "python3"} {
		if c != "" && exec.Command(c, "-c", "import pyarrow").Run() == nil {
			return c
		}
	}
	msg := "no Python with pyarrow (run examples/analyst/setup.sh)"
	if os.Getenv("TRAJFLOW_REQUIRE_PYTHON") == "1" {
		t.Fatal(msg)
	}
	t.Skip(msg + "; set TRAJFLOW_REQUIRE_PYTHON=1 to make this a failure")
	return ""
}

// TestStagePackOutputReadable: the --out of `trajflow stage pack` with
// several batches is one Arrow IPC stream of one record batch per batch:
// the project's own decoder reads every batch of it (DecodeAll, and Decode
// per batch after SplitStream), and so does pyarrow.
func TestStagePackOutputReadable(t *testing.T) {
	cpath, c := testContractFile(t, "group_size: 8", "group_size: 2", "batch_groups: 0", "batch_groups: 1")
	dir := t.TempDir()
	in := filepath.Join(dir, "trajectories.arrow")
	testWriteBatches(t, schemas.Trajectories, in, synthGroups(c, 0, 3, 0))
	scored := offlineChain(t, cpath, in)
	out := filepath.Join(dir, "batches.arrow")
	if code, stdout, stderr := stageCLI(t, "pack", "--in", scored, "--out", out, "--contract", cpath); code != 0 {
		t.Fatalf("stage pack: exit %d: %s%s", code, stdout, stderr)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	all, err := schemas.PackedBatches.DecodeAll(nil, b)
	if err != nil {
		t.Fatalf("PackedBatches.DecodeAll: %v", err)
	}
	if len(all) != 3 {
		t.Fatalf("%d batches, want 3 (one per group)", len(all))
	}
	parts, err := schemas.SplitStream(b)
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range parts {
		got, err := schemas.PackedBatches.Decode(nil, p)
		if err != nil {
			t.Fatalf("PackedBatches.Decode of batch %d: %v", i, err)
		}
		if got.BatchIndex != int64(i) || !reflect.DeepEqual(got, all[i]) {
			t.Fatalf("batch %d: index %d", i, got.BatchIndex)
		}
	}
	if arrowGo := offlineBatches(t, out); !reflect.DeepEqual(arrowGo, all) {
		t.Fatal("Arrow's Go reader and DecodeAll disagree")
	}
	py := pyarrowPython(t)
	script := `import sys, pyarrow.ipc as ipc
r = ipc.open_stream(sys.argv[1])
n = 0
for b in r:
    assert b.schema.metadata[b"trajflow.kind"] == b"packed_batch", b.schema.metadata
    assert len(set(b.column("batch_index").to_pylist())) == 1
    n += 1
print(n)`
	pyOut, err := exec.Command(py, "-c", script, out).CombinedOutput()
	if err != nil {
		t.Fatalf("pyarrow: %v\n%s", err, pyOut)
	}
	if strings.TrimSpace(string(pyOut)) != "3" {
		t.Fatalf("pyarrow read %q batches, want 3", pyOut)
	}
}

// TestStagePackTrainerVersionFromInput: without --trainer-version the pack
// stage's trainer version comes from the input, as live (a record sampled
// at version v proves the trainer published v): a group sampled at version
// 0 beside one sampled at version 3 is stale under max_lag 1, and the
// batch carries trainer version 3.
func TestStagePackTrainerVersionFromInput(t *testing.T) {
	cpath, c := testContractFile(t, "max_lag: 8", "max_lag: 1")
	groups := append(synthGroups(c, 0, 1, 0), synthGroups(c, 1, 2, 3)...)
	dir := t.TempDir()
	in := filepath.Join(dir, "trajectories.arrow")
	testWriteBatches(t, schemas.Trajectories, in, groups)
	scored := offlineChain(t, cpath, in)
	out := filepath.Join(dir, "batches.arrow")
	if code, stdout, stderr := stageCLI(t, "pack", "--in", scored, "--out", out, "--contract", cpath); code != 0 {
		t.Fatalf("stage pack: exit %d: %s%s", code, stdout, stderr)
	}
	batches := offlineBatches(t, out)
	if len(batches) != 1 {
		t.Fatalf("%d batches, want 1", len(batches))
	}
	b := batches[0]
	if b.TrainerVersion != 3 {
		t.Fatalf("batch trainer version %d, want 3 (the newest behavior version of the input)", b.TrainerVersion)
	}
	for _, row := range b.Rows {
		for k, id := range row.SegTrajectoryIDs {
			if row.SegPolicyVersions[k] != 3 {
				t.Fatalf("segment %s sampled at version %d admitted under trainer version 3 with max_lag 1", id, row.SegPolicyVersions[k])
			}
		}
	}
	// Given, the trainer version is the given one (a release the trainer
	// published before the first record).
	if code, stdout, stderr := stageCLI(t, "pack", "--in", scored, "--out", out, "--contract", cpath, "--trainer-version", "5"); code != 0 {
		t.Fatalf("stage pack --trainer-version 5: exit %d: %s%s", code, stdout, stderr)
	}
	if bs := offlineBatches(t, out); len(bs) != 0 {
		t.Fatalf("trainer version 5, max_lag 1: %d batches of records sampled at versions 0 and 3, want none", len(bs))
	}
}

// TestStageAdvantageQuarantinesUnscorableGroup: a group the live stage
// cannot score goes to quarantine member by member and the rest of the
// file is scored, as live; the run does not abort.
func TestStageAdvantageQuarantinesUnscorableGroup(t *testing.T) {
	cpath, c := testContractFile(t)
	groups := synthGroups(c, 0, 3, 0)
	dir := t.TempDir()
	in := filepath.Join(dir, "trajectories.arrow")
	testWriteBatches(t, schemas.Trajectories, in, groups)
	rewarded := filepath.Join(dir, "rewarded.arrow")
	for _, step := range [][2]string{{"validate", filepath.Join(dir, "valid.arrow")}, {"reward", rewarded}} {
		src := in
		if step[0] == "reward" {
			src = filepath.Join(dir, "valid.arrow")
		}
		if code, _, stderr := stageCLI(t, step[0], "--in", src, "--out", step[1], "--contract", cpath); code != 0 {
			t.Fatalf("stage %s: exit %d: %s", step[0], code, stderr)
		}
	}
	var batches [][]schemas.Rewarded
	testReadRecords(t, rewarded, func(rec arrow.RecordBatch) {
		rows, err := schemas.RewardedTrajectories.FromRecord(rec)
		if err != nil {
			t.Fatal(err)
		}
		batches = append(batches, rows)
	})
	if len(batches) == 0 {
		t.Fatal("no rewarded records")
	}
	var all []schemas.Rewarded
	for _, b := range batches {
		all = append(all, b...)
	}
	bad := all[1].GroupID
	for i := range all {
		if all[i].GroupID == bad && all[i].Member == 1 {
			all[i].Rewards[0].Value = 1e300 // overflows float32: the group cannot be scored
		}
	}
	var byGroup [][]schemas.Rewarded
	idx := map[string]int{}
	for _, r := range all {
		i, ok := idx[r.GroupID]
		if !ok {
			i = len(byGroup)
			idx[r.GroupID] = i
			byGroup = append(byGroup, nil)
		}
		byGroup[i] = append(byGroup[i], r)
	}
	broken := filepath.Join(dir, "broken.arrow")
	testWriteBatches(t, schemas.RewardedTrajectories, broken, byGroup)
	out := filepath.Join(dir, "scored.arrow")
	quar := filepath.Join(dir, "quarantine.arrow")
	code, stdout, stderr := stageCLI(t, "advantage", "--in", broken, "--out", out, "--contract", cpath, "--quarantine", quar)
	if code != 0 {
		t.Fatalf("stage advantage: exit %d: %s%s", code, stdout, stderr)
	}
	if !strings.Contains(stderr, "unscorable_group") {
		t.Fatalf("stderr does not name the quarantine reason: %s", stderr)
	}
	scoredGroups := map[string]int{}
	testReadRecords(t, out, func(rec arrow.RecordBatch) {
		rows, err := schemas.ScoredTrajectories.FromRecord(rec)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rows {
			scoredGroups[r.GroupID]++
		}
	})
	if scoredGroups[bad] != 0 || len(scoredGroups) != len(byGroup)-1 {
		t.Fatalf("scored groups %v: want every group but %s", scoredGroups, bad)
	}
	quarantined := 0
	testReadRecords(t, quar, func(rec arrow.RecordBatch) {
		rows, err := schemas.RewardedTrajectories.FromRecord(rec)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rows {
			if r.GroupID != bad {
				t.Fatalf("quarantined %s of group %s", r.RecordID, r.GroupID)
			}
			quarantined++
		}
	})
	if quarantined != len(byGroup[idx[bad]]) {
		t.Fatalf("%d records quarantined, want the %d members of %s", quarantined, len(byGroup[idx[bad]]), bad)
	}
}

// TestStageAdvantageDuplicateRecord: a record id delivered twice (a
// redelivered member) is counted and ignored, as the live stage's group
// assembly does, not an error; pack admits a redelivered group once.
func TestStageAdvantageDuplicateRecord(t *testing.T) {
	cpath, c := testContractFile(t)
	groups := synthGroups(c, 0, 2, 0)
	dir := t.TempDir()
	in := filepath.Join(dir, "trajectories.arrow")
	testWriteBatches(t, schemas.Trajectories, in, groups)
	valid := filepath.Join(dir, "valid.arrow")
	rewarded := filepath.Join(dir, "rewarded.arrow")
	if code, _, stderr := stageCLI(t, "validate", "--in", in, "--out", valid, "--contract", cpath); code != 0 {
		t.Fatalf("validate: exit %d: %s", code, stderr)
	}
	if code, _, stderr := stageCLI(t, "reward", "--in", valid, "--out", rewarded, "--contract", cpath); code != 0 {
		t.Fatalf("reward: exit %d: %s", code, stderr)
	}
	var batches [][]schemas.Rewarded
	testReadRecords(t, rewarded, func(rec arrow.RecordBatch) {
		rows, err := schemas.RewardedTrajectories.FromRecord(rec)
		if err != nil {
			t.Fatal(err)
		}
		batches = append(batches, rows)
	})
	if len(batches) == 0 || len(batches[0]) < 2 {
		t.Fatalf("rewarded batches %d", len(batches))
	}
	// The first member again, in a message of its own between the groups.
	dup := []schemas.Rewarded{batches[0][0]}
	batches = append([][]schemas.Rewarded{batches[0], dup}, batches[1:]...)
	withDup := filepath.Join(dir, "dup.arrow")
	testWriteBatches(t, schemas.RewardedTrajectories, withDup, batches)
	out := filepath.Join(dir, "scored.arrow")
	code, stdout, stderr := stageCLI(t, "advantage", "--in", withDup, "--out", out, "--contract", cpath)
	if code != 0 {
		t.Fatalf("stage advantage with a duplicate record: exit %d: %s%s", code, stdout, stderr)
	}
	if !strings.Contains(stdout+stderr, "1 duplicate record id") {
		t.Fatalf("the duplicate is not counted: %s%s", stdout, stderr)
	}
	ids := map[string]int{}
	testReadRecords(t, out, func(rec arrow.RecordBatch) {
		rows, err := schemas.ScoredTrajectories.FromRecord(rec)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rows {
			ids[r.RecordID]++
		}
	})
	if ids[dup[0].RecordID] != 1 {
		t.Fatalf("duplicated record scored %d times, want once", ids[dup[0].RecordID])
	}

	// pack: a scored group delivered twice is admitted once (the live
	// stage's deduplication), the duplicates counted.
	var scored [][]schemas.Scored
	testReadRecords(t, out, func(rec arrow.RecordBatch) {
		rows, err := schemas.ScoredTrajectories.FromRecord(rec)
		if err != nil {
			t.Fatal(err)
		}
		scored = append(scored, rows)
	})
	scored = append(scored, scored[0])
	twice := filepath.Join(dir, "scored-twice.arrow")
	testWriteBatches(t, schemas.ScoredTrajectories, twice, scored)
	packedFile := filepath.Join(dir, "batches.arrow")
	code, stdout, stderr = stageCLI(t, "pack", "--in", twice, "--out", packedFile, "--contract", cpath)
	if code != 0 {
		t.Fatalf("stage pack with a duplicate group: exit %d: %s%s", code, stdout, stderr)
	}
	if want := fmt.Sprintf("%d duplicate record ids", len(scored[0])); !strings.Contains(stdout, want) {
		t.Fatalf("stdout lacks %q: %s", want, stdout)
	}
	packed := map[string]int{}
	for _, b := range offlineBatches(t, packedFile) {
		for _, row := range b.Rows {
			for _, id := range row.SegTrajectoryIDs {
				packed[id]++
			}
		}
	}
	for _, r := range scored[0] {
		if packed[r.RecordID] > 1 {
			t.Fatalf("record %s packed %d times", r.RecordID, packed[r.RecordID])
		}
	}
	if len(packed) == 0 {
		t.Fatal("nothing packed")
	}
}
