package envsvc

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators/rollout"
)

// fault is what the proxy does to one request.
type fault string

const (
	pass      fault = ""
	dropReply fault = "drop_reply"  // forwarded and executed; the connection closes before the answer
	resetConn fault = "reset"       // the connection closes before the request is forwarded
	slowReply fault = "slow_reply"  // forwarded; the answer comes after the client's timeout
	badProxy  fault = "bad_gateway" // a 502 page, not forwarded
	duplicate fault = "duplicate"   // forwarded twice; the second answer is returned
)

// proxy sits between the client and the service and injects faults.
type proxy struct {
	t      testing.TB
	target string
	delay  time.Duration
	plan   func(n int, path string) fault // n counts requests on path kinds the plan sees

	mu       sync.Mutex
	n        int
	injected map[fault]int
	byPath   map[string]map[fault]int
	hs       *httptest.Server
	fwd      *http.Client
}

func newProxy(t testing.TB, target string, delay time.Duration, plan func(n int, path string) fault) *proxy {
	p := &proxy{t: t, target: target, delay: delay, plan: plan, injected: map[fault]int{}, byPath: map[string]map[fault]int{},
		fwd: &http.Client{Timeout: 30 * time.Second}}
	p.hs = httptest.NewServer(http.HandlerFunc(p.serve))
	t.Cleanup(p.hs.Close)
	return p
}

func kind(path string) string {
	switch {
	case path == PathEpisodes:
		return "allocate"
	case strings.HasSuffix(path, "/step"):
		return "step"
	case strings.HasSuffix(path, "/status"):
		return "status"
	case strings.HasSuffix(path, "/renew"):
		return "renew"
	case strings.HasSuffix(path, "/terminate"):
		return "terminate"
	}
	return path
}

func (p *proxy) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	k := kind(r.URL.Path)
	p.mu.Lock()
	f := pass
	if p.plan != nil && k != "renew" {
		f = p.plan(p.n, k)
		p.n++
	}
	if f != pass {
		p.injected[f]++
		if p.byPath[k] == nil {
			p.byPath[k] = map[fault]int{}
		}
		p.byPath[k][f]++
	}
	p.mu.Unlock()
	forward := func() (int, []byte) {
		resp, err := p.fwd.Post(p.target+r.URL.Path, "application/json", bytes.NewReader(body))
		if err != nil {
			return http.StatusBadGateway, []byte(err.Error())
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	hangUp := func() {
		conn, _, err := w.(http.Hijacker).Hijack()
		if err != nil {
			p.t.Errorf("hijack: %v", err)
			return
		}
		conn.Close()
	}
	switch f {
	case resetConn:
		hangUp()
		return
	case badProxy:
		http.Error(w, "<html>502 Bad Gateway</html>", http.StatusBadGateway)
		return
	case dropReply:
		forward()
		hangUp()
		return
	case duplicate:
		forward()
	case slowReply:
		code, b := forward()
		time.Sleep(p.delay)
		w.WriteHeader(code)
		w.Write(b)
		return
	}
	code, b := forward()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	w.Write(b)
}

func (p *proxy) count() (map[fault]int, map[string]map[fault]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	a := map[fault]int{}
	for k, v := range p.injected {
		a[k] = v
	}
	b := map[string]map[fault]int{}
	for k, m := range p.byPath {
		b[k] = map[fault]int{}
		for f, v := range m {
			b[k][f] = v
		}
	}
	return a, b
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
	c := newClient(t, []string{px.hs.URL}, Options{ToolRetries: 2, Backoff: time.Millisecond})
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
	c := newClient(t, []string{px.hs.URL}, Options{ToolRetries: 8, Backoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
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
	injected, byPath := px.count()
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
