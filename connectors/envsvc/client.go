package envsvc

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/trajflow/trajflow/connectors/env/capability"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// ErrInfrastructure is wrapped by every client error that is the
// infrastructure's, never the task's: retries exhausted, an episode the
// service ended (lease expired, restarted without its state), a refusal
// that says the client and the service disagree. The agent loop fails the
// attempt; the rollout stage retries it with a new attempt number and
// records an infrastructure failure in the census.
var ErrInfrastructure = errors.New("envsvc: infrastructure failure")

// RefusedError is a refusal by the service.
type RefusedError struct {
	Op, Reason, Detail string
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("envsvc: %s refused: %s: %s", e.Op, e.Reason, e.Detail)
}

// Options configure a Client. Zero values take the defaults.
type Options struct {
	// ToolTimeout bounds one request (the contract's
	// sampler.tool_timeout_ms; default 5 s). A request without an answer
	// by then is ambiguous: before it is sent again, its status is asked.
	ToolTimeout time.Duration
	// ToolRetries is how often one call is tried again after an
	// infrastructure failure (the contract's sampler.tool_retries; 0: no
	// retry).
	ToolRetries int
	// Backoff is the first pause between tries (default 50 ms), doubled
	// each time up to MaxBackoff (default 2 s).
	Backoff, MaxBackoff time.Duration
	// Lease is asked at allocation and renewal (default 10 s); a live
	// episode renews it every Lease/3.
	Lease time.Duration
	// TokenTTL is the lifetime of a capability token (default 30 s): one
	// is minted for every request. A service refuses a token living
	// longer than its maximum token lifetime (10 min by default) plus
	// capability.ClockSlack.
	TokenTTL time.Duration
	// Concurrency is how many calls of different episodes the agent loop
	// may overlap (rollout.Concurrent; default 32).
	Concurrency int
	HTTPClient  *http.Client
	Now         func() time.Time
	Logger      *slog.Logger
}

// ContractOptions takes the tool timeout and retries from a resolved
// learning contract.
func ContractOptions(c *contract.Contract) Options {
	return Options{ToolTimeout: time.Duration(c.Sampler.ToolTimeoutMS) * time.Millisecond, ToolRetries: c.Sampler.ToolRetries}
}

// Client is the controller side of the protocol: it implements
// rollout.Environment (and rollout.Concurrent) over one or more service
// addresses. An episode is allocated on the least-loaded address (the
// fewest live episodes the services last reported) and every later call of
// the episode goes to the same address. It is safe for concurrent use.
type Client struct {
	backends []*backend
	key      []byte
	o        Options
	http     *http.Client
	issuers  sync.Map // run -> *capability.Issuer
	rr       atomic.Uint64
	pickMu   sync.Mutex
	cnt      counters

	ctx    context.Context // lease renewers run under it
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

type backend struct {
	url       string
	mu        sync.Mutex
	load      int // live episodes the service last reported
	mine      int // episodes this client holds there, allocations in flight included
	capacity  int
	downUntil time.Time
}

// estimate is the backend's load for routing: what the service last
// reported, or, when more, what this client holds there now (a report
// is as old as the last answer; a burst of allocations answers late).
// b.mu is held.
func (b *backend) estimate() int { return max(b.load, b.mine) }

// hold counts one episode more (d = 1) or less (d = -1) on b.
func (b *backend) hold(d int) {
	b.mu.Lock()
	b.mine += d
	b.mu.Unlock()
}

// New returns a client of the services at urls ("http://host:port"),
// minting capability tokens with the run key.
func New(urls []string, key []byte, o Options) (*Client, error) {
	if len(urls) == 0 {
		return nil, errors.New("envsvc: client: no service address")
	}
	if len(key) != capability.KeySize {
		return nil, fmt.Errorf("envsvc: client: %w", capability.ErrKey)
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&o.ToolTimeout, 5*time.Second)
	def(&o.Backoff, 50*time.Millisecond)
	def(&o.MaxBackoff, 2*time.Second)
	def(&o.Lease, 10*time.Second)
	def(&o.TokenTTL, 30*time.Second)
	if o.ToolRetries < 0 {
		return nil, fmt.Errorf("envsvc: client: tool retries %d", o.ToolRetries)
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 32
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	c := &Client{key: bytes.Clone(key), o: o, http: o.HTTPClient}
	if c.http == nil {
		c.http = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, IdleConnTimeout: 30 * time.Second}}
	}
	for _, u := range urls {
		p, err := url.Parse(u)
		if err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
			return nil, fmt.Errorf("envsvc: client: service address %q is not an http(s) URL", u)
		}
		c.backends = append(c.backends, &backend{url: strings.TrimSuffix(u, "/")})
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	return c, nil
}

