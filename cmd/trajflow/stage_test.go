package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/apache/arrow-go/v18/arrow/ipc"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

const conformance = "../../testdata/contracts/conformance.yaml"

// TestStageChainOffline runs validate -> reward -> advantage -> pack with
// `trajflow stage` over IPC stream files and checks every valid trajectory
// lands in exactly one packed segment.
func TestStageChainOffline(t *testing.T) {
	c, err := contract.Load(conformance)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	s := synth.Default()
	s.RunID, s.ContractHash, s.GroupSize, s.MaxTurns = c.RunID, c.Hash(), c.Sampler.GroupSize, c.Sampler.MaxTurns
	s.MeanTokens, s.MaxTokens, s.PolicyVersion, s.MeanLag = 300, 3000, 0, 0
	var rows []schemas.Trajectory
	for g := int64(0); g < 12; g++ {
		rows = append(rows, s.Group(g)...)
	}
	// One broken row: a NaN-free but length-mismatched turn is refused by validate.
	rows[3].Turns[0].ActionLogprobs = rows[3].Turns[0].ActionLogprobs[1:]
	dir := t.TempDir()
	in := filepath.Join(dir, "trajectories.arrow")
	testWriteBatches(t, schemas.Trajectories, in, [][]schemas.Trajectory{rows})
	steps := [][]string{
		{"stage", "validate", "--in", in, "--out", filepath.Join(dir, "valid.arrow")},
		{"stage", "reward", "--in", filepath.Join(dir, "valid.arrow"), "--out", filepath.Join(dir, "rewarded.arrow")},
		{"stage", "advantage", "--in", filepath.Join(dir, "rewarded.arrow"), "--out", filepath.Join(dir, "scored.arrow")},
		{"stage", "pack", "--in", filepath.Join(dir, "scored.arrow"), "--out", filepath.Join(dir, "batches.arrow")},
	}
	var stderr bytes.Buffer
	for _, args := range steps {
		args = append(args, "--contract", conformance)
		var stdout, stepErr bytes.Buffer
		if code := run(context.Background(), args, &stdout, io.MultiWriter(&stderr, &stepErr)); code != 0 {
			t.Fatalf("%v: exit %d: %s", args, code, stderr.String())
		}
		t.Logf("trajflow %s:\n%s", args[1], stdout.String())
		// The broken row's group is incomplete (the file carries no
		// absent-members header) and pack's last window is not full: the
		// end of the input closes both, and says so.
		if (args[1] == "advantage" || args[1] == "pack") && !strings.Contains(stepErr.String(), "were closed at the end of the input") {
			t.Errorf("%s does not say what the end of the input closed: %s", args[1], stepErr.String())
		}
	}
	if !strings.Contains(stderr.String(), "logprob_length_mismatch") {
		t.Fatalf("validate did not report the broken row: %s", stderr.String())
	}
	f, err := os.Open(filepath.Join(dir, "batches.arrow"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r, err := ipc.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Release()
	seen := map[string]int{}
	for r.Next() {
		b, err := schemas.PackedBatches.FromRecord(r.RecordBatch())
		if err != nil {
			t.Fatal(err)
		}
		for _, row := range b.Rows {
			for _, id := range row.SegTrajectoryIDs {
				seen[id]++
			}
		}
	}
	// The broken row's group is scored without it (min group size), so
	// every other row is admitted unless its group had zero variance.
	admitted := 0
	for i, tr := range rows {
		n := seen[tr.RecordID]
		if i == 3 && n != 0 {
			t.Fatalf("refused row was packed")
		}
		if n > 1 {
			t.Fatalf("trajectory %s packed %d times", tr.RecordID, n)
		}
		admitted += n
	}
	if admitted < len(rows)-1-2*s.GroupSize {
		t.Fatalf("only %d of %d trajectories packed; stderr: %s", admitted, len(rows), stderr.String())
	}
}

// TestStageFlagsRefused: an unknown stage, an input that is not a file,
// an output in a missing directory, a flag of another stage, train
// without --releases, a device that is none and a trainer version below
// -1 exit 2 at once naming the flag; nothing is read or written.
func TestStageFlagsRefused(t *testing.T) {
	in, missing := testFile(t)
	out := filepath.Join(t.TempDir(), "out.arrow")
	for _, c := range []refusalCase{
		{[]string{"nope", "--in", in, "--out", out}, []string{`unknown stage "nope"`}},
		{[]string{"validate", "--in", missing, "--out", out}, []string{"--in", "no such file"}},
		{[]string{"validate", "--in", t.TempDir(), "--out", out}, []string{"--in", "directory"}},
		{[]string{"validate", "--in", in, "--out", missing}, []string{"--out", "no such file"}},
		{[]string{"validate", "--in", in, "--out", out, "--quarantine", missing}, []string{"--quarantine", "no such file"}},
		{[]string{"validate", "--in", in, "--out", out, "--releases", t.TempDir()}, []string{"--releases", "train"}},
		{[]string{"validate", "--in", in, "--out", out, "--device", "cpu"}, []string{"--device cpu", "train"}},
		{[]string{"validate", "--in", in, "--out", out, "--trainer-version", "5"}, []string{"--trainer-version 5", "pack"}},
		{[]string{"pack", "--in", in, "--out", out, "--trainer-version", "-5"}, []string{"--trainer-version -5"}},
		{[]string{"train", "--in", in}, []string{"train needs --releases"}},
		{[]string{"train", "--in", in, "--releases", t.TempDir(), "--device", "gpu"}, []string{`--device "gpu"`}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"stage"}, c.args...), c.want...)
		})
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("a refused stage wrote %s (stat: %v)", out, err)
	}
}
