// Package envfault is a fault-injecting HTTP proxy for the environment
// protocol (docs/ENV_PROTOCOL.md), for tests: it sits between the
// rollout stage's client and a `trajflow serve env` service and, per
// request, drops the answer after the service executed the action, resets
// the connection before forwarding, answers after the client's timeout,
// answers with a page that is not the protocol's, or delivers the request
// twice. As a misbehaving network or controller it also sends deliveries
// of its own beside a step — the action out of order (a gap), a replay
// under another idempotency key, a forged, an expired or a misused token —
// and records what the service answered them: every one must be refused.
// It counts everything it did, for the tests that compare its counts with
// the client's and the census's.
package envfault

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"

	"github.com/trajflow/trajflow/connectors/env/capability"
	"github.com/trajflow/trajflow/operators/rollout"
)

// Fault is what the proxy does with one request.
type Fault string

// Faults the client sees: every one but Duplicate leaves it without a
// protocol answer (an ambiguous try).
const (
	Pass       Fault = ""
	DropReply  Fault = "drop_reply"  // forwarded (executed); the connection closes before the answer
	ResetConn  Fault = "reset"       // the connection closes before the request is forwarded
	SlowReply  Fault = "slow_reply"  // forwarded; the answer comes after Delay
	BadGateway Fault = "bad_gateway" // a 502 page, not forwarded
	Duplicate  Fault = "duplicate"   // forwarded twice; the second answer is returned
)

// Side deliveries (steps only): the client's own request is forwarded
// unchanged; the proxy sends one delivery of its own to the service and
// records the answer (Proxy.Side). The service must refuse each one with
// the reason named.
const (
	// Gap: before the request, its action as the next sequence number
	// but one, under a valid token (seq_gap).
	Gap Fault = "gap"
	// Replay: after the request was executed, the same request under
	// another idempotency key, its token captured (seq_replayed).
	Replay Fault = "replay"
	// Forged: before the request, the request under a token signed with
	// another key (token_forged).
	Forged Fault = "forged"
	// Expired: before the request, the request under a token that
	// expired (token_expired).
	Expired Fault = "expired"
	// Misused: before the request, another action under the request's
	// token (token_scope).
	Misused Fault = "misused"
)

// ClientVisible lists the faults the client sees, Side the side
// deliveries.
var (
	ClientVisible = []Fault{DropReply, ResetConn, SlowReply, BadGateway, Duplicate}
	Side          = []Fault{Gap, Replay, Forged, Expired, Misused}
)

// Ambiguous reports whether f leaves the client without a protocol answer.
func (f Fault) Ambiguous() bool {
	return f == DropReply || f == ResetConn || f == SlowReply || f == BadGateway
}

// IsSide reports whether f is a side delivery.
func (f Fault) IsSide() bool {
	for _, s := range Side {
		if f == s {
			return true
		}
	}
	return false
}

// Config configures a Proxy.
type Config struct {
	// Target is the service's base URL.
	Target string
	// Plan chooses the fault of request n (counted over every request but
	// renewals) of kind "allocate", "step", "status" or "terminate". A
	// side delivery chosen for another kind than step passes. nil passes
	// everything.
	Plan func(n int, kind string) Fault
	// Delay is how late SlowReply answers (longer than the client's tool
	// timeout).
	Delay time.Duration
	// Key and Run are the capability run key and run id, to mint the
	// tokens of Gap and Expired; StepAction is the protocol's action
	// bytes of a step (envsvc.StepAction). Without them those faults
	// pass.
	Key        []byte
	Run        string
	StepAction func(turn int32, a rollout.EnvAction) []byte
	// Forwarded, when set, is called after a request of kind with fault
	// f (Pass, DropReply or Duplicate) was forwarded and answered, before
	// the answer goes back or the connection closes: a test kills the
	// service there to lose the answer of an action it executed.
	Forwarded func(kind string, f Fault)
}

// Proxy is a running proxy (an httptest server on 127.0.0.1).
type Proxy struct {
	cfg Config
	hs  *httptest.Server
	fwd *http.Client

	mu       sync.Mutex
	n        int
	injected map[Fault]int
	byKind   map[string]map[Fault]int
	side     map[Fault]map[string]int // fault -> "outcome/reason" -> count
}

// New starts a proxy; Close stops it.
func New(cfg Config) *Proxy {
	p := &Proxy{cfg: cfg, fwd: &http.Client{Timeout: 30 * time.Second},
		injected: map[Fault]int{}, byKind: map[string]map[Fault]int{}, side: map[Fault]map[string]int{}}
	p.hs = httptest.NewServer(http.HandlerFunc(p.serve))
	return p
}

// URL is the proxy's address, to give the client.
func (p *Proxy) URL() string { return p.hs.URL }

// Close stops the proxy.
func (p *Proxy) Close() { p.hs.Close() }

