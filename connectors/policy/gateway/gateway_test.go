package gateway_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/gateway"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/sglang"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// rep is one SGLang replica of the built-in policy with a fault injector
// and a log of the request ids it served.
type rep struct {
	name  string
	srv   *policytest.Server
	fault *policytest.Fault
	mu    sync.Mutex
	rids  []string
	calls atomic.Int64
}

func (r *rep) served() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.rids...)
}

type fixture struct {
	reg  *rollout.Registry
	dir  string
	reps []*rep
	rels map[int64]*model.Policy
}

// newFixture starts n replicas serving version 1 (releases 1 and 2 exist).
func newFixture(t *testing.T, n int) *fixture {
	f := &fixture{reg: policytest.Registry(t), dir: t.TempDir(), rels: map[int64]*model.Policy{}}
	for _, v := range []int64{1, 2} {
		f.rels[v] = policytest.Load(t, policytest.Release(t, f.dir, v, false))
	}
	for i := 0; i < n; i++ {
		r := &rep{name: string(rune('a' + i)), fault: &policytest.Fault{Prefix: "/generate"}}
		r.srv = policytest.Start(t, policy.SGLang, f.dir, f.reg, func(h http.Handler) http.Handler {
			r.fault.Next = http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
				if q.URL.Path == "/generate" {
					b, _ := io.ReadAll(q.Body)
					q.Body = io.NopCloser(bytes.NewReader(b))
					var body struct {
						Rid string `json:"rid"`
					}
					json.Unmarshal(b, &body)
					r.mu.Lock()
					r.rids = append(r.rids, body.Rid)
					r.mu.Unlock()
					r.calls.Add(1)
				}
				h.ServeHTTP(w, q)
			})
			return r.fault
		}, 1)
		f.reps = append(f.reps, r)
	}
	return f
}

