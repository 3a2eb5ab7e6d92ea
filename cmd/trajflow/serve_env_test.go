package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/envsvc"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// trajflowBin builds the command into the test's temporary directory.
func trajflowBin(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "trajflow")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// envProcess is one `trajflow serve env` process.
type envProcess struct {
	cmd    *exec.Cmd
	url    string
	stderr *bytes.Buffer
}

var listenRE = regexp.MustCompile(`listening on (http://[0-9.:]+)`)

func startEnvProcess(t *testing.T, bin string, port int, data string, extra ...string) *envProcess {
	t.Helper()
	args := append([]string{"serve", "env", "--port", fmt.Sprint(port), "--data", data, "--log-level", "warn"}, extra...)
	cmd := exec.Command(bin, args...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &envProcess{cmd: cmd, stderr: &bytes.Buffer{}}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := listenRE.FindStringSubmatch(sc.Text()); m != nil {
				line <- m[1]
			}
		}
		io.Copy(io.Discard, stdout)
	}()
	select {
	case p.url = <-line:
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		t.Fatalf("serve env did not start: %s", p.stderr)
	}
	t.Cleanup(func() { p.kill() })
	return p
}

func (p *envProcess) kill() {
	if p.cmd.ProcessState == nil {
		p.cmd.Process.Signal(syscall.SIGKILL)
		p.cmd.Wait()
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func envAttempts(reg *rollout.Registry, tasks []rollout.Task, g, attempt int32) []schemas.TaskAttempt {
	var out []schemas.TaskAttempt
	for i, task := range tasks {
		for _, a := range rollout.Attempts("run", task, int64(i), g, 7, 0, "contract") {
			if attempt > 0 {
				a.Attempt = attempt
				a.AttemptID = schemas.AttemptID(a.RunID, a.TaskID, a.GroupID, a.Member, attempt)
				a.Seed = int64(schemas.SeedFor(7, a.AttemptID, "env"))
			}
			out = append(out, a)
		}
	}
	return out
}

func fixedEnvLimits() rollout.Limits {
	l := rollout.DefaultLimits()
	l.Now = func() time.Time { return time.Unix(1700000000, 0) }
	return l
}

func TestServeEnvUsage(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"serve"}, &out, &errb); code != 2 {
		t.Fatalf("serve without an end: %d %s", code, errb.String())
	}
	errb.Reset()
	if code := run(context.Background(), []string{"serve", "env", "--port", "0"}, &out, &errb); code != 2 || !strings.Contains(errb.String(), "--data") {
		t.Fatalf("serve env without --data: %d %s", code, errb.String())
	}
	errb.Reset()
	if code := run(context.Background(), []string{"serve", "env", "--data", t.TempDir(), "--families", "kv,chess"}, &out, &errb); code != 2 || !strings.Contains(errb.String(), "chess") {
		t.Fatalf("unknown family: %d %s", code, errb.String())
	}
	errb.Reset()
	if code := run(context.Background(), []string{"serve", "policy"}, &out, &errb); code != 2 {
		t.Fatalf("serve policy: %d %s", code, errb.String())
	}
}

