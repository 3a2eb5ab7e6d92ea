package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// demo runs the in-process demo (internal/loop) and returns its summary.
func demo(t *testing.T, o loop.Options) *loop.Summary {
	t.Helper()
	if o.Out == "" {
		o.Out = t.TempDir()
	}
	if o.EvalSamples == 0 {
		o.EvalSamples = 1
	}
	o.Quiet = true
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	s, err := loop.Run(ctx, o, io.Discard)
	if err != nil {
		t.Fatalf("demo: %v", err)
	}
	if s.Lost != 0 || s.DuplicatesAdmitted != 0 {
		t.Fatalf("lost %d, duplicates %d", s.Lost, s.DuplicatesAdmitted)
	}
	if s.AttemptsLaunched != o.Updates*16*16 || len(s.BatchHashes) != s.Updates {
		t.Fatalf("%d attempts launched, %d batches for %d updates", s.AttemptsLaunched, len(s.BatchHashes), s.Updates)
	}
	return s
}

// TestDemoEndToEnd is the demo with its default settings, through the
// command line: the hidden-eval success at the end is at least 0.6 and
// twice the initial one, with nothing lost or admitted twice.
func TestDemoEndToEnd(t *testing.T) {
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	if code := run(ctx, []string{"demo", "--out", out}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s\n%s", code, stderr.String(), stdout.String())
	}
	b, err := os.ReadFile(filepath.Join(out, "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	var s loop.Summary
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s", lastLines(stdout.String(), 3))
	if s.EvalSuccessFinal < 0.6 || s.EvalSuccessFinal < 2*s.EvalSuccessInitial {
		t.Fatalf("hidden-eval success %.3f -> %.3f: want >= 0.6 and >= 2x", s.EvalSuccessInitial, s.EvalSuccessFinal)
	}
	if s.DuplicatesAdmitted != 0 || s.Lost != 0 || s.AttemptsLaunched != s.Rounds*16*16 {
		t.Fatalf("launched %d, duplicates %d, lost %d", s.AttemptsLaunched, s.DuplicatesAdmitted, s.Lost)
	}
	if s.AttemptsLaunched != s.TrajectoriesAdmitted+s.TrajectoriesFiltered+s.Quarantined {
		t.Fatalf("accounting: %d launched, %d admitted, %d filtered, %d quarantined", s.AttemptsLaunched, s.TrajectoriesAdmitted, s.TrajectoriesFiltered, s.Quarantined)
	}
	if len(s.PerUpdate) != s.Updates || len(s.BatchHashes) != s.Updates || s.PackingEfficiency <= 0.5 || s.MaxLagSeen != 0 {
		t.Fatalf("%d lines, %d batches for %d updates, packing %.3f, max lag %d", len(s.PerUpdate), len(s.BatchHashes), s.Updates, s.PackingEfficiency, s.MaxLagSeen)
	}
	if n := strings.Count(stdout.String(), "\n"); n < s.Updates {
		t.Fatalf("%d output lines for %d updates", n, s.Updates)
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// TestFleet runs the loop as separate processes, `trajflow broker` and
// `trajflow run dispatch|rollout|validate|reward|advantage|pack|train`, and
// compares it with the in-process demo of the same seed: the same batches,
// bit for bit, nothing lost or duplicated.
func TestFleet(t *testing.T) { fleet(t, 4, 0, "") }

// TestFleetTrainerCrash kills the train process (SIGKILL, local state
// lost) after it published version 2 and starts it again: the restarted
// trainer resumes from the last release and its optimizer state, batches
// redelivered to it are not trained twice, and the run's batches are still
// those of the uninterrupted in-process demo.
func TestFleetTrainerCrash(t *testing.T) { fleet(t, 5, 2, "") }

// trainerStarted reports whether the trainer's state directory exists
// (always true without a crash).
func trainerStarted(crashAt int64, stateDir string) bool {
	if crashAt <= 0 {
		return true
	}
	_, err := os.Stat(stateDir)
	return err == nil
}

// fleet runs `rounds` rounds as separate processes; when crashAt > 0 the
// trainer is killed and restarted once version crashAt is released. With
// a policy protocol, rollout generates on a `trajflow serve policy`
// process of that protocol (the contract file's policy section names it)
// and weightsync runs beside the other operators. rolloutArgs are extra
// flags of the rollout process.
func fleet(t *testing.T, rounds int, crashAt int64, protocol string, rolloutArgs ...string) {
	want := demo(t, loop.Options{Updates: rounds, Seed: 1})

	dir := t.TempDir()
	bin := trajflowBinary(t)
	releases := filepath.Join(dir, "releases")
	stages := loop.Stages
	var contractArgs []string
	if protocol != "" {
		if err := os.MkdirAll(releases, 0o755); err != nil {
			t.Fatal(err)
		}
		contractArgs = []string{"--contract", policyContract(t, dir, protocol, servePolicy(t, protocol, releases))}
		stages = append(slices.Clone(stages), "weightsync")
	}
	var procs []*exec.Cmd
	t.Cleanup(func() {
		for i := len(procs) - 1; i >= 0; i-- {
			procs[i].Process.Signal(syscall.SIGINT)
		}
		for _, p := range procs {
			p.Wait()
		}
	})
	start := func(args ...string) (*exec.Cmd, io.Reader) {
		cmd := exec.Command(bin, args...)
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stderr = &prefixWriter{t: t, prefix: args[0] + " " + args[1]}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		procs = append(procs, cmd)
		return cmd, stdout
	}
	_, bout := start("broker", "--port", "0", "--log-level", "warn")
	line, err := bufio.NewReader(bout).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "broker listening on ") {
		t.Fatalf("broker: %q %v", line, err)
	}
	go io.Copy(io.Discard, bout)
	addr := strings.TrimSpace(strings.TrimPrefix(line, "broker listening on "))
	if out, err := exec.Command(bin, "topics", "create", "--brokers", addr).CombinedOutput(); err != nil {
		t.Fatalf("topics: %v\n%s", err, out)
	}
	startOp := func(name string) *exec.Cmd {
		args := append([]string{"run", name, "--brokers", addr, "--releases", releases, "--rounds", fmt.Sprint(rounds),
			"--state", filepath.Join(dir, "state", name), "--log-level", "warn"}, contractArgs...)
		if name == "rollout" {
			args = append(args, rolloutArgs...)
		}
		cmd, out := start(args...)
		go io.Copy(io.Discard, out)
		return cmd
	}
	var train *exec.Cmd
	for _, name := range stages {
		if cmd := startOp(name); name == "train" {
			train = cmd
		}
	}
	crashed := crashAt <= 0

	topics, _ := pipeline.TopicsFor("demo")
	cfg := &pipeline.Config{Brokers: []string{addr}}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	for {
		decided, batches := 0, 0
		err := pipeline.ScanTail(ctx, cfg, topics.Windows, 0, func(m pipeline.Message) error {
			w, err := schemas.DecodeWindow(m.Value)
			if err != nil {
				return err
			}
			decided += len(w.Groups)
			if w.BatchID != "" {
				batches++
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		version := int64(-1)
		err = pipeline.ScanTail(ctx, cfg, topics.Policy, 0, func(m pipeline.Message) error {
			if rel, err := schemas.DecodeRelease(m.Value); err == nil {
				version = max(version, rel.PolicyVersion)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if !crashed && version >= crashAt {
			train.Process.Kill()
			train.Wait()
			os.RemoveAll(filepath.Join(dir, "state", "train"))
			for i, p := range procs {
				if p == train {
					procs = append(procs[:i], procs[i+1:]...)
					break
				}
			}
			train = startOp("train")
			crashed = true
			t.Logf("trainer killed at version %d and restarted", version)
		}
		// A restarted trainer must be past its start (its state directory,
		// removed with the crash, exists again) before it is signalled:
		// when the poll sees the crash version late, all work may already
		// be done, and a SIGINT during process start would kill it.
		if crashed && decided == rounds*16 && version == int64(batches) && trainerStarted(crashAt, filepath.Join(dir, "state", "train")) {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("fleet did not finish: %d groups decided, %d batches, version %d", decided, batches, version)
		}
		time.Sleep(300 * time.Millisecond)
	}
	// Stop the operators gracefully, then account.
	for _, p := range procs[1:] {
		p.Process.Signal(syscall.SIGINT)
	}
	for _, p := range procs[1:] {
		if err := p.Wait(); err != nil {
			t.Errorf("operator %v: %v", p.Args[1:3], err)
		}
	}
	procs = procs[:1]
	hashes, err := loop.BatchHashes(ctx, cfg, topics)
	if err != nil {
		t.Fatal(err)
	}
	launched, err := loop.Launched(ctx, cfg, topics)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := audit.Collect(ctx, cfg, topics)
	if err != nil {
		t.Fatal(err)
	}
	counts := rep.Account(launched)
	if counts.Launched != rounds*16*16 || counts.Lost != 0 || counts.Duplicated != 0 {
		t.Fatalf("fleet accounting %v", counts)
	}
	if !reflect.DeepEqual(hashes, want.BatchHashes) {
		t.Fatalf("fleet batches differ from the in-process demo:\n%v\n%v", hashes, want.BatchHashes)
	}
}

// prefixWriter logs a process's stderr.
type prefixWriter struct {
	t      *testing.T
	prefix string
}

func (w *prefixWriter) Write(b []byte) (int, error) {
	for _, l := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		w.t.Logf("%s: %s", w.prefix, l)
	}
	return len(b), nil
}
