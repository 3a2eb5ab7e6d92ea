package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/nettest"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func startBroker(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := kafka.StartBroker(ctx, kafka.BrokerConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b.Addr()
}

// topics create on one broker chooses replication 1 and min.insync.replicas
// 1 and says so; a factor the cluster cannot hold is refused.
func TestTopicsCreateReplication(t *testing.T) {
	addr := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out, errb bytes.Buffer
	if code := run(ctx, []string{"topics", "create", "--brokers", addr}, &out, &errb); code != 0 {
		t.Fatalf("topics create: exit %d: %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "replication: replication factor 1 (default on 1 broker), min.insync.replicas 1") ||
		!strings.Contains(out.String(), "replication=1 min.insync.replicas=1") {
		t.Fatalf("topics create did not print the chosen replication:\n%s", out.String())
	}
	topics, err := kafka.ListTopics(ctx, kafka.ClientConfig{}, []string{addr})
	if err != nil || len(topics) == 0 {
		t.Fatalf("ListTopics: %v, %v", topics, err)
	}
	for _, s := range topics {
		if s.ReplicationFactor != 1 || s.MinInsyncReplicas != 1 {
			t.Errorf("%s: replication %d, min.insync.replicas %d", s.Name, s.ReplicationFactor, s.MinInsyncReplicas)
		}
	}
	out.Reset()
	errb.Reset()
	code := run(ctx, []string{"topics", "create", "--brokers", addr, "--replication-factor", "3", "--allow-unsafe-replication"}, &out, &errb)
	if code != 1 || !strings.Contains(errb.String(), "replication factor 3 (--replication-factor) exceeds the 1 live broker") {
		t.Fatalf("replication 3 on one broker: exit %d: %s", code, errb.String())
	}
}

// TestTopicsCreateFlagsRefused: a --wait that is not positive, a
// malformed broker list or address, a client config that is not there or
// that names other brokers than --brokers exit 2 at once naming the flag,
// before any broker is dialed.
func TestTopicsCreateFlagsRefused(t *testing.T) {
	_, missing := testFile(t)
	cfg := filepath.Join(t.TempDir(), "client.yaml")
	if err := os.WriteFile(cfg, []byte("brokers: [127.0.0.1:2]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []refusalCase{
		{[]string{"--brokers", "127.0.0.1:1", "--wait", "0s"}, []string{"--wait 0s"}},
		{[]string{"--brokers", "127.0.0.1:1", "--wait", "-1s"}, []string{"--wait -1s"}},
		{[]string{"--brokers", "127.0.0.1:1,,"}, []string{"--brokers", "item 2 is empty"}},
		{[]string{"--brokers", "127.0.0.1:99999"}, []string{"--brokers", "99999"}},
		{[]string{"--brokers", "nohost"}, []string{`--brokers "nohost"`, "HOST:PORT"}},
		{[]string{"--brokers", "127.0.0.1:1", "--client-config", missing}, []string{"--client-config"}},
		{[]string{"--brokers", "127.0.0.1:1", "--client-config", cfg}, []string{"--brokers 127.0.0.1:1", "127.0.0.1:2", "give one of them"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"topics", "create"}, c.args...), c.want...)
		})
	}
}

// TestUpFlagsRefused: up refuses a wrong flag at once, naming it, before
// it waits for the cluster or writes its output directory.
func TestUpFlagsRefused(t *testing.T) {
	file, missing := testFile(t)
	out := filepath.Join(t.TempDir(), "fleet")
	for _, c := range []refusalCase{
		{[]string{"--wait", "0s"}, []string{"--wait 0s"}},
		{[]string{"--log-level", "bogus"}, []string{`--log-level "bogus"`}},
		{[]string{"--otlp-endpoint", "::bad"}, []string{`--otlp-endpoint "::bad"`}},
		{[]string{"--out", ""}, []string{`--out ""`}},
		{[]string{"--out", file}, []string{"--out", "not a directory"}},
		{[]string{"--eval-samples", "4294967297"}, []string{"--eval-samples 4294967297"}},
		{[]string{"--health-port", "65530"}, []string{"--health-port 65530", "past 65535"}},
		{[]string{"--brokers", "127.0.0.1:1,,"}, []string{"--brokers", "item 2 is empty"}},
		{[]string{"--client-config", missing}, []string{"--client-config"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"up", "--brokers", "127.0.0.1:1", "--wait", "2s", "--out", out}, c.args...), c.want...)
		})
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("a refused up wrote its output directory %s (stat: %v)", out, err)
	}
}

