// Package gateway spreads generation over several policy server replicas
// (docs/SYSTEMS.md §3 "inference gateway / load balancer"): a rollout.Policy whose
// requests go to the replica with the fewest requests outstanding, with
// group affinity, health checks, a circuit breaker per replica, bounded
// retries of infrastructure failures on other replicas, a version filter
// fed by weight sync, and Prometheus metrics per replica.
//
// Routing. A request goes to an eligible replica: healthy (its last health
// check passed, or none ran yet), its breaker closed (or half-open with no
// probe out), and serving a wanted version (SetWant; with a wanted
// version, only replicas that acknowledged a version meeting it through
// SetReady). Among them, a request with an Affinity (the group id) goes to
// the replica its affinity went to last, while that one stays eligible, so
// that a group's shared prompt prefix meets its cache; otherwise, and for
// requests without affinity, to the replica with the fewest requests
// outstanding (ties to the one least recently chosen). The requests of one
// Generate assigned to a replica are sent to it as one GenerateEach.
//
// Timeouts. Each request sent to a replica is bounded by that replica
// client's per-request timeout (policy.ClientConfig.Timeout); one that
// passes it is a timeout InfraError, retried like any other.
//
// Failures. A request that fails with an *policy.InfraError is sent again,
// at most MaxRetries times, each time to a replica it has not failed on;
// when none is left, its last InfraError is its result. Infrastructure
// failures therefore stay InfraErrors: the caller retries them, and never
// counts them as task failures. Other errors (settings the servers cannot
// honor, the caller's context ending) are not retried.
//
// Breaker. BreakerFailures consecutive infrastructure failures of a
// replica (version mismatches excepted: they say which version a replica
// serves, not whether it works) open its breaker: it gets no requests for
// BreakerCooldown, then one probe request (half-open); the probe's success
// closes the breaker, its failure opens it again.
//
// Versions. SetReady(replica, v) records that weight sync loaded version v
// into a replica and verified it. Requests already sent finish on their
// replica whatever happens to its version; each sample carries the
// version its replica reports serving it.
package gateway

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// Replica is one policy server.
type Replica struct {
	// Name labels the replica in SetReady and metrics ("" = its address).
	Name   string
	Client policy.Client
}

// Config configures a Gateway.
type Config struct {
	Replicas []Replica
	// MaxRetries bounds how often one request is sent again after an
	// infrastructure failure, each time to another replica (0: 2; < 0: 0).
	MaxRetries int
	// HealthInterval is the period of health checks (0: 2 s; < 0: none).
	HealthInterval time.Duration
	// HealthTimeout bounds one health check (0: 1 s).
	HealthTimeout time.Duration
	// BreakerFailures consecutive failures open a replica's breaker (0: 3).
	BreakerFailures int
	// BreakerCooldown is how long an open breaker keeps its replica out
	// before a probe (0: 5 s).
	BreakerCooldown time.Duration
	// Want is the initial version requirement (SetWant changes it).
	Want policy.Want
	// Registerer receives the metrics (nil: a registry of the gateway's
	// own, Gateway.Registry).
	Registerer prometheus.Registerer
	// Now is the clock of the breaker (nil: time.Now).
	Now func() time.Time
	// AffinityEntries bounds the affinity table (0: 65536); when full it
	// is cleared and affinities are learned again.
	AffinityEntries int
}

// Breaker states (the trajflow_policy_breaker_state gauge).
const (
	BreakerClosed   = 0
	BreakerHalfOpen = 1
	BreakerOpen     = 2
)

type replica struct {
	name string
	c    policy.Client

	// guarded by Gateway.mu
	outstanding int
	lastChosen  uint64
	healthy     bool
	ready       int64 // acknowledged version, -1: none
	failures    int   // consecutive infrastructure failures
	state       int
	openedAt    time.Time
	probing     bool
}

// Gateway is a rollout.Policy over replicas. It is safe for concurrent
// use; Start runs its health checks until Close.
type Gateway struct {
	cfg      Config
	reps     []*replica
	byName   map[string]*replica
	metrics  *metrics
	registry *prometheus.Registry

	mu       sync.Mutex
	want     policy.Want
	affinity map[string]*replica
	clock    uint64
	idRep    *replica // the replica whose identity Identity returned

	stop func()
	done chan struct{}
}

var _ rollout.Policy = (*Gateway)(nil)

