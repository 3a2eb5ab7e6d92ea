// Package policytest builds what the policy connectors' tests share:
// releases of the built-in policy in a directory, seeded requests, servers
// of every protocol on 127.0.0.1, and a fault-injecting handler.
package policytest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy/serve"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Registry is the demo's task registry; its grammar is the servers'.
func Registry(t testing.TB) *rollout.Registry {
	t.Helper()
	reg, err := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	if err != nil {
		t.Fatal(err)
	}
	return reg
}

// Release writes release v of a built-in policy into dir: a model drawn
// from seed 100+v; when peaked, its output layer is scaled by 400 so that
// most positions have one token of probability within 1e-6 of 1 (log-probs
// close to 0, the hard case for float encodings).
func Release(t testing.TB, dir string, v int64, peaked bool) schemas.PolicyRelease {
	t.Helper()
	m, err := model.New(model.Config{Vocab: rollout.VocabSize, Window: 12, Embed: 16, Hidden: 64}, uint64(100+v))
	if err != nil {
		t.Fatal(err)
	}
	if peaked {
		vw := m.Views()
		for i := range vw.W2 {
			vw.W2[i] *= 400
		}
	}
	tr, err := gpu.NewTrainer(m, model.Behavior{Temperature: 1}, v)
	if err != nil {
		t.Fatal(err)
	}
	files, err := pipeline.NewDirReleases(dir)
	if err != nil {
		t.Fatal(err)
	}
	rel, err := tr.Release(files, gpu.ReleaseMeta{TokenizerHash: rollout.TokenizerHash, Now: func() time.Time { return time.Unix(1700000000, 0) }})
	if err != nil {
		t.Fatal(err)
	}
	return rel
}

// Load loads a release in process (the reference of every exactness test).
func Load(t testing.TB, rel schemas.PolicyRelease) *model.Policy {
	t.Helper()
	p, err := gpu.LoadRelease(rel)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// RequestOptions shape Requests.
type RequestOptions struct {
	// StopEnd forces rollout.TokEnd into every request's stop ids (the
	// llama.cpp protocol ends at it whatever the request says).
	StopEnd bool
	// Plain leaves temperature 1 and no truncation (for servers that cannot
	// apply top-k or top-p).
	Plain bool
}

// Requests returns n requests drawn from seed: contexts of 1..20 built-in
// ids (half ending with ACT so the grammar constrains the action), seeds
// over the whole uint64 range, and mixed settings (temperature 0.7..1.5,
// top-k 0 or 2..6, top-p 0 or 0.5..0.95, max tokens 1..6, stop ids among
// END and CALL) with reg's grammar.
func Requests(reg *rollout.Registry, n int, seed uint64, o RequestOptions) []model.Request {
	rng := rand.New(rand.NewPCG(seed, 17))
	out := make([]model.Request, n)
	for i := range out {
		ctx := make([]int32, 1+rng.IntN(20))
		for j := range ctx {
			ctx[j] = int32(1 + rng.IntN(rollout.VocabSize-1))
		}
		if rng.IntN(2) == 0 {
			ctx[len(ctx)-1] = rollout.TokAct
		}
		s := model.Settings{Behavior: model.Behavior{Temperature: 1, Grammar: reg.Grammar()}, MaxTokens: 1 + rng.IntN(6)}
		if !o.Plain {
			s.Temperature = []float64{1, 0.7, 1.3, 1.5}[rng.IntN(4)]
			if rng.IntN(3) == 0 {
				s.TopK = 2 + rng.IntN(5)
			}
			if rng.IntN(3) == 0 {
				s.TopP = 0.5 + 0.45*rng.Float64()
			}
		}
		switch rng.IntN(3) {
		case 0:
			s.Stop = []int32{rollout.TokEnd}
		case 1:
			s.Stop = []int32{rollout.TokEnd, rollout.TokCall}
		default:
			if !o.StopEnd {
				s.Stop = nil
			} else {
				s.Stop = []int32{rollout.TokEnd}
			}
		}
		out[i] = model.Request{Context: ctx, Settings: s, Seed: rng.Uint64(), ID: fmt.Sprintf("req-%d", i), Affinity: fmt.Sprintf("group-%d", i%5)}
	}
	return out
}

// Server is a protocol server on 127.0.0.1.
type Server struct {
	*serve.Server
	HTTP *httptest.Server
	URL  string
}

// Start starts a server of protocol over dir with reg's grammar, loads the
// given versions (the last one current), wrapped by wrap when non-nil.
func Start(t testing.TB, protocol, dir string, reg *rollout.Registry, wrap func(http.Handler) http.Handler, versions ...int64) *Server {
	t.Helper()
	var g model.Grammar
	if reg != nil {
		g = reg.Grammar()
	}
	return StartWith(t, serve.Config{Protocol: protocol, Releases: dir, Grammar: g}, wrap, versions...)
}

// StartWith is Start with a whole server configuration.
func StartWith(t testing.TB, cfg serve.Config, wrap func(http.Handler) http.Handler, versions ...int64) *Server {
	t.Helper()
	s, err := serve.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range versions {
		if err := s.Load(v); err != nil {
			t.Fatal(err)
		}
	}
	var h http.Handler = s
	if wrap != nil {
		h = wrap(h)
	}
	hs := httptest.NewServer(h)
	t.Cleanup(hs.Close)
	return &Server{Server: s, HTTP: hs, URL: hs.URL}
}

// Fault is a fault-injecting handler around a server: while a fault is
// set, requests to paths with Prefix get it instead of (or on top of) the
// real answer.
type Fault struct {
	Next   http.Handler
	Prefix string // "" = every path

	mu    sync.Mutex
	kind  string
	delay time.Duration
	edit  func([]byte) []byte
	fn    func(w http.ResponseWriter, r *http.Request, next http.Handler)
	Hits  atomic.Int64
}

// Fault kinds.
const (
	FaultNone     = ""
	FaultStatus   = "status"   // answer 500
	FaultSlow     = "slow"     // wait delay, then answer
	FaultLate     = "late"     // answer, then hold the answer back for delay
	FaultTruncate = "truncate" // cut the real body in half
	FaultEdit     = "edit"     // rewrite the real body
	FaultHang     = "hang"     // never answer (until the client gives up)
	FaultDrop     = "drop"     // close the connection without an answer
	FaultFunc     = "func"     // answer with the function given to SetFunc
)

// Set sets the fault.
func (f *Fault) Set(kind string, delay time.Duration, edit func([]byte) []byte) {
	f.mu.Lock()
	f.kind, f.delay, f.edit, f.fn = kind, delay, edit, nil
	f.mu.Unlock()
}

// SetFunc sets a FaultFunc fault: fn answers the requests the fault
// applies to (next is the real server).
func (f *Fault) SetFunc(fn func(w http.ResponseWriter, r *http.Request, next http.Handler)) {
	f.mu.Lock()
	f.kind, f.delay, f.edit, f.fn = FaultFunc, 0, nil, fn
	f.mu.Unlock()
}

func (f *Fault) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	kind, delay, edit, fn := f.kind, f.delay, f.edit, f.fn
	f.mu.Unlock()
	if kind == FaultNone || !strings.HasPrefix(r.URL.Path, f.Prefix) {
		f.Next.ServeHTTP(w, r)
		return
	}
	f.Hits.Add(1)
	// Read the body first: the server notices a client that went away
	// only once the request body is consumed.
	body, _ := io.ReadAll(r.Body)
	r.Body = io.NopCloser(bytes.NewReader(body))
	switch kind {
	case FaultFunc:
		fn(w, r, f.Next)
		return
	case FaultStatus:
		http.Error(w, `{"error":"injected"}`, http.StatusInternalServerError)
		return
	case FaultHang:
		<-r.Context().Done()
		return
	case FaultDrop:
		hj, ok := w.(http.Hijacker)
		if !ok {
			panic("policytest: response writer cannot be hijacked")
		}
		conn, _, err := hj.Hijack()
		if err == nil {
			conn.Close()
		}
		return
	case FaultSlow:
		select {
		case <-time.After(delay):
		case <-r.Context().Done():
			return
		}
		f.Next.ServeHTTP(w, r)
		return
	}
	rec := httptest.NewRecorder()
	f.Next.ServeHTTP(rec, r)
	body = rec.Body.Bytes()
	switch kind {
	case FaultTruncate:
		body = body[:len(body)/2]
	case FaultEdit:
		body = edit(body)
	case FaultLate:
		select {
		case <-time.After(delay):
		case <-r.Context().Done():
			return
		}
	}
	for k, v := range rec.Header() {
		w.Header()[k] = v
	}
	w.Header().Del("Content-Length")
	w.WriteHeader(rec.Code)
	w.Write(body)
}