// Close stops the lease renewers of episodes still open (their leases then
// run out on the service).
func (c *Client) Close() error {
	c.cancel()
	c.wg.Wait()
	return nil
}

// Concurrency implements rollout.Concurrent.
func (c *Client) Concurrency() int { return c.o.Concurrency }

func (c *Client) issuer(run string) (*capability.Issuer, error) {
	if v, ok := c.issuers.Load(run); ok {
		return v.(*capability.Issuer), nil
	}
	iss, err := capability.NewIssuer(c.key, run, c.o.TokenTTL, c.o.Now)
	if err != nil {
		return nil, err
	}
	v, _ := c.issuers.LoadOrStore(run, iss)
	return v.(*capability.Issuer), nil
}

// pick returns the least-loaded backend that is not marked down (all of
// them if every one is), ties broken round robin, and counts the
// allocation about to be sent there.
func (c *Client) pick(avoid map[*backend]bool) *backend {
	c.pickMu.Lock()
	defer c.pickMu.Unlock()
	b := c.pickLocked(avoid)
	b.hold(1)
	return b
}

func (c *Client) pickLocked(avoid map[*backend]bool) *backend {
	now := c.o.Now()
	start := int(c.rr.Add(1))
	var best *backend
	bestLoad := 0
	for pass := 0; pass < 2 && best == nil; pass++ {
		for k := range c.backends {
			b := c.backends[(start+k)%len(c.backends)]
			b.mu.Lock()
			load, down := b.estimate(), now.Before(b.downUntil) || avoid[b]
			b.mu.Unlock()
			if pass == 0 && down {
				continue
			}
			if best == nil || load < bestLoad {
				best, bestLoad = b, load
			}
		}
	}
	return best
}

// errAmbiguous marks a request without an answer.
type errAmbiguous struct {
	reason string
	err    error
}

func (e *errAmbiguous) Error() string {
	return fmt.Sprintf("envsvc: no answer (%s): %v", e.reason, e.err)
}
func (e *errAmbiguous) Unwrap() error { return e.err }

// maxResponseBytes bounds what the client reads of one answer of a
// service (a step's, a health document): an answer is one JSON document
// whose largest part, an observation, a service caps at
// Config.MaxObservationBytes (64 KiB by default), so this leaves room for
// any cap a service would set. A server that sends more (a wrong address,
// a misbehaving service) is read no further.
const maxResponseBytes = 16 << 20

// post sends one request and decodes a protocol answer into out (whose
// common part it returns). Anything else — a timeout, a reset connection,
// a reply that is not the protocol's — is *errAmbiguous.
func (c *Client) post(ctx context.Context, b *backend, path string, req, out any, common func() Response) (Response, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return Response{}, err
	}
	rctx, cancel := context.WithTimeout(ctx, c.o.ToolTimeout)
	defer cancel()
	hr, err := http.NewRequestWithContext(rctx, http.MethodPost, b.url+path, bytes.NewReader(body))
	if err != nil {
		return Response{}, err
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(hr)
	if err != nil {
		reason := "connection"
		var ne net.Error
		if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
			reason = "timeout"
		}
		if ctx.Err() != nil {
			return Response{}, ctx.Err()
		}
		return Response{}, &errAmbiguous{reason, err}
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBytes))
	if err != nil {
		if ctx.Err() != nil {
			return Response{}, ctx.Err()
		}
		return Response{}, &errAmbiguous{"connection", err}
	}
	if err := json.Unmarshal(data, out); err != nil || common().Protocol == 0 {
		return Response{}, &errAmbiguous{"http_" + strconv.Itoa(resp.StatusCode), fmt.Errorf("%s %s: not a protocol answer: %.200s", b.url, path, data)}
	}
	r := common()
	if r.Protocol != ProtocolVersion {
		return r, fmt.Errorf("%w: %s speaks protocol %d, this client %d", ErrInfrastructure, b.url, r.Protocol, ProtocolVersion)
	}
	b.mu.Lock()
	b.load, b.capacity = r.Live, r.Capacity
	b.mu.Unlock()
	return r, nil
}

