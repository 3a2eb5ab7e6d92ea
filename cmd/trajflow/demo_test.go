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
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

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
	checkGate(t, &s, out, stdout.String())
}

// checkGate: the gate ruled on every release, promoted at least once on
// an interval that cleared the promoted release, and every evaluation
// ran the four suites on the same frozen attempts; the decisions topic
// is in the snapshot.
func checkGate(t *testing.T, s *loop.Summary, out, stdout string) {
	t.Helper()
	g := s.Gate
	if g == nil || g.Promotions < 1 || g.Promoted == 0 || g.Stop != nil || !strings.Contains(stdout, ": promote;") {
		t.Fatalf("gate summary %+v", g)
	}
	ruled := map[int64]bool{}
	for _, d := range g.Decisions {
		ruled[d.PolicyVersion] = true
		if d.Action == "promote" {
			var primary bool
			for _, c := range d.Checks {
				primary = primary || (c.Kind == "primary" && c.OK && c.Lo > c.Bound)
			}
			if !primary || !d.Evaluated {
				t.Fatalf("promotion without a clearing interval: %+v", d)
			}
		}
	}
	for v := int64(0); v <= int64(s.Updates); v++ {
		if !ruled[v] {
			t.Fatalf("no decision on release %d", v)
		}
	}
	hashes := map[string]string{}
	for _, e := range g.Evaluations {
		if len(e.Suites) != 4 {
			t.Fatalf("evaluation of release %d: %d suites", e.Version, len(e.Suites))
		}
		for _, su := range e.Suites {
			if h, ok := hashes[su.Suite]; ok && h != su.AttemptsHash {
				t.Fatalf("suite %s: attempts of release %d differ from the first evaluation's", su.Suite, e.Version)
			}
			hashes[su.Suite] = su.AttemptsHash
			if su.Success.Lo > su.Success.Value || su.Success.Hi < su.Success.Value {
				t.Fatalf("suite %s at %d: %+v", su.Suite, e.Version, su.Success)
			}
		}
	}
	if _, ok := g.PromotedMetrics["verified_success_rate"]; !ok {
		t.Fatalf("promoted metrics %v", g.PromotedMetrics)
	}
	if _, err := os.Stat(filepath.Join(out, "run=demo", "topic=decisions")); err != nil {
		t.Fatalf("decisions topic not snapshotted: %v", err)
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

// TestResumeEquality (docs/PIPELINE.md §18, gate C): the trainer and dispatch are
// killed together (SIGKILL, local state lost) once version 2 is released
// and started again; the run's batches and every release's checkpoint are
// byte-identical to those of the uninterrupted in-process run of the same
// seed (sync mode).
func TestResumeEquality(t *testing.T) { fleetRun(t, 5, 2, []string{"dispatch", "train"}, "") }

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
	fleetRun(t, rounds, crashAt, []string{"train"}, protocol, rolloutArgs...)
}

// fleetRun is fleet killing and restarting the crash stages once version
// crashAt is released; it also compares every release's checkpoint hash
// with the in-process run's.
func fleetRun(t *testing.T, rounds int, crashAt int64, crash []string, protocol string, rolloutArgs ...string) {
	wantOut := t.TempDir()
	want := testkit.Demo(t, loop.Options{Updates: rounds, Seed: 1, Out: wantOut})

	dir := t.TempDir()
	bin := trajflowBinary(t)
	releases := filepath.Join(dir, "releases")
	stages := loop.Stages
	var contractArgs []string
	if protocol != "" {
		if err := os.MkdirAll(releases, 0o755); err != nil {
			t.Fatal(err)
		}
		contractArgs = []string{"--contract", policyContract(t, protocol, servePolicy(t, protocol, releases))}
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
	running := map[string]*exec.Cmd{}
	for _, name := range stages {
		running[name] = startOp(name)
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
			for _, name := range crash {
				cmd := running[name]
				cmd.Process.Kill()
				cmd.Wait()
				os.RemoveAll(filepath.Join(dir, "state", name))
				for i, p := range procs {
					if p == cmd {
						procs = append(procs[:i], procs[i+1:]...)
						break
					}
				}
			}
			for _, name := range crash {
				running[name] = startOp(name)
			}
			crashed = true
			t.Logf("%v killed at version %d and restarted", crash, version)
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
	// Every operator, run with --rounds, exits 0 by itself once the run
	// is done and its inputs are drained; then account.
	exited := make(chan error, len(procs)-1)
	for _, p := range procs[1:] {
		go func() {
			err := p.Wait()
			if err != nil {
				err = fmt.Errorf("operator %v: %w", p.Args[1:3], err)
			}
			exited <- err
		}()
	}
	limit := time.After(60 * time.Second)
	for range procs[1:] {
		select {
		case err := <-exited:
			if err != nil {
				t.Error(err)
			}
		case <-limit:
			for _, p := range procs[1:] {
				if p.ProcessState == nil {
					t.Errorf("operator %v still running 60s after the run was done", p.Args[1:3])
				}
			}
			t.FailNow()
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
	if protocol == "" {
		sameReleases(t, filepath.Join(wantOut, "releases"), releases, want.Updates)
	}
}

// sameReleases: releases 0..n of two release directories name the same
// checkpoint hash.
func sameReleases(t *testing.T, a, b string, n int) {
	t.Helper()
	for v := range n + 1 {
		var hs [2]string
		for i, d := range []string{a, b} {
			raw, err := os.ReadFile(filepath.Join(d, fmt.Sprintf("policy-v%08d.json", v)))
			if err != nil {
				t.Fatal(err)
			}
			var rel schemas.PolicyRelease
			if err := json.Unmarshal(raw, &rel); err != nil {
				t.Fatal(err)
			}
			hs[i] = rel.CheckpointHash
		}
		if hs[0] != hs[1] || hs[0] == "" {
			t.Fatalf("release %d: checkpoint %s in process, %s in the fleet", v, hs[0], hs[1])
		}
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

// `demo --contract FILE` runs the contract of FILE: its run id, seed and
// hash are the summary's; --max-lag without --async is refused at once.
func TestDemoContractFile(t *testing.T) {
	dir := t.TempDir()
	b, err := os.ReadFile(filepath.Join("..", "..", "testdata", "contracts", "demo.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	y := strings.Replace(strings.Replace(string(b), "run_id: demo", "run_id: fromfile", 1), "seed: 1 ", "seed: 7 ", 1)
	path := filepath.Join(dir, "c.yaml")
	if err := os.WriteFile(path, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := loadContract(path)
	if err != nil {
		t.Fatal(err)
	}
	if c.RunID != "fromfile" || c.Seed != 7 {
		t.Fatalf("edited contract: run %q seed %d", c.RunID, c.Seed)
	}
	out := filepath.Join(dir, "out")
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if code := run(ctx, []string{"demo", "--contract", path, "--updates", "1", "--eval-samples", "1", "--out", out}, &stdout, &stderr); code != 0 {
		t.Fatalf("demo --contract: exit %d: %s", code, stderr.String())
	}
	sb, err := os.ReadFile(filepath.Join(out, "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	var s loop.Summary
	if err := json.Unmarshal(sb, &s); err != nil {
		t.Fatal(err)
	}
	if s.RunID != "fromfile" || s.Seed != 7 || s.ContractHash != c.Hash() {
		t.Errorf("summary: run %q seed %d hash %s, want fromfile 7 %s", s.RunID, s.Seed, s.ContractHash, c.Hash())
	}

	stderr.Reset()
	start := time.Now()
	code := run(ctx, []string{"demo", "--max-lag", "2", "--out", filepath.Join(dir, "x")}, &stdout, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), "--max-lag 2 has no effect without --async") || time.Since(start) > 5*time.Second {
		t.Errorf("--max-lag without --async: exit %d after %s: %s", code, time.Since(start), stderr.String())
	}
	stderr.Reset()
	if code := run(ctx, []string{"demo", "--contract", filepath.Join(dir, "missing.yaml")}, &stdout, &stderr); code != 2 || !strings.Contains(stderr.String(), "missing.yaml") {
		t.Errorf("missing contract: exit %d: %s", code, stderr.String())
	}
}

// TestDemoFlagsRefused: a count past its field, a flag without the one it
// goes with, a contract field the run would refuse, a malformed list,
// address or URL, an output directory that is a file and a stray argument
// exit 2 at once naming the flag, before any broker or operator starts.
func TestDemoFlagsRefused(t *testing.T) {
	file, missing := testFile(t)
	for _, c := range []refusalCase{
		{[]string{"--updates", "0"}, []string{"--updates 0"}},
		{[]string{"--eval-samples", "4294967297"}, []string{"--eval-samples 4294967297"}},
		{[]string{"--is-cap", "3"}, []string{"--is-cap 3", "--off-policy"}},
		{[]string{"--async", "--max-lag", "-1"}, []string{"packing.max_lag", "-1"}},
		{[]string{"--off-policy", "bogus"}, []string{"loss.off_policy", "bogus"}},
		{[]string{"--environment", "bogus"}, []string{`"bogus"`, "environment"}},
		{[]string{"--tasks", "bogus"}, []string{`--tasks "bogus"`}},
		{[]string{"--trainer", "bogus"}, []string{`--trainer "bogus"`}},
		{[]string{"--trainer", "external", "--no-train"}, []string{"--trainer external", "--no-train"}},
		{[]string{"--run", "bad/id"}, []string{"run_id", "bad/id"}},
		{[]string{"--policy", "sglang://127.0.0.1:1,,"}, []string{"--policy", "item 2 is empty"}},
		{[]string{"--policy", "sglang://127.0.0.1:99999"}, []string{"--policy", "99999"}},
		{[]string{"--env", "http://127.0.0.1:1,,", "--env-key-file", file}, []string{"--env", "item 2 is empty"}},
		{[]string{"--env", "notaurl", "--env-key-file", file}, []string{`--env "notaurl"`}},
		{[]string{"--env", "http://127.0.0.1:1", "--env-key-file", missing}, []string{"--env-key-file", "no such file"}},
		{[]string{"--brokers", "127.0.0.1:1,,"}, []string{"--brokers", "item 2 is empty"}},
		{[]string{"--brokers", "nohost"}, []string{`--brokers "nohost"`}},
		{[]string{"--out", ""}, []string{`--out ""`}},
		{[]string{"--out", file}, []string{"--out", "not a directory"}},
		{[]string{"extra"}, []string{"no arguments", "extra"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"demo", "--updates", "1", "--out", t.TempDir()}, c.args...), c.want...)
		})
	}
}

// TestDemoFlagsOverAsyncContract: with an asynchronous --contract, the
// run is asynchronous and --max-lag, when given, replaces the contract's
// packing.max_lag (it is neither refused nor overwritten by it).
func TestDemoFlagsOverAsyncContract(t *testing.T) {
	b, err := os.ReadFile("../../testdata/contracts/demo.yaml")
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Replace(strings.Replace(string(b), "mode: sync ", "mode: async", 1), "max_lag: 0 ", "max_lag: 2 ", 1)
	path := filepath.Join(t.TempDir(), "async.yaml")
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		lag  int64
	}{{nil, 2}, {[]string{"--max-lag", "3"}, 3}} {
		fs := newFlags("demo", io.Discard)
		var o loop.Options
		fs.StringVar(&o.Out, "out", t.TempDir(), "")
		fs.IntVar(&o.Updates, "updates", 1, "")
		fs.Int64Var(&o.MaxLag, "max-lag", 1, "")
		fs.BoolVar(&o.Async, "async", false, "")
		env := addEnvFlags(fs)
		pf := addPolicyFlags(fs, &o)
		if _, err := parseFlags(fs, c.args); err != nil {
			t.Fatal(err)
		}
		if err := demoOptions(fs, &o, demoFlags{evalSamples: 1, env: env, policy: pf, contract: path}); err != nil {
			t.Fatalf("%q: %v", c.args, err)
		}
		if !o.Async || o.MaxLag != c.lag {
			t.Errorf("%q: async %v, max lag %d; want async, %d", c.args, o.Async, o.MaxLag, c.lag)
		}
	}
}