// TestServeEnvFlagsRefused: caps that are not positive, a malformed key
// file, a key file in a missing directory and a host that does not
// resolve are configuration errors (exit 2) naming the flag, never
// replaced by defaults; the service does not start.
func TestServeEnvFlagsRefused(t *testing.T) {
	dir := t.TempDir()
	badKey := filepath.Join(dir, "bad.key")
	if err := os.WriteFile(badKey, []byte("not hex\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		flag string
	}{
		{[]string{"--max-episodes", "0"}, "--max-episodes"},
		{[]string{"--max-episodes", "-5"}, "--max-episodes"},
		{[]string{"--step-timeout", "-1s"}, "--step-timeout"},
		{[]string{"--step-timeout", "0s"}, "--step-timeout"},
		{[]string{"--lease", "-1s"}, "--lease"},
		{[]string{"--max-lease", "-1s"}, "--max-lease"},
		{[]string{"--lease", "5m"}, "--lease"},
		{[]string{"--max-observation-bytes", "-1"}, "--max-observation-bytes"},
		{[]string{"--key-file", badKey}, "--key-file"},
		{[]string{"--key-file", filepath.Join(dir, "missing", "capability.key")}, "--key-file"},
		{[]string{"--host", "[::1"}, "--host"},
		{[]string{"--host", "no-such-host.invalid"}, "--host"},
		{[]string{"--host", ""}, `--host ""`},
		{[]string{"--families", "kv,,ledger"}, "--families"},
		{[]string{"--log-level", "bogus"}, `--log-level "bogus"`},
		{[]string{"--data", badKey}, "--data"},
		{[]string{"extra"}, "no arguments"},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			data := filepath.Join(t.TempDir(), "data")
			var out, errb bytes.Buffer
			args := append([]string{"serve", "env", "--port", "0", "--data", data}, c.args...)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			code := run(ctx, args, &out, &errb)
			if code != 2 || !strings.Contains(errb.String(), c.flag) {
				t.Fatalf("exit %d, stderr %q; want 2 naming %s", code, errb.String(), c.flag)
			}
			if out.Len() != 0 {
				t.Fatalf("the service started: %s", out.String())
			}
		})
	}

	// The default key file, DATA/capability.key, malformed.
	data := t.TempDir()
	if err := os.WriteFile(filepath.Join(data, "capability.key"), []byte("0123\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out, errb bytes.Buffer
	if code := run(ctx, []string{"serve", "env", "--port", "0", "--data", data}, &out, &errb); code != 2 || !strings.Contains(errb.String(), "capability.key") {
		t.Fatalf("malformed DATA/capability.key: exit %d, stderr %q; want 2 naming the file", code, errb.String())
	}
}

// TestServeEnvSameTrajectories: kv trajectories through a `trajflow serve
// env` process are byte-identical to the in-process ones (same seed).
func TestServeEnvSameTrajectories(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	data := t.TempDir()
	p := startEnvProcess(t, trajflowBin(t), 0, data)
	key, err := envsvc.ReadKeyFile(filepath.Join(data, "capability.key"))
	if err != nil {
		t.Fatal(err)
	}
	c, err := envsvc.New([]string{p.url}, key, envsvc.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	reg, _ := rollout.NewFamilyRegistry(rollout.FamilyKV)
	m, err := model.New(model.Config{Vocab: rollout.VocabSize, Window: 12, Embed: 16, Hidden: 64}, 11)
	if err != nil {
		t.Fatal(err)
	}
	pol := model.NewPolicy(m, 0)
	atts := envAttempts(reg, reg.Train()[:32], 8, 0)
	s := rollout.DefaultSettings(reg)
	in, err := rollout.Agent{Env: reg, Policy: pol, Settings: s, Limits: fixedEnvLimits()}.Run(ctx, atts)
	if err != nil {
		t.Fatal(err)
	}
	out, err := rollout.Agent{Env: c, Policy: pol, Settings: s, Limits: fixedEnvLimits()}.Run(ctx, atts)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := schemas.Trajectories.Encode(nil, in)
	b, _ := schemas.Trajectories.Encode(nil, out)
	if !bytes.Equal(a, b) {
		t.Fatal("trajectories through serve env differ from the in-process ones")
	}
	h, err := c.Health(ctx)
	if err != nil || h[0].Live != 0 || strings.Join(h[0].Families, ",") != "kv,ledger,text" {
		t.Fatalf("health %+v %v", h, err)
	}
}

// killingEnv wraps an environment: the n-th Step call (of any episode)
// first runs hook.
type killingEnv struct {
	rollout.Environment
	n    int64
	at   int64
	hook func()
}

func (k *killingEnv) Reset(ctx context.Context, a schemas.TaskAttempt) (rollout.Episode, rollout.Observation, error) {
	ep, obs, err := k.Environment.Reset(ctx, a)
	if err != nil {
		return nil, obs, err
	}
	return &killingEpisode{ep, k}, obs, nil
}

func (k *killingEnv) Concurrency() int { return k.Environment.(rollout.Concurrent).Concurrency() }

type killingEpisode struct {
	rollout.Episode
	k *killingEnv
}

func (e *killingEpisode) Step(ctx context.Context, turn int32, a rollout.EnvAction) (rollout.Transition, error) {
	if atomic.AddInt64(&e.k.n, 1) == e.k.at {
		e.k.hook()
	}
	return e.Episode.Step(ctx, turn, a)
}

// runLedger runs the ledger teacher's attempts like the rollout stage: a
// run that fails for the infrastructure is run again with the next attempt
// number. It returns the trajectories and the number of failed runs.
func runLedger(t *testing.T, ctx context.Context, env rollout.Environment, reg *rollout.Registry, tasks []rollout.Task, retries int) ([]schemas.Trajectory, int) {
	t.Helper()
	for try := 0; try <= retries; try++ {
		trajs, err := rollout.Agent{Env: env, Policy: rollout.LedgerTeacher{}, Settings: rollout.DefaultSettings(reg), Limits: fixedEnvLimits()}.
			Run(ctx, envAttempts(reg, tasks, 1, int32(try)))
		if err == nil {
			return trajs, try
		}
		if !errors.Is(err, envsvc.ErrInfrastructure) {
			t.Fatalf("run %d: not an infrastructure failure: %v", try, err)
		}
		t.Logf("run %d failed (infrastructure, retried): %v", try, err)
	}
	t.Fatalf("every run failed")
	return nil, 0
}

// checkLedger: every trajectory validates (the validator replays the
// journal: a transfer executed twice is an error), with exactly one
// transfer.
func checkLedger(t *testing.T, reg *rollout.Registry, trajs []schemas.Trajectory, want int) {
	t.Helper()
	if len(trajs) != want {
		t.Fatalf("%d trajectories, want %d (lost episodes)", len(trajs), want)
	}
	v := rollout.NewValidator(reg)
	for i := range trajs {
		task, _ := reg.Lookup(trajs[i].TaskID)
		ok, ev, err := v.Validate(task, &trajs[i])
		if err != nil || !ok {
			t.Fatalf("%s: %v %s %v", trajs[i].TaskID, ok, ev, err)
		}
		var art rollout.LedgerArtifacts
		if err := json.Unmarshal([]byte(trajs[i].Artifacts), &art); err != nil || len(art.Transfers) != 1 {
			t.Fatalf("%s: journal %s", trajs[i].TaskID, trajs[i].Artifacts)
		}
	}
}

// TestServeEnvKilledMidEpisode: the service is killed with SIGKILL while
// ledger transfers are in flight and restarted on its data directory.
// Restarted within the lease, the episodes resume: the client asks the
// status of every action it got no answer for, and no transfer runs twice.
// Restarted after the leases ran out, the episodes end as infrastructure
// failures and the attempts are retried with new attempt numbers; again no
// transfer runs twice and no episode is lost.
func TestServeEnvKilledMidEpisode(t *testing.T) {
	reg, _ := rollout.NewFamilyRegistry(rollout.FamilyLedger)
	bin := trajflowBin(t)
	for _, tc := range []struct {
		name    string
		down    time.Duration
		lease   time.Duration
		resumed bool
	}{
		{"restart within the lease", 300 * time.Millisecond, 10 * time.Second, true},
		{"restart after the lease", 2500 * time.Millisecond, time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			data, port := t.TempDir(), freePort(t)
			var mu sync.Mutex
			p := startEnvProcess(t, bin, port, data)
			key, err := envsvc.ReadKeyFile(filepath.Join(data, "capability.key"))
			if err != nil {
				t.Fatal(err)
			}
			c, err := envsvc.New([]string{p.url}, key, envsvc.Options{ToolRetries: 12, Backoff: 20 * time.Millisecond, MaxBackoff: 400 * time.Millisecond,
				ToolTimeout: 2 * time.Second, Lease: tc.lease, Concurrency: 8})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			restarted := make(chan struct{})
			env := &killingEnv{Environment: c, at: 20, hook: func() {
				mu.Lock()
				p.kill()
				mu.Unlock()
				go func() {
					defer close(restarted)
					time.Sleep(tc.down)
					mu.Lock()
					p = startEnvProcess(t, bin, port, data)
					mu.Unlock()
				}()
			}}
			tasks := reg.Train()[:48]
			trajs, failed := runLedger(t, ctx, env, reg, tasks, 3)
			<-restarted
			checkLedger(t, reg, trajs, len(tasks))
			cnt := c.Counters()
			t.Logf("failed runs %d; client %s", failed, cnt)
			if cnt.StatusQueries == 0 || cnt.TotalRetries() == 0 {
				t.Fatalf("no status query or retry across a kill: %s", cnt)
			}
			if tc.resumed && (failed != 0 || cnt.EpisodesLost != 0) {
				t.Fatalf("restart within the lease: %d failed runs, %d lost episodes", failed, cnt.EpisodesLost)
			}
			if !tc.resumed && failed == 0 {
				t.Fatal("restart after the lease: no run failed")
			}
		})
	}
}

// twoEnvProcesses starts two `trajflow serve env` processes sharing one
// capability key and returns their addresses and the key file.
func twoEnvProcesses(t *testing.T) ([]*envProcess, string) {
	t.Helper()
	bin := trajflowBin(t)
	d1 := t.TempDir()
	a := startEnvProcess(t, bin, 0, d1)
	key := filepath.Join(d1, "capability.key")
	b := startEnvProcess(t, bin, 0, t.TempDir(), "--key-file", key)
	return []*envProcess{a, b}, key
}

// servedActions asks a service's metrics how many actions of family it
// executed.
func servedActions(t *testing.T, url, family string) float64 {
	t.Helper()
	resp, err := http.Get(url + envsvc.PathMetrics)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	re := regexp.MustCompile(`(?m)^trajflow_env_actions_executed_total\{family="` + family + `"\} (\S+)$`)
	m := re.FindSubmatch(b)
	if m == nil {
		return 0
	}
	var v float64
	fmt.Sscan(string(m[1]), &v)
	return v
}

// TestDemoEnv: `trajflow demo --env URL,URL` against two `trajflow serve
// env` processes gives the batches of the in-process demo of the same
// seed, byte for byte, and the same hidden-eval success; both services
// ran episodes (least-loaded routing) and the client retried nothing.
func TestDemoEnv(t *testing.T) {
	want := testkit.Demo(t, loop.Options{Updates: 4, Seed: 1})
	procs, key := twoEnvProcesses(t)
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	args := []string{"demo", "--updates", "4", "--seed", "1", "--eval-samples", "1", "--out", out,
		"--env", procs[0].url + "," + procs[1].url, "--env-key-file", key}
	if code := run(ctx, args, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s\n%s", code, stderr.String(), stdout.String())
	}
	b, err := os.ReadFile(filepath.Join(out, "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	var got loop.Summary
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s", lastLines(stdout.String(), 2))
	if !reflect.DeepEqual(got.BatchHashes, want.BatchHashes) || len(got.BatchHashes) == 0 {
		t.Fatalf("batches through serve env differ from the in-process demo:\n%v\n%v", got.BatchHashes, want.BatchHashes)
	}
	if got.EvalSuccessFinal != want.EvalSuccessFinal || got.Lost != 0 || got.DuplicatesAdmitted != 0 {
		t.Fatalf("eval %v vs %v in process; lost %d, duplicates %d", got.EvalSuccessFinal, want.EvalSuccessFinal, got.Lost, got.DuplicatesAdmitted)
	}
	if got.Env == nil || got.Env.Client.EpisodesAllocated != int64(got.AttemptsLaunched) || got.Env.Client.TotalRetries() != 0 || got.Env.Retries != 0 {
		t.Fatalf("environment accounting %+v", got.Env)
	}
	a, bb := servedActions(t, procs[0].url, "kv"), servedActions(t, procs[1].url, "kv")
	if a == 0 || bb == 0 {
		t.Fatalf("actions executed: %v and %v (one service got nothing)", a, bb)
	}
	t.Logf("actions executed by the two services: %v, %v", a, bb)
}

// TestFleetEnv: the fleet of `trajflow run` processes with `trajflow run
// rollout --env URL,URL` gives the batches of the in-process demo.
func TestFleetEnv(t *testing.T) {
	procs, key := twoEnvProcesses(t)
	fleet(t, 3, 0, "", "--env", procs[0].url+","+procs[1].url, "--env-key-file", key)
	if a, b := servedActions(t, procs[0].url, "kv"), servedActions(t, procs[1].url, "kv"); a == 0 || b == 0 {
		t.Fatalf("actions executed: %v and %v (one service got nothing)", a, b)
	}
}

// TestServeEnvDefaultLeaseFollowsMaxLease: --max-lease alone shorter than
// the default --lease shortens it (a service started with --max-lease 1s
// works); a --lease given longer than --max-lease is refused.
func TestServeEnvDefaultLeaseFollowsMaxLease(t *testing.T) {
	lease := 10 * time.Second
	if err := checkServeEnvFlags(1, 1, time.Second, &lease, time.Second, false); err != nil || lease != time.Second {
		t.Fatalf("default --lease with --max-lease 1s: %v, lease %v, want no error and 1s", err, lease)
	}
	lease = 10 * time.Second
	if err := checkServeEnvFlags(1, 1, time.Second, &lease, time.Second, true); err == nil {
		t.Fatal("--lease 10s --max-lease 1s accepted")
	}
}
