package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/internal/testkit"
)

// TestBenchCommand runs a short `trajflow bench` with two validate
// instances in one consumer group and checks the JSON report: the keys the
// report promises, values in their ranges, every stage and instance
// reported, and the accounting (nothing lost, nothing duplicated). It
// asserts no speed.
func TestBenchCommand(t *testing.T) {
	dir := t.TempDir()
	png := filepath.Join(dir, "bench.png")
	args := []string{"bench", "--contract", "../../testdata/contracts/bench.yaml", "--duration", "3s", "--warmup", "3s", // past the first batches, on a loaded machine too
		"--baseline", "1s", "--instances", "validate=2", "--mean-tokens", "400", "--max-tokens", "8000",
		"--json", "--plot", png, "--cpu-roles"}
	var stdout, stderr bytes.Buffer
	limit := debug.SetMemoryLimit(-1)
	if code := run(context.Background(), args, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if got := debug.SetMemoryLimit(-1); got != limit {
		t.Errorf("the bench left the Go memory limit at %d, it was %d", got, limit)
	}
	var rep map[string]any
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("report is not JSON: %v\n%s", err, stdout.String())
	}
	positive := []string{"e2e_tokens_per_s", "baseline_mb_s", "pipeline_mb_s", "ratio_to_baseline", "packing_efficiency", "yield", "peak_rss_mb", "e2e_records_per_s", "memory_limit_mb", "retention_mb"}
	for _, k := range positive {
		v, ok := rep[k].(float64)
		if !ok || v <= 0 {
			t.Errorf("%s = %v, want a positive number", k, rep[k])
		}
	}
	for _, k := range []string{"packing_efficiency", "yield"} {
		if v, _ := rep[k].(float64); v > 1 {
			t.Errorf("%s = %v, want a share <= 1", k, v)
		}
	}
	losses, _ := rep["losses"].(map[string]any)
	sum := rep["yield"].(float64)
	for _, k := range []string{"invalid", "infrastructure_failure", "zero_variance", "stale", "overlong", "quarantine"} {
		v, ok := losses[k].(float64)
		if !ok {
			t.Errorf("losses has no %q: %v", k, losses)
		}
		sum += v
	}
	for _, k := range []string{"evaluator_error", "other_filtered"} {
		v, _ := losses[k].(float64)
		sum += v
	}
	if sum < 0.999 || sum > 1.001 {
		t.Errorf("yield plus losses = %v, want 1 (every generated action token accounted)", sum)
	}
	stages, _ := rep["stages"].([]any)
	want := []string{"validate", "reward", "advantage", "pack"}
	if len(stages) != len(want) {
		t.Fatalf("stages = %v, want %v", stages, want)
	}
	for i, s := range stages {
		st := s.(map[string]any)
		if st["name"] != want[i] {
			t.Errorf("stage %d = %v, want %s", i, st["name"], want[i])
		}
		if v, _ := st["tokens_per_s"].(float64); v <= 0 {
			t.Errorf("stage %s tokens_per_s = %v", want[i], st["tokens_per_s"])
		}
		insts, _ := st["instances"].([]any)
		if want[i] == "validate" && len(insts) != 2 {
			t.Errorf("validate reports %d instances, want 2", len(insts))
		}
	}
	checkRoles(t, "pipeline", rep["cpu_by_role"], rep["pipeline_mb_per_cpu_s"], "broker", "validate", "reward", "advantage", "pack", "source", "sink")
	if bl, ok := rep["baseline"].(map[string]any); ok {
		checkRoles(t, "baseline", bl["cpu_by_role"], bl["mb_per_cpu_s"], "broker", "baseline")
	} else {
		t.Errorf("no baseline in the report")
	}
	acct := rep["accounting"].(map[string]any)
	if acct["Lost"].(float64) != 0 || acct["Duplicated"].(float64) != 0 || acct["Launched"].(float64) == 0 {
		t.Errorf("accounting %v: want launched > 0, lost 0, duplicated 0", acct)
	}
	if rep["correct"] != true {
		t.Errorf("correct = %v", rep["correct"])
	}
	b, err := os.ReadFile(png)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(b, []byte("\x89PNG")) {
		t.Errorf("%s is not a PNG", png)
	}
}

