package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// demo runs the in-process demo and returns its summary.
func demo(t *testing.T, o demoOptions) *demoSummary {
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
	s, err := runDemo(ctx, o, io.Discard)
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

// TestDemoDeterministic: in stop-and-synchronize mode the same seed gives
// the same batches, bit for bit, although every operator runs
// concurrently over Kafka; another seed gives other batches.
func TestDemoDeterministic(t *testing.T) {
	a := demo(t, demoOptions{Updates: 6, Seed: 1})
	b := demo(t, demoOptions{Updates: 6, Seed: 1})
	if !reflect.DeepEqual(a.BatchHashes, b.BatchHashes) || len(a.BatchHashes) == 0 {
		t.Fatalf("same seed, different batches:\n%v\n%v", a.BatchHashes, b.BatchHashes)
	}
	if a.EvalSuccessFinal != b.EvalSuccessFinal {
		t.Fatalf("same seed, eval %v vs %v", a.EvalSuccessFinal, b.EvalSuccessFinal)
	}
	c := demo(t, demoOptions{Updates: 2, Seed: 2})
	if c.BatchHashes[0] == a.BatchHashes[0] {
		t.Fatal("another seed gave the same first batch")
	}
}

// TestRatioOneThroughKafka: the first update's batch went dispatch ->
// rollout -> validate -> reward -> advantage -> pack -> train over Kafka;
// the trainer's recomputed log-probs on its tokens equal the behavior
// log-probs, so the ratio is exactly 1 and the KL to the behavior policy
// exactly 0 (pipeline §21, "Ratio is not one before first update").
func TestRatioOneThroughKafka(t *testing.T) {
	out := t.TempDir()
	demo(t, demoOptions{Updates: 1, Seed: 3, Out: out})
	files, err := pipeline.NewDirReleases(filepath.Join(out, "releases"))
	if err != nil {
		t.Fatal(err)
	}
	u, err := gpu.ReadUpdate(files, 1)
	if err != nil {
		t.Fatal(err)
	}
	m := u.Metrics
	if m.Tokens == 0 || m.RatioMin != 1 || m.RatioMax != 1 || m.RatioMean != 1 || m.ApproxKLOld != 0 || m.FromVersion != 0 {
		t.Fatalf("first update: tokens %d ratio [%v %v] mean %v approx KL %v from version %d",
			m.Tokens, m.RatioMin, m.RatioMax, m.RatioMean, m.ApproxKLOld, m.FromVersion)
	}
	if len(m.Lag) != 1 || m.Lag[0].Lag != 0 || m.Lag[0].K3 != 0 || m.Lag[0].Tokens != m.Tokens {
		t.Fatalf("lag strata %+v", m.Lag)
	}
	// The second optimizer step of the update moved the policy.
	if u.Last.ApproxKLOld == 0 {
		t.Fatal("the update's last step saw no change from the behavior policy")
	}
}

// TestDemoAsync: asynchronous mode runs up to max_lag+1 rounds in flight,
// drops stale samples at pack, and still accounts for every attempt.
func TestDemoAsync(t *testing.T) {
	s := demo(t, demoOptions{Updates: 6, Seed: 1, Async: true, MaxLag: 1})
	if s.Mode != "async" || s.Updates == 0 || s.TrajectoriesAdmitted == 0 {
		t.Fatalf("summary %+v", s)
	}
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
	var s demoSummary
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

// TestEvalTaskNeverTrains injects a trajectory of a hidden-eval task onto
// the trajectories topic beside a normal group: it never reaches a batch,
// and validate raises an incident.
func TestEvalTaskNeverTrains(t *testing.T) {
	c, err := demoContract(demoOptions{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	b, err := kafka.StartBroker(context.Background(), kafka.BrokerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	topics, _ := pipeline.TopicsFor(c.RunID)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := kafka.CreateTopics(ctx, kafka.ClientConfig{}, []string{b.Addr()}, operators.TopicSpecs(c, topics)); err != nil {
		t.Fatal(err)
	}
	deps, err := operatorDeps(c, topics)
	if err != nil {
		t.Fatal(err)
	}
	reg := deps.Tasks
	m, err := model.New(model.DefaultConfig(), 1)
	if err != nil {
		t.Fatal(err)
	}
	pol := model.NewPolicy(m, 0)
	episodes := func(task rollout.Task, group int64) []schemas.Trajectory {
		atts := rollout.Attempts(c.RunID, task, group, 16, c.Seed, 0, c.Hash())
		trajs, err := reg.RunEpisodes(ctx, pol, atts, operators.RolloutSettings(c, reg), operators.RolloutLimits(c))
		if err != nil {
			t.Fatal(err)
		}
		return trajs
	}
	evalTask := reg.Eval()[0]
	leaked := episodes(evalTask, 0)
	for i := range leaked {
		leaked[i].Split = schemas.SplitTrain // disguised: only the denylist knows
	}
	var launched []string
	w := &kafkago.Writer{Addr: kafkago.TCP(b.Addr()), Topic: topics.Trajectories, Balancer: &kafkago.Murmur2Balancer{}, RequiredAcks: kafkago.RequireAll}
	defer w.Close()
	var msgs []kafkago.Message
	for g := int64(0); g < 16; g++ {
		trajs := episodes(reg.Train()[g], 100+g)
		for _, tr := range trajs {
			launched = append(launched, tr.RecordID)
		}
		v, err := schemas.Trajectories.Encode(nil, trajs)
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, kafkago.Message{Key: []byte(trajs[0].GroupID), Value: v})
	}
	v, err := schemas.Trajectories.Encode(nil, leaked)
	if err != nil {
		t.Fatal(err)
	}
	msgs = append(msgs, kafkago.Message{Key: []byte(leaked[0].GroupID), Value: v})
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	opCtx, stop := context.WithCancel(context.Background())
	done := make(chan error, 4)
	for _, name := range []string{"validate", "reward", "advantage", "pack"} {
		st, err := operators.New(name, deps)
		if err != nil {
			t.Fatal(err)
		}
		op, err := pipeline.NewOperator(pipeline.Config{Brokers: []string{b.Addr()}, GroupID: c.RunID + "." + name,
			QuarantineTopic: topics.Quarantine, StateDir: t.TempDir(), Logger: discardLogger(), CommitInterval: 50 * time.Millisecond}, st)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			done <- op.Run(opCtx)
			if cl, ok := st.(io.Closer); ok {
				cl.Close()
			}
		}()
	}
	defer func() {
		stop()
		for range 4 {
			<-done
		}
	}()
	cfg := &pipeline.Config{Brokers: []string{b.Addr()}}
	var counts audit.Counts
	var rep *audit.Report
	for deadline := time.Now().Add(40 * time.Second); ; {
		if rep, err = audit.Collect(ctx, cfg, topics); err != nil {
			t.Fatal(err)
		}
		all := append(append([]string(nil), launched...), leaked[0].RecordID)
		if counts = rep.Account(all); counts.Lost == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if counts.Lost != 0 || counts.Duplicated != 0 {
		t.Fatalf("accounting %v", counts)
	}
	for _, tr := range leaked {
		if rep.Admitted[tr.RecordID] != 0 {
			t.Fatalf("hidden-eval trajectory %s reached a batch", tr.RecordID)
		}
		if rep.Quarantined[tr.RecordID] != "eval_task_id" {
			t.Fatalf("hidden-eval trajectory %s: quarantine reason %q", tr.RecordID, rep.Quarantined[tr.RecordID])
		}
	}
	incidents := 0
	err = pipeline.ScanTail(ctx, cfg, topics.Incidents, 0, func(m pipeline.Message) error {
		inc, err := schemas.DecodeIncident(m.Value)
		if err == nil && inc.TaskID == evalTask.ID && inc.Reason == "eval_task_id" {
			incidents++
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if incidents != len(leaked) {
		t.Fatalf("%d incidents for %d leaked trajectories", incidents, len(leaked))
	}
}

// TestFleet runs the loop as separate processes, `trajflow broker` and
// `trajflow run dispatch|rollout|validate|reward|advantage|pack|train`, and
// compares it with the in-process demo of the same seed: the same batches,
// bit for bit, nothing lost or duplicated.
func TestFleet(t *testing.T) { fleet(t, 4, 0) }

// TestFleetTrainerCrash kills the train process (SIGKILL, local state
// lost) after it published version 2 and starts it again: the restarted
// trainer resumes from the last release and its optimizer state, batches
// redelivered to it are not trained twice, and the run's batches are still
// those of the uninterrupted in-process demo.
func TestFleetTrainerCrash(t *testing.T) { fleet(t, 5, 2) }

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
// trainer is killed and restarted once version crashAt is released.
func fleet(t *testing.T, rounds int, crashAt int64) {
	want := demo(t, demoOptions{Updates: rounds, Seed: 1})

	dir := t.TempDir()
	bin := filepath.Join(dir, "trajflow")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
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
	releases := filepath.Join(dir, "releases")
	startOp := func(name string) *exec.Cmd {
		cmd, out := start("run", name, "--brokers", addr, "--releases", releases, "--rounds", fmt.Sprint(rounds),
			"--state", filepath.Join(dir, "state", name), "--log-level", "warn")
		go io.Copy(io.Discard, out)
		return cmd
	}
	var train *exec.Cmd
	for _, name := range loopStages {
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
	var hashes, launched []string
	err = pipeline.ScanTail(ctx, cfg, topics.Batches, 0, func(m pipeline.Message) error {
		h := sha256.Sum256(m.Value)
		hashes = append(hashes, hex.EncodeToString(h[:]))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	err = pipeline.ScanTail(ctx, cfg, topics.Tasks, 0, func(m pipeline.Message) error {
		atts, err := schemas.TaskAttempts.Decode(nil, m.Value)
		for _, a := range atts {
			launched = append(launched, a.AttemptID)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := audit.Collect(ctx, cfg, topics)
	if err != nil {
		t.Fatal(err)
	}
	counts := rep.Account(dedupe(launched))
	if counts.Launched != rounds*16*16 || counts.Lost != 0 || counts.Duplicated != 0 {
		t.Fatalf("fleet accounting %v", counts)
	}
	if !reflect.DeepEqual(hashes, want.BatchHashes) {
		t.Fatalf("fleet batches differ from the in-process demo:\n%v\n%v", hashes, want.BatchHashes)
	}
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

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
