package envsvc

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/trajflow/trajflow/internal/envfault"
	"github.com/trajflow/trajflow/operators/rollout"
)

// The faults of the proxy (internal/envfault).
const (
	pass      = envfault.Pass
	dropReply = envfault.DropReply
	resetConn = envfault.ResetConn
	slowReply = envfault.SlowReply
	badProxy  = envfault.BadGateway
	duplicate = envfault.Duplicate
)

type fault = envfault.Fault

// newProxy starts a fault-injecting proxy in front of target until the
// test ends.
func newProxy(t testing.TB, target string, delay time.Duration, plan func(n int, kind string) fault) *envfault.Proxy {
	px := envfault.New(envfault.Config{Target: target, Delay: delay, Plan: plan})
	t.Cleanup(px.Close)
	return px
}

// TestDroppedReplyOfATransfer: the answer to a transfer is lost after the
// service executed it; the client asks its status, finds it executed, and
// the ledger holds exactly one transfer.
func TestDroppedReplyOfATransfer(t *testing.T) {
	ctx := ctxT(t, time.Minute)
	regs := registries(t)
	svc := startService(t, Config{Registries: regs})
	dropped := false
	px := newProxy(t, svc.url, 0, func(n int, k string) fault {
		if k == "step" && !dropped {
			dropped = true
			return dropReply
		}
		return pass
	})
	c := newClient(t, []string{px.URL()}, Options{ToolRetries: 2, Backoff: time.Millisecond})
	reg := family(regs, rollout.FamilyLedger)
	trajs, err := rollout.Agent{Env: c, Policy: rollout.LedgerTeacher{}, Settings: rollout.DefaultSettings(reg), Limits: fixedLimits()}.Run(ctx, attempts(reg.Train()[:1], 1, 0))
	if err != nil {
		t.Fatal(err)
	}
	var art rollout.LedgerArtifacts
	if err := json.Unmarshal([]byte(trajs[0].Artifacts), &art); err != nil || len(art.Transfers) != 1 {
		t.Fatalf("ledger %s", trajs[0].Artifacts)
	}
	task, _ := reg.Lookup(trajs[0].TaskID)
	if ok, ev, err := rollout.NewValidator(reg).Validate(task, &trajs[0]); err != nil || !ok {
		t.Fatalf("%v %s %v", ok, ev, err)
	}
	cnt := c.Counters()
	if cnt.StatusQueries != 1 || cnt.StatusExecuted != 1 || cnt.Retries["connection"] != 1 || cnt.TotalRetries() != 1 {
		t.Fatalf("counters %s", cnt)
	}
	if d := cnt.Sub(Counters{}); d.String() != cnt.String() || cnt.Sub(cnt).TotalRetries() != 0 {
		t.Fatalf("Sub: %s / %s", d, cnt.Sub(cnt))
	}
	if got := value(svc.srv.met.steps.WithLabelValues(rollout.FamilyLedger)); got != 2 {
		t.Fatalf("%v actions executed, want 2 (transfer, answer)", got)
	}
}