// New validates cfg and returns the gateway (health checks start with
// Start).
func New(cfg Config) (*Gateway, error) {
	if len(cfg.Replicas) == 0 {
		return nil, fmt.Errorf("gateway: %w: no replicas", policy.ErrConfig)
	}
	switch {
	case cfg.MaxRetries == 0:
		cfg.MaxRetries = 2
	case cfg.MaxRetries < 0:
		cfg.MaxRetries = 0
	}
	if cfg.HealthInterval == 0 {
		cfg.HealthInterval = 2 * time.Second
	}
	if cfg.HealthTimeout <= 0 {
		cfg.HealthTimeout = time.Second
	}
	if cfg.BreakerFailures <= 0 {
		cfg.BreakerFailures = 3
	}
	if cfg.BreakerCooldown <= 0 {
		cfg.BreakerCooldown = 5 * time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.AffinityEntries <= 0 {
		cfg.AffinityEntries = 1 << 16
	}
	g := &Gateway{cfg: cfg, byName: map[string]*replica{}, want: cfg.Want, affinity: map[string]*replica{}}
	for i, r := range cfg.Replicas {
		if r.Client == nil {
			return nil, fmt.Errorf("gateway: %w: replica %d has no client", policy.ErrConfig, i)
		}
		name := r.Name
		if name == "" {
			name = r.Client.Addr()
		}
		if _, dup := g.byName[name]; dup {
			return nil, fmt.Errorf("gateway: %w: two replicas named %q", policy.ErrConfig, name)
		}
		rep := &replica{name: name, c: r.Client, healthy: true, ready: -1}
		g.reps = append(g.reps, rep)
		g.byName[name] = rep
	}
	reg := cfg.Registerer
	if reg == nil {
		g.registry = prometheus.NewRegistry()
		reg = g.registry
	}
	m, err := newMetrics(reg)
	if err != nil {
		return nil, fmt.Errorf("gateway: metrics: %w", err)
	}
	g.metrics = m
	for _, r := range g.reps {
		m.init(r.name)
	}
	return g, nil
}

// Registry is the gateway's own metrics registry (nil when Config had a
// Registerer).
func (g *Gateway) Registry() *prometheus.Registry { return g.registry }

// Start starts the periodic health checks (none with HealthInterval < 0);
// Close stops them.
func (g *Gateway) Start() {
	if g.cfg.HealthInterval < 0 || g.stop != nil {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	g.stop = cancel
	g.done = make(chan struct{})
	go func() {
		defer close(g.done)
		t := time.NewTicker(g.cfg.HealthInterval)
		defer t.Stop()
		for {
			g.CheckHealth(ctx)
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
}

// Close stops the health checks.
func (g *Gateway) Close() {
	if g.stop != nil {
		g.stop()
		<-g.done
		g.stop = nil
	}
}

// CheckHealth asks every replica's health endpoint once, concurrently.
func (g *Gateway) CheckHealth(ctx context.Context) {
	var wg sync.WaitGroup
	for _, r := range g.reps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			hctx, cancel := context.WithTimeout(ctx, g.cfg.HealthTimeout)
			err := r.c.Health(hctx)
			cancel()
			if ctx.Err() != nil {
				return
			}
			g.mu.Lock()
			r.healthy = err == nil
			g.mu.Unlock()
			g.metrics.healthy.WithLabelValues(r.name).Set(b2f(err == nil))
		}()
	}
	wg.Wait()
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// SetReady records that replica serves version v >= 0 (weight sync
// verified it; 0 is the initial policy), which also marks it healthy
// until the next health check; v < 0 records that it serves no
// acknowledged version. Requests in flight on the replica are not
// affected. A client that names models by version in calls that carry no
// version (a llama.cpp router's tokenizer calls) is told through its
// Served(v) method.
func (g *Gateway) SetReady(name string, v int64) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	r, ok := g.byName[name]
	if !ok {
		return fmt.Errorf("gateway: %w: no replica %q", policy.ErrConfig, name)
	}
	r.ready = max(v, -1)
	g.metrics.ready.WithLabelValues(name).Set(float64(r.ready))
	if v >= 0 {
		// Weight sync just verified what the replica serves: it answers
		// (a health check that failed before its first load, say, is
		// stale). The next health check decides again.
		r.healthy = true
		g.metrics.healthy.WithLabelValues(name).Set(1)
	}
	if s, ok := r.c.(interface{ Served(int64) }); ok && v >= 0 {
		s.Served(v)
	}
	return nil
}

// SetWant sets the version requirement of Generate.
func (g *Gateway) SetWant(w policy.Want) {
	g.mu.Lock()
	g.want = w
	g.mu.Unlock()
}

// Names lists the replicas' names in configuration order.
func (g *Gateway) Names() []string {
	out := make([]string, len(g.reps))
	for i, r := range g.reps {
		out[i] = r.name
	}
	return out
}

// Generate implements rollout.Policy with the gateway's Want: every
// request is served (after retries) or the call fails with the first
// request's error in batch order.
func (g *Gateway) Generate(ctx context.Context, reqs []model.Request) ([]model.Sample, error) {
	g.mu.Lock()
	want := g.want
	g.mu.Unlock()
	out, errs := g.GenerateEach(ctx, reqs, want)
	if errs != nil {
		return nil, policy.FirstError(ctx, errs)
	}
	return out, nil
}

// job is one request's progress.
type job struct {
	i      int
	tried  []*replica
	last   error
	tries  int
	result error
}

type groupResult struct {
	r       *replica
	jobs    []*job
	samples []model.Sample
	errs    []error
	took    time.Duration
}

// GenerateEach routes every request (see the package comment) and returns
// a sample or an error per request (nil errors when all succeeded).
func (g *Gateway) GenerateEach(ctx context.Context, reqs []model.Request, want policy.Want) ([]model.Sample, []error) {
	out := make([]model.Sample, len(reqs))
	jobs := make([]*job, len(reqs))
	pending := make([]*job, len(reqs))
	for i := range reqs {
		jobs[i] = &job{i: i}
		pending[i] = jobs[i]
	}
	results := make(chan groupResult)
	inflight := 0
	dispatch := func(batch []*job) {
		groups, failed := g.assign(reqs, batch, want)
		for _, j := range failed {
			j.result = j.last
			if j.result == nil {
				j.result = policy.Infra(policy.ReasonNoReplica, "gateway", "no eligible replica for request %s (of %d)", reqs[j.i].ID, len(g.reps))
			}
		}
		for _, gr := range groups {
			inflight++
			sub := make([]model.Request, len(gr.jobs))
			for k, j := range gr.jobs {
				sub[k] = reqs[j.i]
			}
			rw := g.replicaWant(gr.r, want)
			res := groupResult{r: gr.r, jobs: gr.jobs}
			go func() {
				t0 := time.Now()
				res.samples, res.errs = res.r.c.GenerateEach(ctx, sub, rw)
				res.took = time.Since(t0)
				results <- res
			}()
		}
	}
	dispatch(pending)
	for inflight > 0 {
		gr := <-results
		inflight--
		var again []*job
		for k, j := range gr.jobs {
			var err error
			if gr.errs != nil {
				err = gr.errs[k]
			}
			g.finish(gr.r, err, gr.took)
			if err == nil {
				out[j.i] = gr.samples[k]
				continue
			}
			j.last = err
			if policy.IsInfra(err) && j.tries <= g.cfg.MaxRetries && ctx.Err() == nil {
				g.metrics.retries.WithLabelValues(gr.r.name).Inc()
				again = append(again, j)
				continue
			}
			j.result = err
		}
		if len(again) > 0 {
			dispatch(again)
		}
	}
	var errs []error
	for _, j := range jobs {
		if j.result != nil {
			if errs == nil {
				errs = make([]error, len(reqs))
			}
			errs[j.i] = j.result
		}
	}
	return out, errs
}

// replicaWant is what a replica is asked to serve: the gateway's exact
// version, else at least the version the replica acknowledged (which
// names the model of a llama.cpp router), else the gateway's want.
func (g *Gateway) replicaWant(r *replica, want policy.Want) policy.Want {
	g.mu.Lock()
	defer g.mu.Unlock()
	if (!want.Any() && !want.AtLeast) || r.ready < 0 {
		return want
	}
	return policy.AtLeast(max(r.ready, want.Version))
}

type group struct {
	r    *replica
	jobs []*job
}

// assign picks a replica for each job (counting it outstanding) and
// returns the jobs grouped by replica, and those no replica can take.
func (g *Gateway) assign(reqs []model.Request, batch []*job, want policy.Want) ([]*group, []*job) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.cfg.Now()
	byRep := map[*replica]*group{}
	var order []*group
	var failed []*job
	for _, j := range batch {
		r := g.pick(reqs[j.i], j, want, now)
		if r == nil {
			failed = append(failed, j)
			continue
		}
		j.tries++
		j.tried = append(j.tried, r)
		r.outstanding++
		g.clock++
		r.lastChosen = g.clock
		if r.state == BreakerHalfOpen {
			r.probing = true
		}
		g.metrics.outstanding.WithLabelValues(r.name).Set(float64(r.outstanding))
		if a := reqs[j.i].Affinity; a != "" {
			if len(g.affinity) >= g.cfg.AffinityEntries {
				clear(g.affinity)
			}
			g.affinity[a] = r
		}
		gr := byRep[r]
		if gr == nil {
			gr = &group{r: r}
			byRep[r] = gr
			order = append(order, gr)
		}
		gr.jobs = append(gr.jobs, j)
	}
	return order, failed
}

// pick chooses the replica of one request (mu held).
func (g *Gateway) pick(req model.Request, j *job, want policy.Want, now time.Time) *replica {
	ok := func(r *replica) bool {
		if slices.Contains(j.tried, r) || !r.healthy {
			return false
		}
		if !want.Any() && (r.ready < 0 || !want.Meets(r.ready)) {
			return false
		}
		switch r.state {
		case BreakerOpen:
			if now.Sub(r.openedAt) < g.cfg.BreakerCooldown {
				return false
			}
			r.state, r.probing = BreakerHalfOpen, false
			g.metrics.breaker.WithLabelValues(r.name).Set(BreakerHalfOpen)
		case BreakerHalfOpen:
			return !r.probing
		}
		return true
	}
	// A replica whose breaker waits for a probe gets one before affinity
	// is honored: otherwise sticky groups could keep it out for ever.
	for _, r := range g.reps {
		if (r.state == BreakerOpen || (r.state == BreakerHalfOpen && !r.probing)) && ok(r) {
			return r
		}
	}
	if a := req.Affinity; a != "" {
		if r := g.affinity[a]; r != nil && ok(r) {
			return r
		}
	}
	var best *replica
	for _, r := range g.reps {
		if !ok(r) {
			continue
		}
		if best == nil || r.outstanding < best.outstanding || (r.outstanding == best.outstanding && r.lastChosen < best.lastChosen) {
			best = r
		}
	}
	return best
}

// finish records one request's outcome on its replica.
func (g *Gateway) finish(r *replica, err error, took time.Duration) {
	outcome := "ok"
	ie, infra := policy.AsInfra(err)
	switch {
	case err == nil:
	case infra:
		outcome = ie.Reason
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		outcome = "canceled"
	default:
		outcome = "error"
	}
	g.metrics.requests.WithLabelValues(r.name, outcome).Inc()
	g.metrics.latency.WithLabelValues(r.name).Observe(took.Seconds())
	g.mu.Lock()
	defer g.mu.Unlock()
	r.outstanding--
	g.metrics.outstanding.WithLabelValues(r.name).Set(float64(r.outstanding))
	wasProbe := r.state == BreakerHalfOpen && r.probing
	switch {
	case err == nil:
		r.failures = 0
		if r.state != BreakerClosed {
			r.state, r.probing = BreakerClosed, false
		}
	case infra && ie.Reason != policy.ReasonVersionMismatch:
		r.failures++
		if wasProbe || r.failures >= g.cfg.BreakerFailures {
			r.state, r.openedAt, r.probing = BreakerOpen, g.cfg.Now(), false
		}
	default:
		if wasProbe {
			r.probing = false // the probe said nothing about the replica: probe again
		}
	}
	g.metrics.breaker.WithLabelValues(r.name).Set(float64(r.state))
}

// State is a replica's routing state, for tests and status pages.
type State struct {
	Name        string
	Outstanding int
	Healthy     bool
	Ready       int64
	Breaker     int
	Failures    int
}

// States returns every replica's state in configuration order.
func (g *Gateway) States() []State {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]State, len(g.reps))
	for i, r := range g.reps {
		out[i] = State{Name: r.name, Outstanding: r.outstanding, Healthy: r.healthy, Ready: r.ready, Breaker: r.state, Failures: r.failures}
	}
	return out
}