// Kind names the protocol call of a path.
func Kind(path string) string {
	switch {
	case path == "/v1/episodes":
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

// Counts returns the faults injected, in all and by call kind.
func (p *Proxy) Counts() (map[Fault]int, map[string]map[Fault]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	a := map[Fault]int{}
	for k, v := range p.injected {
		a[k] = v
	}
	b := map[string]map[Fault]int{}
	for k, m := range p.byKind {
		b[k] = map[Fault]int{}
		for f, v := range m {
			b[k][f] = v
		}
	}
	return a, b
}

// Total is the number of faults injected.
func (p *Proxy) Total() int {
	a, _ := p.Counts()
	n := 0
	for _, v := range a {
		n += v
	}
	return n
}

// SideAnswers returns what the service answered each side delivery:
// fault -> "outcome/reason" -> count.
func (p *Proxy) SideAnswers() map[Fault]map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[Fault]map[string]int{}
	for f, m := range p.side {
		out[f] = map[string]int{}
		for k, v := range m {
			out[f][k] = v
		}
	}
	return out
}

// choose picks the fault of one request.
func (p *Proxy) choose(kind string) Fault {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := Pass
	if p.cfg.Plan != nil && kind != "renew" {
		f = p.cfg.Plan(p.n, kind)
		p.n++
	}
	if f.IsSide() && (kind != "step" || ((f == Gap || f == Expired) && p.cfg.StepAction == nil)) {
		f = Pass
	}
	if f != Pass {
		p.injected[f]++
		if p.byKind[kind] == nil {
			p.byKind[kind] = map[Fault]int{}
		}
		p.byKind[kind][f]++
	}
	return f
}

func (p *Proxy) forward(path string, body []byte) (int, []byte) {
	return p.forwardMethod(http.MethodPost, path, body)
}

func (p *Proxy) forwardMethod(method, path string, body []byte) (int, []byte) {
	req, err := http.NewRequest(method, p.cfg.Target+path, bytes.NewReader(body))
	if err != nil {
		return http.StatusBadGateway, []byte(err.Error())
	}
	if method == http.MethodPost {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := p.fwd.Do(req)
	if err != nil {
		return http.StatusBadGateway, []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func (p *Proxy) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	path := r.URL.Path
	if r.Method != http.MethodPost { // health and metrics pass
		code, b := p.forwardMethod(r.Method, path, body)
		w.WriteHeader(code)
		w.Write(b)
		return
	}
	kind := Kind(path)
	f := p.choose(kind)
	forwarded := func() {
		if p.cfg.Forwarded != nil {
			p.cfg.Forwarded(kind, f)
		}
	}
	hangUp := func() {
		if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
			conn.Close()
		}
	}
	switch f {
	case ResetConn:
		hangUp()
		return
	case BadGateway:
		http.Error(w, "<html>502 Bad Gateway</html>", http.StatusBadGateway)
		return
	case DropReply:
		p.forward(path, body)
		forwarded()
		hangUp()
		return
	case Duplicate:
		p.forward(path, body)
	case SlowReply:
		code, b := p.forward(path, body)
		time.Sleep(p.cfg.Delay)
		w.WriteHeader(code)
		w.Write(b)
		return
	case Gap, Forged, Expired, Misused:
		p.sideDelivery(f, path, body)
	}
	code, b := p.forward(path, body)
	if f == Replay && outcome(b) == "executed" {
		p.sideDelivery(f, path, body)
	}
	if f == Pass || f == Duplicate {
		forwarded()
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	w.Write(b)
}

// stepBody is the part of a step request the side deliveries change.
type stepBody map[string]json.RawMessage

func outcome(b []byte) string {
	var r struct {
		Outcome, Reason string
	}
	_ = json.Unmarshal(b, &r)
	return r.Outcome
}

// sideDelivery sends f's delivery beside the step request body and
// records the answer.
func (p *Proxy) sideDelivery(f Fault, path string, body []byte) {
	var m stepBody
	var req struct {
		Seq    uint64            `json:"seq"`
		Key    string            `json:"idempotency_key"`
		Turn   int32             `json:"turn"`
		Action rollout.EnvAction `json:"action"`
	}
	if json.Unmarshal(body, &m) != nil || json.Unmarshal(body, &req) != nil {
		return
	}
	episode := strings.TrimSuffix(strings.TrimPrefix(path, "/v1/episodes/"), "/step")
	set := func(k string, v any) { m[k], _ = json.Marshal(v) }
	issue := func(key []byte, now func() time.Time, ttl time.Duration, seq uint64) string {
		iss, err := capability.NewIssuer(key, p.cfg.Run, ttl, now)
		if err != nil {
			return ""
		}
		return iss.Issue(episode, seq, p.cfg.StepAction(req.Turn, req.Action))
	}
	switch f {
	case Gap:
		set("seq", req.Seq+1)
		set("idempotency_key", req.Key+"/gap")
		set("token", issue(p.cfg.Key, nil, 30*time.Second, req.Seq+1))
	case Replay:
		set("idempotency_key", req.Key+"/replayed")
	case Forged:
		other := make([]byte, capability.KeySize)
		_, _ = rand.Read(other)
		if p.cfg.StepAction != nil {
			set("token", issue(other, nil, 30*time.Second, req.Seq))
		} else {
			tok := ""
			_ = json.Unmarshal(m["token"], &tok)
			if i := strings.IndexByte(tok, '.'); i > 0 {
				tok = tok[:i+1] + "AAAA" + tok[i+1:]
			}
			set("token", tok)
		}
	case Expired:
		set("token", issue(p.cfg.Key, func() time.Time { return time.Now().Add(-time.Hour) }, time.Second, req.Seq))
	case Misused:
		set("action", rollout.EnvAction{IDs: append(append([]int32(nil), req.Action.IDs...), 0), Text: req.Action.Text + " "})
	}
	b, _ := json.Marshal(m)
	_, ans := p.forward(path, b)
	var r struct {
		Outcome string `json:"outcome"`
		Reason  string `json:"reason"`
	}
	if json.Unmarshal(ans, &r) != nil || r.Outcome == "" {
		r.Outcome = "no_answer"
	}
	p.mu.Lock()
	if p.side[f] == nil {
		p.side[f] = map[string]int{}
	}
	p.side[f][r.Outcome+"/"+r.Reason]++
	p.mu.Unlock()
}