// ClosedAddr is the URL of a 127.0.0.1 port nothing listens on.
func ClosedAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return "http://" + addr
}

// Equal reports whether two samples are identical: tokens, float32 bits of
// every log-prob, finish reason and version.
func Equal(a, b model.Sample) bool {
	if len(a.Logprobs) != len(b.Logprobs) || !slices.Equal(a.Tokens, b.Tokens) || a.Finish != b.Finish || a.PolicyVersion != b.PolicyVersion {
		return false
	}
	for i := range a.Logprobs {
		if fbits(a.Logprobs[i]) != fbits(b.Logprobs[i]) {
			return false
		}
	}
	return true
}

func fbits(f float32) uint32 { return math.Float32bits(f) }

// Post sends a JSON body and returns the status and body (for calls the
// clients do not make).
func Post(ctx context.Context, url, body string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, "POST", url, bytes.NewReader([]byte(body)))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return res.StatusCode, string(b), err
}

// EditJSON returns a body rewriter for FaultEdit: it decodes the body
// (numbers kept as json.Number, so the rest stays exact), lets edit change
// it, and encodes it again.
func EditJSON(edit func(m map[string]any)) func([]byte) []byte {
	return func(b []byte) []byte {
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.UseNumber()
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			panic(fmt.Sprintf("policytest: edit of a body that is not a JSON object: %v: %s", err, b))
		}
		edit(m)
		out, err := json.Marshal(m)
		if err != nil {
			panic(err)
		}
		return out
	}
}

// Path walks a decoded JSON value: keys of objects, indexes of lists.
func Path(v any, path ...any) any {
	for _, p := range path {
		switch k := p.(type) {
		case string:
			v = v.(map[string]any)[k]
		case int:
			v = v.([]any)[k]
		}
	}
	return v
}

// Get sends a GET and returns the status and body.
func Get(ctx context.Context, url string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", url, nil)
	if err != nil {
		return 0, "", err
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return res.StatusCode, string(b), err
}