// checkRoles checks a window's CPU by role (--cpu-roles): the broker there
// with CPU time, every other row one of the roles of the window (known)
// or unlabelled, shares summing to 1, and the milliseconds per MB summing
// to the window's CPU per MB (1000 / MB per CPU-second). (Which of the
// lighter roles a short window's 100-Hz samples catch is chance.)
func checkRoles(t *testing.T, window string, v, mbPerCPUS any, known ...string) {
	t.Helper()
	rows, _ := v.([]any)
	cpu := map[string]float64{}
	var share, msPerMB float64
	for _, r := range rows {
		m := r.(map[string]any)
		role := m["role"].(string)
		cpu[role] = m["cpu_s"].(float64)
		share += m["share"].(float64)
		msPerMB += m["ms_per_mb"].(float64)
		if role != "unlabelled" && !slices.Contains(known, role) {
			t.Errorf("%s cpu_by_role: role %q, want one of %v or unlabelled", window, role, known)
		}
	}
	if cpu["broker"] <= 0 {
		t.Errorf("%s cpu_by_role %v: no CPU for the broker", window, rows)
	}
	if math.Abs(share-1) > 1e-6 {
		t.Errorf("%s cpu_by_role shares sum to %v, want 1", window, share)
	}
	if mb, _ := mbPerCPUS.(float64); mb <= 0 || math.Abs(msPerMB-1000/mb) > 0.05*1000/mb {
		t.Errorf("%s cpu_by_role: %.3f ms per MB in all, want about 1000 / %.1f MB per CPU-second", window, msPerMB, mb)
	}
}

// TestBenchCPURolesRefusals: --cpu-roles runs the process's one CPU
// profile (so not beside --cpuprofile) and profiles this process (so not
// with the operators in others).
func TestBenchCPURolesRefusals(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--cpuprofile", filepath.Join(t.TempDir(), "cpu.prof")}, "one CPU profile at a time"},
		{[]string{"--processes"}, "operators run in others"},
	} {
		var stdout, stderr bytes.Buffer
		args := append([]string{"bench", "--contract", "../../testdata/contracts/bench.yaml", "--cpu-roles"}, tc.args...)
		if code := run(context.Background(), args, &stdout, &stderr); code == 0 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v: exit %d, stderr %q: want a refusal saying %q", tc.args, code, stderr.String(), tc.want)
		}
	}
}

// TestBenchRejectsPackInstances: pack is the single writer of the batch
// sequence.
func TestBenchRejectsPackInstances(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"bench", "--contract", "../../testdata/contracts/bench.yaml", "--instances", "pack=2"}, &stdout, &stderr)
	if code == 0 || !bytes.Contains(stderr.Bytes(), []byte("single writer")) {
		t.Fatalf("exit %d, stderr %q: want a refusal of pack=2", code, stderr.String())
	}
}