// TestFaultRun: ledger episodes (a transfer each) through a proxy that
// drops answers, resets connections, answers late, answers with a
// non-protocol page and delivers twice. No action executes twice, no
// episode is lost, and every retry is counted: the client's retries equal
// the faults that left it without an answer, its replayed answers the
// duplicated deliveries.
func TestFaultRun(t *testing.T) {
	ctx := ctxT(t, 3*time.Minute)
	regs := registries(t)
	svc := startService(t, Config{Registries: regs})
	cycle := []fault{dropReply, resetConn, slowReply, badProxy, duplicate}
	px := newProxy(t, svc.url, 1300*time.Millisecond, func(n int, k string) fault {
		if n%3 != 1 {
			return pass
		}
		f := cycle[(n/3)%len(cycle)]
		if f == duplicate && k != "step" {
			return dropReply
		}
		return f
	})
	c := newClient(t, []string{px.URL()}, Options{ToolRetries: 8, Backoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
		ToolTimeout: time.Second, Concurrency: 8})
	reg := family(regs, rollout.FamilyLedger)
	tasks := reg.Train()[:40]
	trajs, err := rollout.Agent{Env: c, Policy: rollout.LedgerTeacher{}, Settings: rollout.DefaultSettings(reg), Limits: fixedLimits()}.Run(ctx, attempts(tasks, 1, 0))
	if err != nil {
		t.Fatal(err)
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
			t.Fatalf("%s: ledger %s", trajs[i].TaskID, trajs[i].Artifacts)
		}
	}
	injected, byPath := px.Counts()
	total := 0
	for _, n := range injected {
		total += n
	}
	cnt := c.Counters()
	t.Logf("%d episodes, %d faults %v by call %v; client %s", len(trajs), total, injected, byPath, cnt)
	if total < 20 {
		t.Fatalf("only %d faults injected", total)
	}
	executed := value(svc.srv.met.steps.WithLabelValues(rollout.FamilyLedger))
	if lost := len(tasks) - len(trajs); lost != 0 || executed != float64(2*len(tasks)) {
		t.Fatalf("lost %d episodes; %v actions executed for %d episodes of 2 turns (duplicated actions %v)", lost, executed, len(trajs), executed-float64(2*len(tasks)))
	}
	noAnswer := injected[dropReply] + injected[resetConn] + injected[slowReply] + injected[badProxy]
	if got := cnt.TotalRetries(); got != int64(noAnswer) {
		t.Fatalf("client counted %d retries for %d faults without an answer", got, noAnswer)
	}
	if cnt.Replayed != int64(injected[duplicate]) || cnt.Exhausted != 0 || cnt.EpisodesLost != 0 {
		t.Fatalf("replayed %d for %d duplicates, exhausted %d, lost %d", cnt.Replayed, injected[duplicate], cnt.Exhausted, cnt.EpisodesLost)
	}
	if ambiguousSteps := byPath["step"][dropReply] + byPath["step"][resetConn] + byPath["step"][slowReply] + byPath["step"][badProxy]; cnt.StatusQueries < int64(ambiguousSteps) {
		t.Fatalf("%d status queries for %d ambiguous steps", cnt.StatusQueries, ambiguousSteps)
	}
	if n := value(svc.srv.met.allocated.WithLabelValues(rollout.FamilyLedger)); n != float64(len(tasks)) || svc.srv.Live() != 0 {
		t.Fatalf("%v episodes allocated for %d attempts (a lost allocation answer must not allocate twice); %d live", n, len(tasks), svc.srv.Live())
	}
}

// TestSideDeliveriesRefused: beside the client's steps, the proxy sends
// the action out of order (a gap, under a valid token), replays it under
// another idempotency key, and sends it with a forged, an expired and a
// misused token. The service refuses every one with its reason, executes
// nothing for them, and the ledgers hold exactly one transfer each.
func TestSideDeliveriesRefused(t *testing.T) {
	ctx := ctxT(t, time.Minute)
	regs := registries(t)
	svc := startService(t, Config{Registries: regs})
	px := envfault.New(envfault.Config{Target: svc.url, Key: testKey, Run: "run", StepAction: StepAction,
		Plan: func(n int, k string) fault {
			if k != "step" {
				return pass
			}
			return envfault.Side[n%len(envfault.Side)]
		}})
	defer px.Close()
	c := newClient(t, []string{px.URL()}, Options{Concurrency: 4})
	reg := family(regs, rollout.FamilyLedger)
	tasks := reg.Train()[:20]
	trajs, err := rollout.Agent{Env: c, Policy: rollout.LedgerTeacher{}, Settings: rollout.DefaultSettings(reg), Limits: fixedLimits()}.Run(ctx, attempts(tasks, 1, 0))
	if err != nil {
		t.Fatal(err)
	}
	v := rollout.NewValidator(reg)
	for i := range trajs {
		task, _ := reg.Lookup(trajs[i].TaskID)
		var art rollout.LedgerArtifacts
		if ok, ev, err := v.Validate(task, &trajs[i]); err != nil || !ok || json.Unmarshal([]byte(trajs[i].Artifacts), &art) != nil || len(art.Transfers) != 1 {
			t.Fatalf("%s: %v %s %v: %s", trajs[i].TaskID, ok, ev, err, trajs[i].Artifacts)
		}
	}
	want := map[fault]string{envfault.Gap: "refused/" + ReasonSeqGap, envfault.Replay: "refused/" + ReasonSeqReplayed,
		envfault.Forged: "refused/" + ReasonTokenForged, envfault.Expired: "refused/" + ReasonTokenExpired, envfault.Misused: "refused/" + ReasonTokenScope}
	side := px.SideAnswers()
	injected, _ := px.Counts()
	t.Logf("side deliveries %v, answers %v", injected, side)
	for f, answer := range want {
		if injected[f] < 4 || len(side[f]) != 1 || side[f][answer] != injected[f] {
			t.Fatalf("%s: %d injected, answers %v, want all %s", f, injected[f], side[f], answer)
		}
	}
	if got := value(svc.srv.met.steps.WithLabelValues(rollout.FamilyLedger)); got != float64(2*len(tasks)) {
		t.Fatalf("%v actions executed for %d episodes of 2 turns", got, len(tasks))
	}
	if cnt := c.Counters(); cnt.TotalRetries() != 0 || len(cnt.Refused) != 0 {
		t.Fatalf("the client saw the side deliveries: %s", cnt)
	}
}
