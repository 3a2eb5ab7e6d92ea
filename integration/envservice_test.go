package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/envsvc"
	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/internal/dashboard"
	"github.com/trajflow/trajflow/internal/envfault"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// The run-level fault tests of the environment end: the RL loop
// (internal/loop, the demo's) on the ledger family, its rollout stage
// talking to `trajflow serve env` processes through the fault proxy
// (internal/envfault). Every ledger episode makes a transfer that must
// happen at most once: the reward is the ledger's trusted validator, which
// refuses to judge a journal holding one turn's transfer twice, so a
// duplicated action would land in quarantine; the services' own logs
// (envsvc.AuditDir) count the actions they executed and any turn executed
// twice.

// envProc is one `trajflow serve env` process on a fixed port, so that it
// can be killed and started again on its data directory.
type envProc struct {
	t     testing.TB
	port  int
	data  string
	extra []string

	mu     sync.Mutex
	cmd    *exec.Cmd
	stderr *strings.Builder
	starts int
}

var envListenRE = regexp.MustCompile(`listening on (http://[0-9.:]+), data .*, (\d+) live episodes resumed`)

func newEnvProc(t *testing.T, data string, extra ...string) *envProc {
	t.Helper()
	p := &envProc{t: t, port: portBelowEphemeral(t), data: data, extra: extra}
	if err := p.start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.kill)
	return p
}

func (p *envProc) url() string { return fmt.Sprintf("http://127.0.0.1:%d", p.port) }

func (p *envProc) keyFile() string { return filepath.Join(p.data, "capability.key") }

// start starts the process and waits until it listens.
func (p *envProc) start() error {
	args := append([]string{"serve", "env", "--port", fmt.Sprint(p.port), "--data", p.data, "--log-level", "warn"}, p.extra...)
	cmd := exec.Command(binPath, args...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	var stderr strings.Builder
	cmd.Stderr = &lockedWriter{w: &stderr}
	if err := cmd.Start(); err != nil {
		return err
	}
	line := make(chan []string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := envListenRE.FindStringSubmatch(sc.Text()); m != nil {
				line <- m
			}
		}
		io.Copy(io.Discard, stdout)
	}()
	select {
	case m := <-line:
		p.t.Logf("serve env %s started (%s live episodes resumed)", m[1], m[2])
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		cmd.Wait()
		return fmt.Errorf("serve env on port %d did not start: %s", p.port, stderr.String())
	}
	p.mu.Lock()
	p.cmd, p.stderr = cmd, &stderr
	p.starts++
	p.mu.Unlock()
	return nil
}

// kill sends SIGKILL and waits for the process.
func (p *envProc) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil && p.cmd.ProcessState == nil {
		p.cmd.Process.Signal(syscall.SIGKILL)
		p.cmd.Wait()
	}
}

// stop stops the process gracefully.
func (p *envProc) stop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil && p.cmd.ProcessState == nil {
		p.cmd.Process.Signal(syscall.SIGTERM)
		p.cmd.Wait()
	}
}

type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// ledgerRun runs the loop on the ledger family against the services at
// urls, with a tool timeout of 2 s and 8 retries per call and per group.
func ledgerRun(t *testing.T, updates int, urls []string, keyFile string) (*loop.Summary, string) {
	t.Helper()
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	s, err := loop.Run(ctx, loop.Options{Updates: updates, Seed: 1, Out: out, EvalSamples: 1, Quiet: true,
		Environment: rollout.ArtifactLedger, Env: urls, EnvKeyFile: keyFile, ToolRetries: 8, ToolTimeoutMS: 2000}, io.Discard)
	if err != nil {
		t.Fatalf("loop: %v", err)
	}
	return s, out
}