// TestBenchPacedBaseline: with --baseline-rate the baseline's producer
// keeps to the pace (the consumer can only read what was produced) and
// the report says so.
//
// The bench runs on a broker of the test's own (--brokers); once the bench
// has returned none of its goroutines runs (the sink's reader, closing,
// left its group with a dial of the broker after the bench had returned),
// and once that broker is closed nothing of the bench dials its address
// again (testkit.NoDials: every client's transport was closed). On such a
// cluster the bench deletes the topics it created.
func TestBenchPacedBaseline(t *testing.T) {
	const rate = 40
	b, err := kafka.StartBroker(context.Background(), kafka.BrokerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"bench", "--contract", "../../testdata/contracts/bench.yaml", "--duration", "1s", "--warmup", "0s",
		"--baseline", "2s", "--baseline-rate", "40", "--mean-tokens", "400", "--max-tokens", "8000", "--json", "--brokers", b.Addr()}
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	left := runTopics(t, b.Addr(), stdout.Bytes())
	b.Close()
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if len(left) > 0 {
		t.Errorf("the bench left its topics on the cluster: %v", left)
	}
	testkit.NoGoroutines(t, "github.com/trajflow/trajflow/bench.")
	testkit.NoDials(t, b.Addr(), 3*kafka.MetadataTTL)
	var rep struct {
		Topics   string `json:"topics"`
		Baseline struct {
			RecordsPerS float64 `json:"records_per_s"`
			PacedRate   float64 `json:"paced_msgs_per_s"`
		} `json:"baseline"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("report is not JSON: %v\n%s", err, stdout.String())
	}
	if !strings.HasPrefix(rep.Topics, "deleted (") {
		t.Errorf("report says topics %q, want them deleted", rep.Topics)
	}
	if rep.Baseline.PacedRate != rate {
		t.Errorf("paced_msgs_per_s = %v, want %d", rep.Baseline.PacedRate, rate)
	}
	// Unpaced, the same broker moves thousands of these messages a second.
	if r := rep.Baseline.RecordsPerS; r <= 0 || r > rate*1.25 {
		t.Errorf("baseline read %.1f messages/s, want at most the pace of %d (+25%%)", r, rate)
	}
}

// runTopics lists the topics of the cluster at addr that belong to the run
// of the bench report rep (JSON).
func runTopics(t *testing.T, addr string, rep []byte) []string {
	t.Helper()
	var r struct {
		Run string `json:"run"`
	}
	if err := json.Unmarshal(rep, &r); err != nil || r.Run == "" {
		t.Fatalf("report without a run id (%v):\n%s", err, rep)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	specs, err := kafka.ListTopics(ctx, kafka.ClientConfig{}, []string{addr})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, s := range specs {
		if strings.HasPrefix(s.Name, r.Run+".") {
			out = append(out, s.Name)
		}
	}
	return out
}

// TestBenchKeepTopics: with --keep-topics the run's topics stay on the
// cluster, and the report says so.
func TestBenchKeepTopics(t *testing.T) {
	b, err := kafka.StartBroker(context.Background(), kafka.BrokerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	args := []string{"bench", "--contract", "../../testdata/contracts/bench.yaml", "--duration", "1s", "--warmup", "0s",
		"--baseline", "-1s", "--mean-tokens", "400", "--max-tokens", "8000", "--json", "--brokers", b.Addr(), "--keep-topics"}
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), args, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	left := runTopics(t, b.Addr(), stdout.Bytes())
	if len(left) < 10 {
		t.Fatalf("with --keep-topics the cluster holds %d of the run's topics (%v), want all of them", len(left), left)
	}
	var rep struct {
		Topics string `json:"topics"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil || !strings.HasPrefix(rep.Topics, "kept: ") {
		t.Fatalf("report says topics %q (%v), want kept", rep.Topics, err)
	}
}

// TestBenchFlagsRefused: values that mean nothing (a window that is not
// positive, NaN tokens, malformed lists), flags given where they do
// nothing and outputs in missing directories exit 2 at once naming the
// flag; no broker starts, no baseline runs.
func TestBenchFlagsRefused(t *testing.T) {
	file, missing := testFile(t)
	for _, c := range []refusalCase{
		{[]string{"--duration", "0s"}, []string{"--duration 0s"}},
		{[]string{"--warmup", "-1s"}, []string{"--warmup -1s"}},
		{[]string{"--tokens", "-5"}, []string{"--tokens -5"}},
		{[]string{"--mean-tokens", "NaN"}, []string{"--mean-tokens NaN"}},
		{[]string{"--mean-tokens", "0"}, []string{"--mean-tokens 0"}},
		{[]string{"--max-tokens", "0"}, []string{"--max-tokens 0"}},
		{[]string{"--inflight-groups", "0"}, []string{"--inflight-groups 0"}},
		{[]string{"--linger", "-1s"}, []string{"--linger -1s"}},
		{[]string{"--log-level", "bogus"}, []string{`--log-level "bogus"`}},
		{[]string{"--baseline-rate", "NaN"}, []string{"--baseline-rate NaN"}},
		{[]string{"--baselines", "kafka-go,,franz-go"}, []string{"--baselines", "item 2 is empty"}},
		{[]string{"--baselines", ""}, []string{`--baselines ""`}},
		{[]string{"--instances", "validate=2,,reward=1"}, []string{"--instances", "empty item"}},
		{[]string{"--instances", "validate=2,validate=3"}, []string{"--instances", "twice"}},
		{[]string{"--kill", "pack"}, []string{"--kill", "--processes"}},
		{[]string{"--kill-at", "5s"}, []string{"--kill-at 5s", "needs --kill"}},
		{[]string{"--baseline", "-1s", "--baseline-rate", "100"}, []string{"--baseline-rate 100", "negative --baseline"}},
		{[]string{"--cpu-pids", "1,,2"}, []string{"--cpu-pids", "item 2 is empty"}},
		{[]string{"--tcp-only", "--brokers", "127.0.0.1:1"}, []string{"--tcp-only", "embedded broker"}},
		{[]string{"--data-dir", file}, []string{"--data-dir", "not a directory"}},
		{[]string{"--json-out", missing}, []string{"--json-out", "no such file"}},
		{[]string{"--memprofile", missing}, []string{"--memprofile", "no such file"}},
		{[]string{"--contract", missing}, []string{"--contract"}},
		{[]string{"extra"}, []string{"no arguments", "extra"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"bench", "--contract", "../../testdata/contracts/bench.yaml", "--duration", "1s"}, c.args...), c.want...)
		})
	}
}

