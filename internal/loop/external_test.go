package loop_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// TestTrainerOptionsRefused: an unknown trainer, and an external trainer
// with --no-train, are refused before anything starts.
func TestTrainerOptionsRefused(t *testing.T) {
	for _, o := range []loop.Options{
		{Trainer: "pytorch"},
		{Trainer: loop.TrainerExternal, NoTrain: true},
	} {
		o.Updates, o.EvalSamples, o.Out = 1, 1, t.TempDir()
		_, err := loop.Run(context.Background(), o, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "--trainer") {
			t.Fatalf("%+v: got %v, want a refusal naming --trainer", o, err)
		}
	}
}

// TestExternalTrainerInfo: with --trainer external the loop starts every
// stage but train, writes OUT/trainer.json (the broker it started, the
// run's topics and group, the resolved contract, whose hash is the run's,
// and the Go initial weights as the trainer's --init-checkpoint), and
// waits for releases: with no trainer running, none comes and no update
// is reported.
func TestExternalTrainerInfo(t *testing.T) {
	out := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stdout bytes.Buffer
	done := make(chan error, 1)
	go func() {
		_, err := loop.Run(ctx, loop.Options{Updates: 2, EvalSamples: 1, Out: out, Seed: 4, Trainer: loop.TrainerExternal}, &stdout)
		done <- err
	}()
	path := filepath.Join(out, loop.TrainerFile)
	deadline := time.Now().Add(60 * time.Second)
	var b []byte
	for {
		var err error
		if b, err = os.ReadFile(path); err == nil {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("the loop ended before writing %s: %v", path, err)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s after 60 s", path)
		}
	}
	var info loop.TrainerInfo
	if err := json.Unmarshal(b, &info); err != nil {
		t.Fatal(err)
	}
	if info.RunID == "" || info.Group != info.RunID+".train" || info.Batches != info.RunID+".batches" ||
		info.Policy != info.RunID+".policy" || len(info.Brokers) != 1 || info.Updates != 2 {
		t.Fatalf("trainer.json: %+v", info)
	}
	y, err := os.ReadFile(info.Contract)
	if err != nil {
		t.Fatal(err)
	}
	c, err := contract.Parse(y)
	if err != nil {
		t.Fatal(err)
	}
	want, err := loop.Contract(loop.Options{Seed: 4, Trainer: loop.TrainerExternal})
	if err != nil {
		t.Fatal(err)
	}
	if c.Hash() != want.Hash() {
		t.Fatalf("contract.yaml hashes to %s, the run's contract to %s", c.Hash(), want.Hash())
	}
	mc, seed := operators.ModelConfig(want)
	m0, err := gpu.InitialModel(mc, seed)
	if err != nil {
		t.Fatal(err)
	}
	w0, _ := m0.Bytes()
	got, err := os.ReadFile(info.InitCheckpoint)
	if err != nil || !bytes.Equal(got, w0) {
		t.Fatalf("initial checkpoint %s: %v, equal to gpu.InitialModel: %v", info.InitCheckpoint, err, bytes.Equal(got, w0))
	}
	if cmd := strings.Join(info.Command, " "); !strings.Contains(cmd, "--init-checkpoint "+info.InitCheckpoint) ||
		(info.Updates > 0 && !strings.Contains(cmd, "--max-updates "+strconv.Itoa(info.Updates))) {
		t.Fatalf("command %v", info.Command)
	}
	time.Sleep(2 * time.Second) // no trainer: no release, no update
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("the loop ended with %v, want context.Canceled", err)
	}
	if s := stdout.String(); !strings.Contains(s, "external trainer: waiting") || strings.Contains(s, "\n     1 ") {
		t.Fatalf("output:\n%s", s)
	}
	if _, err := os.Stat(filepath.Join(out, "releases", gpu.ManifestName(0))); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("release 0 without a trainer: %v", err)
	}
}