// backoff sleeps before try (1, 2, ...).
func (c *Client) backoff(ctx context.Context, try int) error {
	d := c.o.Backoff
	for i := 1; i < try && d < c.o.MaxBackoff; i++ {
		d *= 2
	}
	t := time.NewTimer(min(d, c.o.MaxBackoff))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func newKey() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func refusal(op string, r Response) error {
	return fmt.Errorf("%w: %w", ErrInfrastructure, &RefusedError{Op: op, Reason: r.Reason, Detail: r.Detail})
}

// Reset implements rollout.Environment: it allocates an episode of a on
// the least-loaded service and starts renewing its lease. An unknown task
// wraps rollout.ErrUnknownTask; every other failure ErrInfrastructure.
func (c *Client) Reset(ctx context.Context, a schemas.TaskAttempt) (rollout.Episode, rollout.Observation, error) {
	iss, err := c.issuer(a.RunID)
	if err != nil {
		return nil, rollout.Observation{}, err
	}
	key := a.AttemptID + "/" + newKey()
	avoid := map[*backend]bool{}
	var last error
	for try := 0; try <= c.o.ToolRetries; try++ {
		if try > 0 {
			if err := c.backoff(ctx, try); err != nil {
				return nil, rollout.Observation{}, err
			}
		}
		b := c.pick(avoid) // held until the episode closes, or released below
		req := AllocateRequest{Protocol: ProtocolVersion, Attempt: a, IdempotencyKey: key, LeaseMS: c.o.Lease.Milliseconds(),
			Token: iss.Issue(AllocateScope(a), 0, AllocateAction(a, key))}
		var resp AllocateResponse
		r, err := c.post(ctx, b, PathEpisodes, req, &resp, func() Response { return resp.Response })
		if err != nil || r.Outcome != Executed {
			b.hold(-1)
		}
		var amb *errAmbiguous
		switch {
		case errors.As(err, &amb):
			// The allocation may have happened there: its lease runs out
			// unrenewed. Try elsewhere for a while.
			c.cnt.retry("allocate_" + amb.reason)
			b.mu.Lock()
			b.downUntil = c.o.Now().Add(time.Second)
			b.mu.Unlock()
			avoid[b] = len(avoid)+1 < len(c.backends)
			last = err
			continue
		case err != nil:
			return nil, rollout.Observation{}, err
		}
		switch {
		case r.Outcome == Executed:
			return c.open(b, a, iss, resp), resp.Observation, nil
		case r.Reason == ReasonUnknownTask:
			return nil, rollout.Observation{}, fmt.Errorf("%w: %s: %s", rollout.ErrUnknownTask, b.url, r.Detail)
		case r.Retry:
			c.cnt.retry("allocate_" + r.Reason)
			avoid[b] = len(avoid)+1 < len(c.backends)
			last = &RefusedError{Op: "allocate", Reason: r.Reason, Detail: r.Detail}
			continue
		}
		c.cnt.refused(r.Reason)
		return nil, rollout.Observation{}, refusal("allocate", r)
	}
	c.cnt.exhausted.Add(1)
	return nil, rollout.Observation{}, fmt.Errorf("%w: allocate %s: %d tries: %v", ErrInfrastructure, a.AttemptID, c.o.ToolRetries+1, last)
}

// episode is the client's handle of one allocated episode.
type remoteEpisode struct {
	c    *Client
	b    *backend
	id   string
	a    schemas.TaskAttempt
	iss  *capability.Issuer
	spec rollout.Spec
	seq  uint64 // the last executed sequence number
	// every is the renewal interval.
	every time.Duration

	lost   atomic.Pointer[error] // set when the service ended the episode
	stop   chan struct{}
	done   chan struct{}
	closed bool
}

func (c *Client) open(b *backend, a schemas.TaskAttempt, iss *capability.Issuer, r AllocateResponse) *remoteEpisode {
	e := &remoteEpisode{c: c, b: b, id: r.EpisodeID, a: a, iss: iss, spec: r.Spec, stop: make(chan struct{}), done: make(chan struct{})}
	// Renew at a third of the lease the service granted, which its
	// --max-lease may cap below the one asked for.
	e.every = c.o.Lease / 3
	if granted := time.UnixMilli(r.LeaseExpiresMS).Sub(c.o.Now()); granted > 0 && granted < c.o.Lease {
		e.every = granted / 3
	}
	c.cnt.allocated.Add(1)
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer close(e.done)
		e.renew()
	}()
	return e
}