// TestBenchLoopFlagsRefused: an unknown, empty or repeated mode, counts
// that are not positive, a compared update past the last, the async
// mode's flags without it and a contract field the async mode refuses
// exit 2 at once naming the flag, before any mode runs.
func TestBenchLoopFlagsRefused(t *testing.T) {
	_, missing := testFile(t)
	for _, c := range []refusalCase{
		{[]string{"--mode", "sync,nope"}, []string{`mode "nope"`}},
		{[]string{"--mode", "sync,,async"}, []string{"--mode", "item 2 is empty"}},
		{[]string{"--mode", "sync,sync"}, []string{"--mode", "twice"}},
		{[]string{"--updates", "0"}, []string{"--updates 0"}},
		{[]string{"--workers", "0"}, []string{"--workers 0"}},
		{[]string{"--eval-samples", "5000000000"}, []string{"--eval-samples 5000000000"}},
		{[]string{"--compare", "100"}, []string{"--compare 100"}},
		{[]string{"--compare", "-1"}, []string{"--compare -1"}},
		{[]string{"--is-cap", "2"}, []string{"--is-cap 2", "--off-policy"}},
		{[]string{"--mode", "sync", "--stale-policy", "drop"}, []string{"--stale-policy drop", "async"}},
		{[]string{"--mode", "sync,async", "--off-policy", "bogus"}, []string{"async", "loss.off_policy", "bogus"}},
		{[]string{"--mode", "sync", "--tool-median-ms", "NaN"}, []string{"latency.tool_median_ms", "NaN"}},
		{[]string{"--out", ""}, []string{`--out ""`}},
		{[]string{"--cpuprofile", missing}, []string{"--cpuprofile", "no such file"}},
		{[]string{"extra"}, []string{"no arguments", "extra"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"bench", "loop", "--updates", "2", "--out", t.TempDir()}, c.args...), c.want...)
		})
	}
}