// runTurns reads the run's trajectories from its snapshot: the turns
// they hold (one executed action each), and every trajectory whose
// journal holds a transfer twice for one turn.
func runTurns(t *testing.T, out, runID string) (turns, trajectories int, doubled []string) {
	t.Helper()
	snap, err := parquet.ReadRun(t.Context(), parquet.RunDir(out, runID), []string{"trajectories"}, parquet.ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, m := range snap.Topics["trajectories"] {
		rows, err := schemas.Trajectories.Decode(nil, m.Value)
		if err != nil {
			t.Fatal(err)
		}
		for _, tr := range rows {
			if seen[tr.RecordID] {
				continue
			}
			seen[tr.RecordID] = true
			turns += len(tr.Turns)
			var art rollout.LedgerArtifacts
			if err := json.Unmarshal([]byte(tr.Artifacts), &art); err != nil {
				t.Fatalf("%s: artifacts %v", tr.RecordID, err)
			}
			byTurn := map[int32]int{}
			for _, x := range art.Transfers {
				if byTurn[x.Turn]++; byTurn[x.Turn] > 1 {
					doubled = append(doubled, tr.RecordID)
				}
			}
		}
	}
	return turns, len(seen), doubled
}

// checkEnvRun checks what every run must show: every attempt launched is
// admitted or filtered (lost 0, duplicated 0, quarantined 0: no duplicate
// execution reached the validator), no journal holds a transfer twice, no
// service executed a turn twice, and the census holds one retried event
// per retry of the client.
func checkEnvRun(t *testing.T, s *loop.Summary, out string, updates int, procs ...*envProc) (audits []envsvc.LogAudit, turns int) {
	t.Helper()
	if s.AttemptsLaunched != updates*256 || s.Lost != 0 || s.DuplicatesAdmitted != 0 || s.Quarantined != 0 ||
		s.TrajectoriesAdmitted+s.TrajectoriesFiltered != s.AttemptsLaunched {
		t.Fatalf("accounting: launched %d admitted %d filtered %d quarantined %d lost %d duplicated %d",
			s.AttemptsLaunched, s.TrajectoriesAdmitted, s.TrajectoriesFiltered, s.Quarantined, s.Lost, s.DuplicatesAdmitted)
	}
	e := s.Env
	if e == nil || int64(e.Retries) != e.Client.TotalRetries() {
		t.Fatalf("census retried events %+v, client %s", e, e.Client)
	}
	for r, n := range e.Client.Retries {
		if int64(e.RetriesByReason[r]) != n {
			t.Fatalf("reason %s: %d census events, %d client retries", r, e.RetriesByReason[r], n)
		}
	}
	checkDashboardRetries(t, out, s.RunID, e.RetriesByReason)
	turns, trajs, doubled := runTurns(t, out, s.RunID)
	if trajs != s.AttemptsLaunched || len(doubled) != 0 {
		t.Fatalf("%d trajectories for %d attempts; journals with a transfer twice: %v", trajs, s.AttemptsLaunched, doubled)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, p := range procs {
		p.stop()
		a, err := envsvc.AuditDir(ctx, p.data)
		if err != nil {
			t.Fatal(err)
		}
		if a.DuplicateTurns != 0 || a.Live != 0 {
			t.Fatalf("service %s: %d actions executed twice for one turn, %d episodes live: %+v", p.url(), a.DuplicateTurns, a.Live, a)
		}
		audits = append(audits, a)
	}
	return audits, turns
}

// checkDashboardRetries serves the dashboard of the run's snapshot and
// checks that its table of failures counts the census's retried events by
// reason, as the run's summary does.
func checkDashboardRetries(t *testing.T, out, run string, want map[string]int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := dashboard.New(ctx, dashboard.Config{Dir: out, Run: run})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d.Handler())
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/api/summary")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sum dashboard.Summary
	if err := json.NewDecoder(resp.Body).Decode(&sum); err != nil {
		t.Fatalf("dashboard summary: %v", err)
	}
	got := map[string]int{}
	for _, f := range sum.Systems.Latency.Failures {
		if f.Kind == schemas.CensusRetried {
			got[f.Reason] += f.Events
		}
	}
	for r, n := range want {
		if got[r] != n {
			t.Errorf("dashboard: %d retried events of reason %s, the summary counts %d (dashboard %v)", got[r], r, n, got)
		}
	}
	if len(got) != len(want) {
		t.Errorf("dashboard retries by reason %v, summary %v", got, want)
	}
}

func accounted(s *loop.Summary) audit.Counts {
	return audit.Counts{Launched: s.AttemptsLaunched, Admitted: s.TrajectoriesAdmitted, Filtered: s.TrajectoriesFiltered,
		Quarantined: s.Quarantined, Lost: s.Lost, Duplicated: s.DuplicatesAdmitted}
}

// TestEnvFaultRun: the loop on the ledger family through a proxy that
// injects a fault into every 29th request of the rollout stage's client:
// answers dropped after the service executed the action (the client asks
// the status and finds it executed), connections reset, answers after the
// tool timeout, 502 pages, double deliveries (answered from the log), and
// beside steps deliveries of its own: the action out of order, a replay
// under another idempotency key, forged, expired and misused tokens (all
// refused). The run completes with nothing lost, duplicated or
// quarantined; the service executed exactly one action per recorded turn;
// every retry is a census event, and the client's retries are exactly the
// faults that left it without an answer.
func TestEnvFaultRun(t *testing.T) {
	start := time.Now()
	svc := newEnvProc(t, t.TempDir())
	faults := append(append([]envfault.Fault(nil), envfault.ClientVisible...), envfault.Side...)
	var pending []envfault.Fault // side deliveries waiting for a step; Plan runs under the proxy's lock
	key, err := envsvc.ReadKeyFile(svc.keyFile())
	if err != nil {
		t.Fatal(err)
	}
	px := envfault.New(envfault.Config{Target: svc.url(), Delay: 2300 * time.Millisecond, Key: key, Run: "demo", StepAction: envsvc.StepAction,
		Plan: func(n int, kind string) envfault.Fault {
			// A side delivery planned for another call than a step waits
			// for the next step, so that every one is injected whatever
			// order the concurrent episodes' calls arrive in.
			if kind == "step" && len(pending) > 0 {
				f := pending[0]
				pending = pending[1:]
				return f
			}
			if n%29 != 11 {
				return envfault.Pass
			}
			f := faults[(n/29)%len(faults)]
			switch {
			case f.IsSide() && kind != "step":
				pending = append(pending, f)
				return envfault.Pass
			case f == envfault.Duplicate && kind != "step":
				return envfault.DropReply
			}
			return f
		}})
	defer px.Close()
	const updates = 2
	s, out := ledgerRun(t, updates, []string{px.URL()}, svc.keyFile())
	injected, byKind := px.Counts()
	audits, turns := checkEnvRun(t, s, out, updates, svc)
	e := s.Env
	t.Logf("%d faults injected %v by call %v; side answers %v", px.Total(), injected, byKind, px.SideAnswers())
	t.Logf("client %s; census %d retried events %v, %d infrastructure failures; service log %+v; %d turns recorded",
		e.Client, e.Retries, e.RetriesByReason, e.InfraFailures, audits[0], turns)
	if px.Total() < 20 {
		t.Fatalf("only %d faults injected", px.Total())
	}
	ambiguous := 0
	for f, n := range injected {
		if f.Ambiguous() {
			ambiguous += n
		}
	}
	if e.Client.TotalRetries() != int64(ambiguous) || e.InfraFailures != 0 || e.Client.EpisodesLost != 0 || e.Client.Exhausted != 0 {
		t.Fatalf("client %s for %d faults without an answer; %d infrastructure failures", e.Client, ambiguous, e.InfraFailures)
	}
	if e.Client.Replayed != int64(byKind["step"][envfault.Duplicate]) {
		t.Fatalf("%d replayed answers for %d double deliveries of a step", e.Client.Replayed, byKind["step"][envfault.Duplicate])
	}
	want := map[envfault.Fault]string{envfault.Gap: "refused/" + envsvc.ReasonSeqGap, envfault.Replay: "refused/" + envsvc.ReasonSeqReplayed,
		envfault.Forged: "refused/" + envsvc.ReasonTokenForged, envfault.Expired: "refused/" + envsvc.ReasonTokenExpired,
		envfault.Misused: "refused/" + envsvc.ReasonTokenScope}
	side := px.SideAnswers()
	for f, answer := range want {
		if injected[f] == 0 || len(side[f]) != 1 || side[f][answer] != injected[f] {
			t.Fatalf("%s: %d injected, answers %v: want all %s", f, injected[f], side[f], answer)
		}
	}
	if audits[0].Actions != turns || audits[0].Episodes != s.AttemptsLaunched {
		t.Fatalf("the service executed %d actions in %d episodes for %d turns of %d attempts (duplicated actions %d)",
			audits[0].Actions, audits[0].Episodes, turns, s.AttemptsLaunched, audits[0].Actions-turns)
	}
	record(t, scenarioResult{Name: fmt.Sprintf("env service faults (%d injected)", px.Total()), Broker: "embedded", Counts: accounted(s), Elapsed: time.Since(start)})
}

// TestEnvServiceKilled: the loop on the ledger family against two
// `trajflow serve env` processes (least-loaded, affinity per episode);
// one is killed with SIGKILL while its episodes are mid-flight and
// started again on its data directory.
//
// Within the lease: the episodes resume where the store left them; the
// client asks the status of every action it got no answer for and goes on
// — no attempt fails. After the leases ran out (a 1 s lease, 2.5 s down):
// the service ends them as infrastructure failures, the rollout stage runs
// their groups again with new attempt numbers. Either way no action is
// executed twice, nothing is lost, and the census accounts for every retry.
func TestEnvServiceKilled(t *testing.T) {
	for _, tc := range []struct {
		name    string
		down    time.Duration
		extra   []string
		kills   []int // at these step requests of the killed service
		resumed bool
	}{
		{"restart within the lease", 300 * time.Millisecond, nil, []int{150, 400}, true},
		{"restart after the lease", 2500 * time.Millisecond, []string{"--max-lease", "1s"}, []int{150, 400}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			a := newEnvProc(t, t.TempDir(), tc.extra...)
			b := newEnvProc(t, t.TempDir(), append([]string{"--key-file", a.keyFile()}, tc.extra...)...)
			var mu sync.Mutex
			var restarts sync.WaitGroup
			var restartErr error
			steps := 0
			kill := func(n int, when string) {
				a.kill()
				t.Logf("serve env %s killed (SIGKILL) %s its step request %d", a.url(), when, n)
				restarts.Add(1)
				go func() {
					defer restarts.Done()
					time.Sleep(tc.down)
					if err := a.start(); err != nil {
						mu.Lock()
						restartErr = err
						mu.Unlock()
					}
				}()
			}
			// The first kill comes before its step request is forwarded
			// (never received: the client sends it again), the second one
			// after the service executed and persisted it, with its answer
			// lost (the client's status query finds it executed).
			pxA := envfault.New(envfault.Config{Target: a.url(),
				Plan: func(_ int, kind string) envfault.Fault {
					if kind != "step" {
						return envfault.Pass
					}
					mu.Lock()
					steps++
					n := steps
					mu.Unlock()
					for i, k := range tc.kills {
						switch {
						case n == k && i == 0:
							kill(n, "before forwarding")
						case n == k:
							return envfault.DropReply
						}
					}
					return envfault.Pass
				},
				Forwarded: func(kind string, f envfault.Fault) {
					if kind == "step" && f == envfault.DropReply {
						mu.Lock()
						n := steps
						mu.Unlock()
						kill(n, "after the service answered")
					}
				}})
			defer pxA.Close()
			const updates = 2
			s, out := ledgerRun(t, updates, []string{pxA.URL(), b.url()}, a.keyFile())
			restarts.Wait()
			if restartErr != nil {
				t.Fatal(restartErr)
			}
			mu.Lock()
			n := steps
			mu.Unlock()
			if n <= tc.kills[len(tc.kills)-1] {
				t.Fatalf("only %d steps on the killed service: the kills at %v did not all happen", n, tc.kills)
			}
			audits, turns := checkEnvRun(t, s, out, updates, a, b)
			e := s.Env
			t.Logf("client %s; census %d retried events %v, %d infrastructure failures; service logs %+v %+v; %d turns recorded",
				e.Client, e.Retries, e.RetriesByReason, e.InfraFailures, audits[0], audits[1], turns)
			if e.Client.StatusQueries == 0 || e.Client.TotalRetries() == 0 {
				t.Fatalf("no status query or retry across a kill: %s", e.Client)
			}
			if executed := audits[0].Actions + audits[1].Actions; executed < turns || audits[0].Actions == 0 || audits[1].Actions == 0 {
				t.Fatalf("%d + %d actions executed for %d turns recorded", audits[0].Actions, audits[1].Actions, turns)
			}
			if tc.resumed && (e.InfraFailures != 0 || e.Client.EpisodesLost != 0 || e.Client.StatusExecuted == 0 || e.Client.StatusUnknown == 0) {
				t.Fatalf("restart within the lease: %d infrastructure failures, %d episodes lost; status queries: %d found the action executed, %d not received",
					e.InfraFailures, e.Client.EpisodesLost, e.Client.StatusExecuted, e.Client.StatusUnknown)
			}
			if !tc.resumed && (e.InfraFailures == 0 || s.AttemptsRetried == 0 || audits[0].Ended["infra/"+envsvc.ReasonLeaseExpired] == 0) {
				t.Fatalf("restart after the lease: %d infrastructure failures, %d attempts retried, ends %v", e.InfraFailures, s.AttemptsRetried, audits[0].Ended)
			}
			t.Logf("%d attempts failed for the infrastructure and were run again", s.AttemptsRetried)
			record(t, scenarioResult{Name: "env service SIGKILL, " + tc.name, Broker: "embedded", Kills: len(tc.kills),
				Counts: accounted(s), Elapsed: time.Since(start)})
		})
	}
}