// ID returns the service's episode id.
func (e *remoteEpisode) ID() string { return e.id }

// Spec implements rollout.Episode.
func (e *remoteEpisode) Spec() rollout.Spec { return e.spec }

// renew renews the lease every third of it (the lease asked, or the
// shorter one granted) until the episode closes or the service says it
// ended.
func (e *remoteEpisode) renew() {
	t := time.NewTicker(max(e.every, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-e.stop:
			return
		case <-e.c.ctx.Done():
			return
		case <-t.C:
		}
		req := RenewRequest{Protocol: ProtocolVersion, LeaseMS: e.c.o.Lease.Milliseconds(), Token: e.iss.Issue(e.id, 0, RenewAction)}
		var resp RenewResponse
		r, err := e.c.post(e.c.ctx, e.b, strings.Replace(PathRenew, "{id}", e.id, 1), req, &resp, func() Response { return resp.Response })
		switch {
		case err != nil:
			e.c.cnt.leaseFailures.Add(1)
		case r.Outcome == Executed:
			e.c.cnt.renewals.Add(1)
		case r.Retry:
			e.c.cnt.leaseFailures.Add(1)
		default:
			e.c.cnt.leaseFailures.Add(1)
			err := fmt.Errorf("%w: episode %s: lease renewal refused: %s (%s)", ErrInfrastructure, e.id, r.Reason, r.Detail)
			e.lost.Store(&err)
			return
		}
	}
}

func (e *remoteEpisode) path(p string) string { return strings.Replace(p, "{id}", e.id, 1) }