func (f *fixture) gateway(t *testing.T, mod func(*gateway.Config)) *gateway.Gateway {
	t.Helper()
	cfg := gateway.Config{HealthInterval: -1, BreakerFailures: 2, BreakerCooldown: time.Hour}
	for _, r := range f.reps {
		c, err := sglang.New(sglang.Config{ClientConfig: policy.ClientConfig{Addr: r.srv.URL, Timeout: 5 * time.Second}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		cfg.Replicas = append(cfg.Replicas, gateway.Replica{Name: r.name, Client: c})
	}
	if mod != nil {
		mod(&cfg)
	}
	g, err := gateway.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	return g
}

// check compares samples with the in-process policy of each sample's
// version.
func (f *fixture) check(t *testing.T, reqs []model.Request, got []model.Sample, version int64) {
	t.Helper()
	want, err := f.rels[version].Generate(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i := range reqs {
		if !policytest.Equal(got[i], want[i]) {
			t.Fatalf("request %d: through the gateway %+v, in process %+v", i, got[i], want[i])
		}
	}
}

func TestAffinityAndSpread(t *testing.T) {
	f := newFixture(t, 3)
	g := f.gateway(t, nil)
	reqs := policytest.Requests(f.reg, 60, 1, policytest.RequestOptions{}) // affinities group-0..group-4
	for round := 0; round < 3; round++ {
		got, err := g.Generate(context.Background(), reqs)
		if err != nil {
			t.Fatal(err)
		}
		f.check(t, reqs, got, 1)
	}
	where := map[string]string{} // request id -> replica
	for _, r := range f.reps {
		for _, rid := range r.served() {
			if prev, ok := where[rid]; ok && prev != r.name {
				t.Fatalf("request %s served by %s and %s", rid, prev, r.name)
			}
			where[rid] = r.name
		}
	}
	byGroup := map[string]string{}
	for _, q := range reqs {
		rep := where[q.ID]
		if prev, ok := byGroup[q.Affinity]; ok && prev != rep {
			t.Fatalf("group %s on %s and %s", q.Affinity, prev, rep)
		}
		byGroup[q.Affinity] = rep
	}
	used := map[string]bool{}
	for _, r := range byGroup {
		used[r] = true
	}
	if len(used) < 2 {
		t.Fatalf("5 groups on %d replica(s): least-outstanding did not spread new groups", len(used))
	}
	// Without affinity, a batch spreads evenly.
	for i := range reqs {
		reqs[i].Affinity = ""
	}
	before := []int64{f.reps[0].calls.Load(), f.reps[1].calls.Load(), f.reps[2].calls.Load()}
	if _, err := g.Generate(context.Background(), reqs); err != nil {
		t.Fatal(err)
	}
	for i, r := range f.reps {
		if n := r.calls.Load() - before[i]; n != 20 {
			t.Fatalf("replica %s got %d of 60 requests without affinity, want 20", r.name, n)
		}
	}
}

// TestLeastOutstanding: while one replica holds slow requests, new ones go
// to the others.
func TestLeastOutstanding(t *testing.T) {
	f := newFixture(t, 3)
	g := f.gateway(t, nil)
	slow := f.reps[0]
	slow.fault.Set(policytest.FaultSlow, 700*time.Millisecond, nil)
	held := policytest.Requests(f.reg, 3, 2, policytest.RequestOptions{})
	for i := range held {
		held[i].Affinity = "slow-group"
	}
	// Pin the group to the slow replica first.
	done := make(chan error, 1)
	go func() { _, err := g.Generate(context.Background(), held); done <- err }()
	deadline := time.Now().Add(5 * time.Second)
	for g.States()[0].Outstanding+g.States()[1].Outstanding+g.States()[2].Outstanding < 3 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	st := g.States()
	busy := -1
	for i, s := range st {
		if s.Outstanding == 3 {
			busy = i
		}
	}
	if busy < 0 {
		t.Fatalf("the 3 requests of one group are not on one replica: %+v", st)
	}
	if busy != 0 {
		t.Fatalf("the group went to replica %d, not to the slow one", busy)
	}
	for slow.fault.Hits.Load() < 3 && time.Now().Before(deadline) { // all 3 arrived (counted before the delay)
		time.Sleep(5 * time.Millisecond)
	}
	before := slow.fault.Hits.Load()
	reqs := policytest.Requests(f.reg, 10, 3, policytest.RequestOptions{})
	for i := range reqs {
		reqs[i].Affinity = ""
	}
	got, err := g.Generate(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	f.check(t, reqs, got, 1)
	if n := slow.fault.Hits.Load() - before; n > 2 {
		t.Fatalf("the replica with 3 outstanding got %d of 10 new requests", n)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestRetriesAndBreaker(t *testing.T) {
	f := newFixture(t, 3)
	now := time.Unix(1000, 0)
	var clock sync.Mutex
	g := f.gateway(t, func(c *gateway.Config) {
		c.Now = func() time.Time { clock.Lock(); defer clock.Unlock(); return now }
		c.BreakerCooldown = time.Minute
	})
	bad := f.reps[0]
	bad.fault.Set(policytest.FaultStatus, 0, nil)
	reqs := policytest.Requests(f.reg, 30, 4, policytest.RequestOptions{})
	got, err := g.Generate(context.Background(), reqs)
	if err != nil {
		t.Fatalf("a failing replica failed the batch: %v", err)
	}
	f.check(t, reqs, got, 1)
	st := g.States()[0]
	if st.Breaker != gateway.BreakerOpen {
		t.Fatalf("breaker of the failing replica: %+v", st)
	}
	if n := requests(t, g, "a", "server_error"); n == 0 {
		t.Fatal("no server_error counted for the failing replica")
	}
	// Open: no requests reach it.
	hits := bad.fault.Hits.Load()
	if _, err := g.Generate(context.Background(), reqs); err != nil {
		t.Fatal(err)
	}
	if bad.fault.Hits.Load() != hits {
		t.Fatal("an open breaker's replica got requests")
	}
	// Half-open after the cooldown: one probe; it fails, the breaker opens again.
	clock.Lock()
	now = now.Add(2 * time.Minute)
	clock.Unlock()
	if _, err := g.Generate(context.Background(), reqs); err != nil {
		t.Fatal(err)
	}
	if d := bad.fault.Hits.Load() - hits; d != 1 {
		t.Fatalf("half-open breaker let %d requests through, want 1 probe", d)
	}
	if g.States()[0].Breaker != gateway.BreakerOpen {
		t.Fatal("a failed probe did not open the breaker again")
	}
	// The replica recovers: the next probe closes the breaker.
	bad.fault.Set(policytest.FaultNone, 0, nil)
	clock.Lock()
	now = now.Add(2 * time.Minute)
	clock.Unlock()
	calls := bad.calls.Load()
	if _, err := g.Generate(context.Background(), reqs[:1]); err != nil {
		t.Fatal(err)
	}
	if g.States()[0].Breaker != gateway.BreakerClosed {
		t.Fatalf("a successful probe did not close the breaker: %+v %d", g.States()[0], bad.calls.Load()-calls)
	}
	before := bad.calls.Load()
	if _, err := g.Generate(context.Background(), reqs); err != nil {
		t.Fatal(err)
	}
	if bad.calls.Load() == before {
		t.Fatal("the recovered replica gets no requests")
	}
}

// TestReplicaKilled: a replica whose listener closes mid-batch fails its
// requests as unreachable; they complete on the others.
func TestReplicaKilled(t *testing.T) {
	f := newFixture(t, 3)
	g := f.gateway(t, nil)
	victim := f.reps[1]
	victim.fault.Set(policytest.FaultSlow, 400*time.Millisecond, nil)
	reqs := policytest.Requests(f.reg, 45, 5, policytest.RequestOptions{})
	go func() {
		time.Sleep(100 * time.Millisecond)
		victim.srv.HTTP.Listener.Close()
		victim.srv.HTTP.CloseClientConnections()
	}()
	got, err := g.Generate(context.Background(), reqs)
	if err != nil {
		t.Fatalf("the batch failed with a replica gone: %v", err)
	}
	f.check(t, reqs, got, 1)
	if n := requests(t, g, "b", "unreachable"); n == 0 {
		t.Fatal("no unreachable outcome counted for the killed replica")
	}
}

func TestVersionFilter(t *testing.T) {
	f := newFixture(t, 3)
	for _, r := range f.reps[1:] {
		if err := r.srv.Load(2); err != nil {
			t.Fatal(err)
		}
	}
	g := f.gateway(t, nil)
	reqs := policytest.Requests(f.reg, 20, 6, policytest.RequestOptions{})
	// No replica acknowledged a version: none serves a wanted one.
	g.SetWant(policy.Want{Version: 2})
	_, err := g.Generate(context.Background(), reqs)
	if ie, ok := policy.AsInfra(err); !ok || ie.Reason != policy.ReasonNoReplica {
		t.Fatalf("no acknowledged replica: %v", err)
	}
	g.SetReady("a", 1)
	g.SetReady("b", 2)
	g.SetReady("c", 2)
	got, err := g.Generate(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	f.check(t, reqs, got, 2)
	if len(f.reps[0].served()) != 0 {
		t.Fatal("the version-1 replica served a version-2 request")
	}
	g.SetWant(policy.Want{Version: 1})
	got, err = g.Generate(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	f.check(t, reqs, got, 1)
	// A request in flight finishes on its replica and version though the
	// replica moves on meanwhile.
	g.SetWant(policy.Want{Version: 1, AtLeast: true})
	f.reps[0].fault.Set(policytest.FaultLate, 300*time.Millisecond, nil)
	for _, r := range f.reps[1:] {
		r.fault.Set(policytest.FaultStatus, 0, nil) // only a can answer
	}
	g2 := f.gateway(t, func(c *gateway.Config) { c.MaxRetries = -1 })
	g2.SetReady("a", 1)
	g2.SetWant(policy.Want{Version: 1})
	res := make(chan []model.Sample, 1)
	go func() {
		s, err := g2.Generate(context.Background(), reqs[:1])
		if err != nil {
			t.Error(err)
		}
		res <- s
	}()
	time.Sleep(100 * time.Millisecond)
	if err := f.reps[0].srv.Load(2); err != nil {
		t.Fatal(err)
	}
	g2.SetReady("a", 2)
	s := <-res
	if len(s) != 1 || s[0].PolicyVersion != 1 {
		t.Fatalf("the request in flight: %+v", s)
	}
	f.check(t, reqs[:1], s, 1)
}

// TestAllDown: with every replica failing, the error is an InfraError,
// never a task failure.
func TestAllDown(t *testing.T) {
	f := newFixture(t, 2)
	g := f.gateway(t, nil)
	for _, r := range f.reps {
		r.fault.Set(policytest.FaultStatus, 0, nil)
	}
	_, err := g.Generate(context.Background(), policytest.Requests(f.reg, 4, 7, policytest.RequestOptions{}))
	if !policy.IsInfra(err) {
		t.Fatalf("err %v", err)
	}
}

func TestHealthChecks(t *testing.T) {
	f := newFixture(t, 2)
	g := f.gateway(t, func(c *gateway.Config) { c.HealthInterval = 20 * time.Millisecond })
	f.reps[0].srv.HTTP.Close()
	g.Start()
	deadline := time.Now().Add(5 * time.Second)
	for g.States()[0].Healthy && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if g.States()[0].Healthy {
		t.Fatal("a closed replica stays healthy")
	}
	hits := f.reps[0].calls.Load()
	if _, err := g.Generate(context.Background(), policytest.Requests(f.reg, 10, 8, policytest.RequestOptions{})); err != nil {
		t.Fatal(err)
	}
	if f.reps[0].calls.Load() != hits {
		t.Fatal("an unhealthy replica got requests")
	}
	g.Close()
}

func TestMetricNames(t *testing.T) {
	f := newFixture(t, 2)
	g := f.gateway(t, nil)
	if _, err := g.Generate(context.Background(), policytest.Requests(f.reg, 4, 9, policytest.RequestOptions{})); err != nil {
		t.Fatal(err)
	}
	problems, err := testutil.GatherAndLint(g.Registry())
	if err != nil || len(problems) != 0 {
		t.Fatalf("metric lint: %v %+v", err, problems)
	}
	mfs, _ := g.Registry().Gather()
	var names []string
	for _, mf := range mfs {
		names = append(names, mf.GetName())
	}
	for _, want := range []string{"trajflow_policy_requests_total", "trajflow_policy_request_duration_seconds",
		"trajflow_policy_outstanding_requests", "trajflow_policy_breaker_state"} {
		if !strings.Contains(strings.Join(names, " "), want) {
			t.Fatalf("metric %s missing from %v", want, names)
		}
	}
}

// requests is trajflow_policy_requests_total{replica,outcome}.
func requests(t *testing.T, g *gateway.Gateway, replica, outcome string) float64 {
	t.Helper()
	mfs, err := g.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "trajflow_policy_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			if l["replica"] == replica && l["outcome"] == outcome {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}