// TestStatusFlagsRefused: a malformed broker list or address and a
// client config that is not there exit 2 naming the flag.
func TestStatusFlagsRefused(t *testing.T) {
	_, missing := testFile(t)
	for _, c := range []refusalCase{
		{[]string{"--brokers", "127.0.0.1:1,,"}, []string{"--brokers", "item 2 is empty"}},
		{[]string{"--brokers", "nohost"}, []string{`--brokers "nohost"`}},
		{[]string{"--brokers", "127.0.0.1:1", "--client-config", missing}, []string{"--client-config"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"status"}, c.args...), c.want...)
		})
	}
}

// An operator whose health port is taken keeps running on another port of
// the same host, warns naming the taken address and prints where it serves.
func TestRunHealthPortTaken(t *testing.T) {
	addr := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var discard bytes.Buffer
	if code := run(ctx, []string{"topics", "create", "--brokers", addr}, &discard, &discard); code != 0 {
		t.Fatalf("topics create: exit %d: %s", code, discard.String())
	}
	hold, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Close()
	taken := hold.Addr().String()

	pr, pw := io.Pipe()
	var stderr lockedBuffer
	rctx, stop := context.WithCancel(ctx)
	done := make(chan int, 1)
	go func() {
		defer pw.Close()
		done <- run(rctx, []string{"run", "validate", "--brokers", addr, "--health", taken, "--state", t.TempDir(), "--log-level", "warn"}, pw, &stderr)
	}()
	defer func() {
		stop()
		go io.Copy(io.Discard, pr)
		select {
		case code := <-done:
			if code != 0 {
				t.Errorf("run validate: exit %d: %s", code, stderr.String())
			}
		case <-time.After(30 * time.Second):
			t.Error("run validate did not stop")
		}
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatalf("no health line: %v; stderr: %s", err, stderr.String())
	}
	used, ok := pipeline.HealthAddrOf(line)
	if !ok {
		t.Fatalf("line %q has no health address", line)
	}
	if used == taken || !strings.HasPrefix(used, "127.0.0.1:") {
		t.Fatalf("serving on %s, want another port of 127.0.0.1 than the taken %s", used, taken)
	}
	if !strings.Contains(stderr.String(), "health address taken") || !strings.Contains(stderr.String(), "taken="+taken) {
		t.Fatalf("no warning naming %s: %s", taken, stderr.String())
	}
	// The operator runs: it becomes ready on the port it chose.
	cl := http.Client{Timeout: 5 * time.Second}
	for deadline := time.Now().Add(30 * time.Second); ; {
		resp, err := cl.Get("http://" + used + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz on %s = %d %q after 30s; stderr: %s", used, resp.StatusCode, body, stderr.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	// trajflow status, given a fleet.json naming it, reads its readiness
	// and its /metrics: nothing has reached it yet.
	out := t.TempDir()
	doc := fleetDoc{Run: "demo", Brokers: addr, Operators: []fleetMember{{Stage: "validate", PID: os.Getpid(), Health: used}}}
	b, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(out, FleetFile), b, 0o644); err != nil {
		t.Fatal(err)
	}
	var st, sterr bytes.Buffer
	if code := run(ctx, []string{"status", "--out", out}, &st, &sterr); code != 0 {
		t.Fatalf("status: exit %d: %s", code, sterr.String())
	}
	for _, want := range []string{"http://" + used, "200 ready", "records in 0, out 0, in flight 0, consumer lag 0, busy 0.0 s, backpressure 0.0 s, quarantined 0"} {
		if !strings.Contains(st.String(), want) {
			t.Errorf("status lacks %q:\n%s", want, st.String())
		}
	}
}

// topics create started before the broker waits for it (the README starts
// the broker in the background and creates the topics at once); without
// one it gives up after --wait with an error naming the address, the
// cause and what to check, for a closed port and for a port that is not
// Kafka.
func TestTopicsCreateWaitsForTheBroker(t *testing.T) {
	hold, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := hold.Addr().String()
	hold.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	done := make(chan int, 1)
	var out, errb lockedBuffer
	go func() {
		done <- run(ctx, []string{"topics", "create", "--brokers", addr, "--wait", "40s"}, &out, &errb)
	}()
	time.Sleep(1500 * time.Millisecond)
	b, err := kafka.StartBroker(ctx, kafka.BrokerConfig{Addr: addr, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if code := <-done; code != 0 {
		t.Fatalf("topics create before the broker: exit %d: %s", code, errb.String())
	}
	if !strings.Contains(errb.String(), "waiting up to 40s for a Kafka broker at "+addr) {
		t.Errorf("no waiting notice naming %s: %s", addr, errb.String())
	}
	if !strings.Contains(out.String(), "partitions=") {
		t.Errorf("no topic created: %s", out.String())
	}

	// Nothing listens: the error names the address and the refusal.
	var o2, e2 bytes.Buffer
	start := time.Now()
	code := run(ctx, []string{"topics", "create", "--brokers", "127.0.0.1:1", "--wait", "1s"}, &o2, &e2)
	if code != 1 || !strings.Contains(e2.String(), "no Kafka broker answered at 127.0.0.1:1 within 1s") ||
		!strings.Contains(e2.String(), "connection refused") || !strings.Contains(e2.String(), "is a broker running there") {
		t.Errorf("closed port: exit %d: %s", code, e2.String())
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Errorf("closed port: gave up after %s, want about --wait", d)
	}

	// A listener that never answers the Kafka protocol.
	sink := nettest.Greeter(t, nil)
	e2.Reset()
	code = run(ctx, []string{"topics", "create", "--brokers", sink, "--wait", "1s"}, &o2, &e2)
	if code != 1 || !strings.Contains(e2.String(), "at "+sink) || !strings.Contains(e2.String(), "does not answer the Kafka protocol") {
		t.Errorf("non-Kafka port: exit %d: %s", code, e2.String())
	}

	// A server of another protocol that answers (an SSH server speaks
	// first): no waiting, at once the address and what to check.
	sshAddr := nettest.Greeter(t, []byte("SSH-2.0-OpenSSH_9.2p1\r\n"))
	e2.Reset()
	start = time.Now()
	code = run(ctx, []string{"topics", "create", "--brokers", sshAddr, "--wait", "30s"}, &o2, &e2)
	if code != 1 || !strings.Contains(e2.String(), "no Kafka broker answered at "+sshAddr+":") ||
		!strings.Contains(e2.String(), "a server of another protocol listens there") {
		t.Errorf("SSH server: exit %d: %s", code, e2.String())
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("SSH server: gave up after %s, want at once (not --wait 30s)", d)
	}
}

// TestFleetGate: a fleet with the eval and gate operators (trajflow up)
// rules as the demo's gate does. Run regress-1 with the token-mean
// objective (testkit.RegressMean) rolls back at its first evaluation
// (release 5): the gate operator's decision makes the trainer
// republish release 0's parameters as release 6, and the rounds after it
// train on them; the fleet's batches and the gate's decisions on every
// release equal the in-process demo's, every attempt accounted.
func TestFleetGate(t *testing.T) {
	addr := startBroker(t)
	c := contract.Default()
	c.RunID = "regress-1"
	testkit.RegressMean(c)
	path := testkit.ContractFile(t, c)
	dir := t.TempDir()
	const rounds = 7
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	out := filepath.Join(dir, "fleet")
	// up starts its operators from its own executable: the built binary.
	cmd := exec.CommandContext(ctx, trajflowBinary(t), "up", "--brokers", addr, "--contract", path, "--rounds", strconv.Itoa(rounds),
		"--eval-samples", "1", "--out", out, "--log-level", "warn")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("up: %v\n%s", err, b)
	}
	var got loop.Summary
	testkit.ReadJSON(t, filepath.Join(out, loop.SummaryFile), &got)
	want, err := loop.Run(ctx, loop.Options{Updates: rounds, Seed: 1, RunID: "regress-1", EvalSamples: 1, Quiet: true, Out: t.TempDir(),
		Edit: testkit.RegressMean}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got.Lost != 0 || got.DuplicatesAdmitted != 0 || got.AttemptsLaunched != rounds*16*16 {
		t.Fatalf("fleet: launched %d, lost %d, duplicates %d", got.AttemptsLaunched, got.Lost, got.DuplicatesAdmitted)
	}
	if !reflect.DeepEqual(got.BatchHashes, want.BatchHashes) {
		t.Fatalf("fleet batches differ from the gated demo's:\n%v\n%v", got.BatchHashes, want.BatchHashes)
	}
	topics, _ := pipeline.TopicsFor("regress-1")
	var ruled []string
	err = pipeline.ScanTail(ctx, &pipeline.Config{Brokers: []string{addr}}, topics.Decisions, 0, func(m pipeline.Message) error {
		d, err := schemas.DecodeGateDecision(m.Value)
		if err != nil {
			return err
		}
		if d.Resume == nil {
			return fmt.Errorf("decision on release %d (%s) without the gate's state", d.PolicyVersion, d.Action)
		}
		ruled = append(ruled, fmt.Sprintf("%d %s final=%v", d.PolicyVersion, d.Action, d.Final))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var demoRuled []string
	for _, d := range want.Gate.Decisions {
		demoRuled = append(demoRuled, fmt.Sprintf("%d %s final=%v", d.PolicyVersion, d.Action, d.Final))
	}
	// Both end with the final evaluation of the last release (not an
	// evaluation release: eval_every is 5), ruled on after its KL.
	if !reflect.DeepEqual(ruled, demoRuled) || len(ruled) < 9 || ruled[5] != "5 rollback final=false" || !strings.HasSuffix(ruled[len(ruled)-1], "final=true") {
		t.Fatalf("the gate operator ruled\n%v\nthe demo's gate\n%v\nwant the same, with release 5 rolled back and a final ruling", ruled, demoRuled)
	}
}

// TestRunProgressTrained: eight batches (0..7), the gate rolled release 5
// back, so the trainer's releases run one version ahead of the batches it
// consumed: release 8 (next_batch 7) leaves batch 7 in the trainer, and
// only release 9 (next_batch 8) finishes the run. A trainer that does not
// say next_batch is read as one batch per version.
func TestRunProgressTrained(t *testing.T) {
	for _, tc := range []struct {
		version, next int64
		want          bool
	}{{7, 6, false}, {8, 7, false}, {9, 8, true}, {7, 0, false}, {8, 0, true}} {
		p := runProgress{Want: 16, Decided: 16, Batches: 8, Version: tc.version,
			Release: schemas.PolicyRelease{PolicyVersion: tc.version, NextBatch: tc.next, Ready: true}}
		if got := p.trained(); got != tc.want {
			t.Errorf("release %d, next_batch %d, 8 batches: trained %v, want %v", tc.version, tc.next, got, tc.want)
		}
	}
	if (runProgress{Want: 16, Decided: 15, Batches: 8, Version: 9, Release: schemas.PolicyRelease{NextBatch: 8}}).trained() {
		t.Error("trained with a group undecided")
	}
}

// TestUpRestartsAKilledOperator kills the train operator of a running
// fleet with SIGKILL once the first release is out: up starts it again
// (same command line, its log appended, fleet.json with the new pid and
// one restart), the run ends by itself, and its summary equals the
// in-process demo's of the same seed: nothing lost, nothing trained twice.
func TestUpRestartsAKilledOperator(t *testing.T) {
	const rounds = 6
	addr := startBroker(t)
	bin := trajflowBinary(t)
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var stdout lockedBuffer
	up := exec.CommandContext(ctx, bin, "up", "--brokers", addr, "--rounds", strconv.Itoa(rounds), "--out", out, "--log-level", "warn")
	up.Stdout, up.Stderr = &stdout, &stdout
	if err := up.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- up.Wait() }() // joined below
	first := filepath.Join(out, "releases", "policy-v00000001.json")
	for {
		if _, err := os.Stat(first); err == nil {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("up ended before its first release: %v\n%s", err, stdout.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
	var doc fleetDoc
	testkit.ReadJSON(t, filepath.Join(out, FleetFile), &doc)
	var victim fleetMember
	for _, m := range doc.Operators {
		if m.Stage == "train" {
			victim = m
		}
		// Each operator leads its own process group: a terminal's Ctrl-C
		// reaches up alone, which interrupts each operator once.
		if pg, err := syscall.Getpgid(m.PID); err == nil && pg != m.PID {
			t.Errorf("%s (pid %d) is in process group %d, not its own", m.Stage, m.PID, pg)
		}
	}
	if err := syscall.Kill(victim.PID, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 train (pid %d): %v", victim.PID, err)
	}
	if err := <-done; err != nil {
		t.Fatalf("up after a kill -9 of train: %v\n%s", err, stdout.String())
	}
	text := stdout.String()
	if !strings.Contains(text, fmt.Sprintf("train      pid %d ended (signal: killed); restarting it", victim.PID)) ||
		!strings.Contains(text, "train      exited 0") {
		t.Errorf("up's output does not show train killed, restarted and ending:\n%s", text)
	}
	testkit.ReadJSON(t, filepath.Join(out, FleetFile), &doc)
	for _, m := range doc.Operators {
		if m.Stage == "train" && (m.Restarts != 1 || m.PID == victim.PID) {
			t.Errorf("fleet.json's train after one restart: %+v (killed pid %d)", m, victim.PID)
		}
	}
	var got loop.Summary
	testkit.ReadJSON(t, filepath.Join(out, loop.SummaryFile), &got)
	want := testkit.Demo(t, loop.Options{Updates: rounds, Seed: 1, EvalSamples: 4})
	if got.Lost != 0 || got.DuplicatesAdmitted != 0 || got.Updates != rounds || !reflect.DeepEqual(got.BatchHashes, want.BatchHashes) ||
		got.EvalSuccessFinal != want.EvalSuccessFinal {
		t.Fatalf("fleet with a killed trainer: updates %d lost %d duplicates %d eval %v, hashes %v;\ndemo: eval %v, hashes %v\n%s",
			got.Updates, got.Lost, got.DuplicatesAdmitted, got.EvalSuccessFinal, got.BatchHashes, want.EvalSuccessFinal, want.BatchHashes, text)
	}
}

// TestStatusOfAStoppedFleet: status --out of a fleet none of whose
// operators answers, its rounds not done, says it is not running rather
// than running.
func TestStatusOfAStoppedFleet(t *testing.T) {
	addr := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var o, e bytes.Buffer
	if code := run(ctx, []string{"topics", "create", "--brokers", addr}, &o, &e); code != 0 {
		t.Fatalf("topics create: exit %d: %s", code, e.String())
	}
	hold, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := hold.Addr().String()
	hold.Close()
	out := t.TempDir()
	b, err := json.Marshal(fleetDoc{Run: "demo", Brokers: addr, Rounds: 3, Operators: []fleetMember{{Stage: "train", PID: 1, Health: dead, Restarts: 2}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(out, FleetFile), b, 0o644); err != nil {
		t.Fatal(err)
	}
	o.Reset()
	if code := run(ctx, []string{"status", "--out", out}, &o, &e); code != 0 {
		t.Fatalf("status: exit %d: %s", code, e.String())
	}
	if !strings.Contains(o.String(), "0 of 3 decided (0 of 48 groups), not running: no operator of fleet.json answers") ||
		!strings.Contains(o.String(), "not answering (stopped, or not started yet) (restarted 2 times by trajflow up)") {
		t.Errorf("status of a fleet that is gone:\n%s", o.String())
	}
}

// TestRestartable: which ends of an operator up restarts: killed by a
// signal, exit 1, and exit 2 from a Go runtime crash; not exit 2 after the
// command's own configuration error line, nor other statuses.
func TestRestartable(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, script, log string
		want              bool
	}{
		{"killed", "kill -9 $$", "", true},
		{"runtime failure", "exit 1", "trajflow run: pipeline: kafka: no broker answered\n", true},
		{"panic", "exit 2", "panic: runtime error: index out of range\n\ngoroutine 7 [running]:\nmain.main()\n\t/src/x.go:12 +0x1d\n", true},
		{"configuration error", "exit 2", "some line\ntrajflow run: configuration error: operators: eval: policy.protocol vllm\n", false},
		{"other status", "exit 3", "", false},
		{"success", "exit 0", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			log := filepath.Join(dir, tc.name+".log")
			if err := os.WriteFile(log, []byte(tc.log), 0o644); err != nil {
				t.Fatal(err)
			}
			err := exec.Command("sh", "-c", tc.script).Run()
			if got := restartable(err, log); got != tc.want {
				t.Fatalf("%s (%v, log %q): restartable %v, want %v", tc.script, err, tc.log, got, tc.want)
			}
		})
	}
}