// Step implements rollout.Episode: it sends the action as the next
// sequence number with an idempotency key of its own and a fresh token per
// try. After a try without an answer it asks the action's status before it
// sends the action again: an executed action's stored transition is
// returned, and the action is sent again only if the service never
// received it. Infrastructure failures are retried ToolRetries times.
func (e *remoteEpisode) Step(ctx context.Context, turn int32, a rollout.EnvAction) (rollout.Transition, error) {
	if p := e.lost.Load(); p != nil {
		return rollout.Transition{}, *p
	}
	c := e.c
	seq := e.seq + 1
	key := e.id + "/" + strconv.FormatUint(seq, 10)
	action := StepAction(turn, a)
	ambiguous := false
	var last error
	for try := 0; try <= c.o.ToolRetries; try++ {
		if try > 0 {
			if err := c.backoff(ctx, try); err != nil {
				return rollout.Transition{}, err
			}
		}
		if p := e.lost.Load(); p != nil {
			return rollout.Transition{}, *p
		}
		req := StepRequest{Protocol: ProtocolVersion, Seq: seq, IdempotencyKey: key, Turn: turn, Action: a}
		if ambiguous {
			req.Token = e.iss.Issue(e.id, seq, action)
			c.cnt.statusQueries.Add(1)
			var resp StepResponse
			r, err := c.post(ctx, e.b, e.path(PathStatus), req, &resp, func() Response { return resp.Response })
			var amb *errAmbiguous
			switch {
			case errors.As(err, &amb):
				c.cnt.retry("status_" + amb.reason)
				last = err
				continue
			case err != nil:
				return rollout.Transition{}, err
			}
			switch fault := transitionFault(resp.Transition); {
			case r.Outcome == Executed && fault != "":
				c.cnt.retry("status_bad_transition")
				last = fmt.Errorf("%s: status of step %d: %s", e.b.url, seq, fault)
				continue
			case r.Outcome == Executed && resp.Transition != nil:
				c.cnt.statusExecuted.Add(1)
				e.seq = seq
				return *resp.Transition, nil
			case r.Outcome == Unknown && r.Reason == ReasonNotReceived:
				c.cnt.statusUnknown.Add(1) // never arrived: sending it is safe
			case r.Outcome == Unknown || r.Retry:
				c.cnt.retry("status_" + r.Reason)
				last = &RefusedError{Op: "status", Reason: r.Reason, Detail: r.Detail}
				continue
			default:
				c.cnt.refused(r.Reason)
				return rollout.Transition{}, refusal("status", r)
			}
		}
		req.Token = e.iss.Issue(e.id, seq, action)
		var resp StepResponse
		r, err := c.post(ctx, e.b, e.path(PathStep), req, &resp, func() Response { return resp.Response })
		var amb *errAmbiguous
		switch {
		case errors.As(err, &amb):
			c.cnt.retry(amb.reason)
			ambiguous, last = true, err
			continue
		case err != nil:
			return rollout.Transition{}, err
		}
		switch fault := transitionFault(resp.Transition); {
		case r.Outcome == Executed && fault != "":
			// Executed, says the service, but the answer is not one: ask
			// the action's status (its stored transition) before anything
			// is sent again.
			c.cnt.retry("bad_transition")
			ambiguous, last = true, fmt.Errorf("%s: step %d: %s", e.b.url, seq, fault)
			continue
		case r.Outcome == Executed && resp.Transition != nil:
			if resp.Replayed {
				c.cnt.replayed.Add(1)
			}
			e.seq = seq
			return *resp.Transition, nil
		case r.Outcome == Unknown:
			c.cnt.retry(r.Reason)
			ambiguous, last = true, &RefusedError{Op: "step", Reason: r.Reason, Detail: r.Detail}
			continue
		case r.Retry:
			c.cnt.retry(r.Reason)
			last = &RefusedError{Op: "step", Reason: r.Reason, Detail: r.Detail}
			continue
		}
		c.cnt.refused(r.Reason)
		return rollout.Transition{}, refusal("step", r)
	}
	c.cnt.exhausted.Add(1)
	return rollout.Transition{}, fmt.Errorf("%w: step %d of episode %s: %d tries: %v", ErrInfrastructure, seq, e.id, c.o.ToolRetries+1, last)
}

// transitionFault says what makes an executed step's transition unusable
// (a decision other than the three, or a refusal without its reason), or
// "" (for no transition too: the caller handles an answer without one).
func transitionFault(tr *rollout.Transition) string {
	if tr == nil {
		return ""
	}
	switch tr.Decision {
	case schemas.DecisionOK:
		return ""
	case schemas.DecisionInvalid, schemas.DecisionDenied:
		if tr.Reason == "" {
			return fmt.Sprintf("transition.decision %q without a reason", tr.Decision)
		}
		return ""
	}
	return fmt.Sprintf("transition.decision %q is none of %q, %q, %q", tr.Decision, schemas.DecisionOK, schemas.DecisionInvalid, schemas.DecisionDenied)
}

// Close implements rollout.Episode: it stops the lease renewal and
// terminates the episode (idempotent, retried). An episode the service
// ended on its own (status infra) is an ErrInfrastructure error.
func (e *remoteEpisode) Close(ctx context.Context, reason string) (rollout.Final, error) {
	if !e.closed {
		e.closed = true
		close(e.stop)
		<-e.done
		e.b.hold(-1)
	}
	c := e.c
	var last error
	for try := 0; try <= c.o.ToolRetries; try++ {
		if try > 0 {
			if err := c.backoff(ctx, try); err != nil {
				return rollout.Final{}, err
			}
		}
		req := TerminateRequest{Protocol: ProtocolVersion, Reason: reason, Token: e.iss.Issue(e.id, 0, TerminateAction)}
		var resp TerminateResponse
		r, err := c.post(ctx, e.b, e.path(PathTerminate), req, &resp, func() Response { return resp.Response })
		var amb *errAmbiguous
		switch {
		case errors.As(err, &amb):
			c.cnt.retry("terminate_" + amb.reason)
			last = err
			continue
		case err != nil:
			return rollout.Final{}, err
		}
		switch {
		case r.Outcome == Executed && resp.Status == StatusInfra:
			c.cnt.lost.Add(1)
			return rollout.Final{Artifacts: resp.Artifacts, Steps: resp.Steps},
				fmt.Errorf("%w: episode %s ended by the service: %s", ErrInfrastructure, e.id, resp.EndReason)
		case r.Outcome == Executed:
			return rollout.Final{Artifacts: resp.Artifacts, Steps: resp.Steps}, nil
		case r.Retry:
			c.cnt.retry("terminate_" + r.Reason)
			last = &RefusedError{Op: "terminate", Reason: r.Reason, Detail: r.Detail}
			continue
		}
		c.cnt.refused(r.Reason)
		return rollout.Final{}, refusal("terminate", r)
	}
	c.cnt.exhausted.Add(1)
	return rollout.Final{}, fmt.Errorf("%w: terminate episode %s: %d tries: %v", ErrInfrastructure, e.id, c.o.ToolRetries+1, last)
}

// Counters are the client's accounting of the infrastructure: every retry
// by reason, status queries and what they found, repeated deliveries
// answered from the service's records, refusals, lease renewals. The
// rollout stage records them in the census.
type Counters struct {
	// Retries counts tries after the first, by reason: "timeout",
	// "connection", "http_<code>" (no answer), "bad_transition" (an
	// executed step whose transition is unusable), a protocol reason with
	// Retry set ("capacity", "persist_failed", "shutting_down") or
	// Unknown ("step_timeout"); prefixed "allocate_", "status_" or
	// "terminate_" for those calls.
	Retries map[string]int64 `json:"retries"`
	// StatusQueries after an ambiguous try; StatusExecuted of them found
	// the action executed (its stored transition was used, nothing ran
	// again), StatusUnknown found it never arrived (then it was sent).
	StatusQueries  int64 `json:"status_queries"`
	StatusExecuted int64 `json:"status_executed"`
	StatusUnknown  int64 `json:"status_unknown"`
	// Replayed counts step answers that were a stored transition (a
	// delivery the service had executed already).
	Replayed int64 `json:"replayed"`
	// Refused counts final refusals by reason.
	Refused map[string]int64 `json:"refused"`
	// Exhausted counts calls that failed after every retry.
	Exhausted         int64 `json:"exhausted"`
	EpisodesAllocated int64 `json:"episodes_allocated"`
	// EpisodesLost counts episodes the service ended on its own (lease
	// expired, state lost): infrastructure failures.
	EpisodesLost  int64 `json:"episodes_lost"`
	LeaseRenewals int64 `json:"lease_renewals"`
	LeaseFailures int64 `json:"lease_failures"`
}

// TotalRetries sums Retries.
func (c Counters) TotalRetries() int64 {
	var n int64
	for _, v := range c.Retries {
		n += v
	}
	return n
}

// String lists the counters in a stable order.
func (c Counters) String() string {
	var b strings.Builder
	keys := make([]string, 0, len(c.Retries))
	for k := range c.Retries {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	fmt.Fprintf(&b, "retries %d {", c.TotalRetries())
	for i, k := range keys {
		if i > 0 {
			b.WriteString(" ")
		}
		fmt.Fprintf(&b, "%s:%d", k, c.Retries[k])
	}
	fmt.Fprintf(&b, "} status queries %d (executed %d, unknown %d), replayed %d, refused %v, exhausted %d, allocated %d, lost %d, renewals %d (failed %d)",
		c.StatusQueries, c.StatusExecuted, c.StatusUnknown, c.Replayed, c.Refused, c.Exhausted, c.EpisodesAllocated, c.EpisodesLost, c.LeaseRenewals, c.LeaseFailures)
	return b.String()
}

type counters struct {
	mu                                           sync.Mutex
	retries, refusals                            map[string]int64
	statusQueries, statusExecuted, statusUnknown atomic.Int64
	replayed, exhausted, allocated, lost         atomic.Int64
	renewals, leaseFailures                      atomic.Int64
}

func (c *counters) retry(reason string) {
	c.mu.Lock()
	if c.retries == nil {
		c.retries = map[string]int64{}
	}
	c.retries[reason]++
	c.mu.Unlock()
}

func (c *counters) refused(reason string) {
	c.mu.Lock()
	if c.refusals == nil {
		c.refusals = map[string]int64{}
	}
	c.refusals[reason]++
	c.mu.Unlock()
}

// Counters returns a snapshot of the client's counters.
func (c *Client) Counters() Counters {
	c.cnt.mu.Lock()
	out := Counters{Retries: map[string]int64{}, Refused: map[string]int64{}}
	for k, v := range c.cnt.retries {
		out.Retries[k] = v
	}
	for k, v := range c.cnt.refusals {
		out.Refused[k] = v
	}
	c.cnt.mu.Unlock()
	out.StatusQueries = c.cnt.statusQueries.Load()
	out.StatusExecuted = c.cnt.statusExecuted.Load()
	out.StatusUnknown = c.cnt.statusUnknown.Load()
	out.Replayed = c.cnt.replayed.Load()
	out.Exhausted = c.cnt.exhausted.Load()
	out.EpisodesAllocated = c.cnt.allocated.Load()
	out.EpisodesLost = c.cnt.lost.Load()
	out.LeaseRenewals = c.cnt.renewals.Load()
	out.LeaseFailures = c.cnt.leaseFailures.Load()
	return out
}

// Health asks every service for its health document.
func (c *Client) Health(ctx context.Context) ([]Health, error) {
	out := make([]Health, len(c.backends))
	for i, b := range c.backends {
		rctx, cancel := context.WithTimeout(ctx, c.o.ToolTimeout)
		hr, err := http.NewRequestWithContext(rctx, http.MethodGet, b.url+PathHealth, nil)
		if err != nil {
			cancel()
			return nil, err
		}
		resp, err := c.http.Do(hr)
		if err != nil {
			cancel()
			return nil, fmt.Errorf("envsvc: health of %s: %w", b.url, err)
		}
		data, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBytes+1))
		resp.Body.Close()
		cancel()
		if err != nil {
			return nil, fmt.Errorf("envsvc: health of %s: %w", b.url, err)
		}
		if len(data) > maxResponseBytes {
			return nil, fmt.Errorf("envsvc: health of %s: answer over %d bytes", b.url, maxResponseBytes)
		}
		if err := json.Unmarshal(data, &out[i]); err != nil {
			return nil, fmt.Errorf("envsvc: health of %s: %w", b.url, err)
		}
		if out[i].Protocol != ProtocolVersion {
			return nil, fmt.Errorf("envsvc: health of %s: protocol %d, this client speaks %d", b.url, out[i].Protocol, ProtocolVersion)
		}
	}
	return out, nil
}

var (
	_ rollout.Environment = (*Client)(nil)
	_ rollout.Concurrent  = (*Client)(nil)
	_ rollout.Episode     = (*remoteEpisode)(nil)
)

// Sub returns the counts of c since prev (an earlier snapshot of the same
// client): what one group's run cost, for its census events.
func (c Counters) Sub(prev Counters) Counters {
	sub := func(a, b map[string]int64) map[string]int64 {
		out := map[string]int64{}
		for k, v := range a {
			if d := v - b[k]; d != 0 {
				out[k] = d
			}
		}
		return out
	}
	return Counters{
		Retries: sub(c.Retries, prev.Retries), Refused: sub(c.Refused, prev.Refused),
		StatusQueries: c.StatusQueries - prev.StatusQueries, StatusExecuted: c.StatusExecuted - prev.StatusExecuted,
		StatusUnknown: c.StatusUnknown - prev.StatusUnknown, Replayed: c.Replayed - prev.Replayed,
		Exhausted: c.Exhausted - prev.Exhausted, EpisodesAllocated: c.EpisodesAllocated - prev.EpisodesAllocated,
		EpisodesLost: c.EpisodesLost - prev.EpisodesLost, LeaseRenewals: c.LeaseRenewals - prev.LeaseRenewals,
		LeaseFailures: c.LeaseFailures - prev.LeaseFailures,
	}
}

// Dial is New with the run key read from keyFile (the service's
// --key-file, by default DATA/capability.key).
func Dial(urls []string, keyFile string, o Options) (*Client, error) {
	key, err := ReadKeyFile(keyFile)
	if err != nil {
		return nil, err
	}
	return New(urls, key, o)
}
