package envsvc

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/trajflow/trajflow/connectors/env/capability"
	"github.com/trajflow/trajflow/connectors/state"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

var testKey = bytes.Repeat([]byte{7}, capability.KeySize)

// registries are the default registries of every family.
func registries(t testing.TB) []*rollout.Registry {
	t.Helper()
	var out []*rollout.Registry
	for _, f := range rollout.Families() {
		r, err := rollout.NewFamilyRegistry(f)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	return out
}

func family(regs []*rollout.Registry, f string) *rollout.Registry {
	for _, r := range regs {
		if r.Family() == f {
			return r
		}
	}
	return nil
}

type service struct {
	srv *Server
	hs  *httptest.Server
	url string
}

// startService runs a Server on 127.0.0.1 (httptest) until the test ends.
func startService(t testing.TB, cfg Config) *service {
	t.Helper()
	if cfg.Key == nil {
		cfg.Key = testKey
	}
	if cfg.Registries == nil {
		cfg.Registries = registries(t)
	}
	srv, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	s := &service{srv: srv, hs: hs, url: hs.URL}
	t.Cleanup(func() {
		hs.Close()
		srv.Close()
	})
	return s
}

func openStore(t testing.TB, dir string, sync bool) *state.Store {
	t.Helper()
	st, err := state.Open(dir, state.Options{SyncWrites: sync})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func newClient(t testing.TB, urls []string, o Options) *Client {
	t.Helper()
	c, err := New(urls, testKey, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func fixedLimits() rollout.Limits {
	l := rollout.DefaultLimits()
	l.Now = func() time.Time { return time.Unix(1700000000, 0) }
	return l
}

func randomPolicy(t testing.TB, seed uint64) *model.Policy {
	t.Helper()
	m, err := model.New(model.Config{Vocab: rollout.VocabSize, Window: 12, Embed: 16, Hidden: 64}, seed)
	if err != nil {
		t.Fatal(err)
	}
	return model.NewPolicy(m, 3)
}

func attempts(tasks []rollout.Task, g int32, attempt int32) []schemas.TaskAttempt {
	var out []schemas.TaskAttempt
	for i, task := range tasks {
		for _, a := range rollout.Attempts("run", task, int64(i), g, 7, 0, "contract") {
			if attempt > 0 {
				a.Attempt = attempt
				a.AttemptID = schemas.AttemptID(a.RunID, a.TaskID, a.GroupID, a.Member, attempt)
			}
			out = append(out, a)
		}
	}
	return out
}

// raw speaks the protocol by hand, for tests of the service's answers.
type raw struct {
	t   testing.TB
	url string
	iss *capability.Issuer
	now func() time.Time
}

func newRaw(t testing.TB, url string, ttl time.Duration, now func() time.Time) *raw {
	iss, err := capability.NewIssuer(testKey, "run", ttl, now)
	if err != nil {
		t.Fatal(err)
	}
	return &raw{t: t, url: url, iss: iss, now: now}
}

func (r *raw) post(path string, req, out any) int {
	r.t.Helper()
	b, _ := json.Marshal(req)
	return r.postRaw(path, string(b), out)
}

// postRaw posts body as it is and decodes the answer into out.
func (r *raw) postRaw(path, body string, out any) int {
	r.t.Helper()
	resp, err := http.Post(r.url+path, "application/json", strings.NewReader(body))
	if err != nil {
		r.t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(data, out); err != nil {
		r.t.Fatalf("%s: %v: %s", path, err, data)
	}
	return resp.StatusCode
}

func (r *raw) allocate(a schemas.TaskAttempt, key string, leaseMS int64) AllocateResponse {
	var out AllocateResponse
	r.post(PathEpisodes, AllocateRequest{Protocol: 1, Attempt: a, IdempotencyKey: key, LeaseMS: leaseMS,
		Token: r.iss.Issue(AllocateScope(a), 0, AllocateAction(a, key))}, &out)
	return out
}

func (r *raw) stepReq(id string, seq uint64, key string, turn int32, ids ...int32) StepRequest {
	return r.stepReqOf(id, seq, key, turn, rollout.EnvAction{IDs: ids})
}

// stepReqOf is stepReq of any action (a text family's text).
func (r *raw) stepReqOf(id string, seq uint64, key string, turn int32, a rollout.EnvAction) StepRequest {
	return StepRequest{Protocol: 1, Seq: seq, IdempotencyKey: key, Turn: turn, Action: a, Token: r.iss.Issue(id, seq, StepAction(turn, a))}
}

func (r *raw) send(path, id string, req any) StepResponse {
	var out StepResponse
	r.post(strings.Replace(path, "{id}", id, 1), req, &out)
	return out
}

func (r *raw) terminate(id, reason string) TerminateResponse {
	var out TerminateResponse
	r.post(strings.Replace(PathTerminate, "{id}", id, 1), TerminateRequest{Protocol: 1, Reason: reason, Token: r.iss.Issue(id, 0, TerminateAction)}, &out)
	return out
}

func (r *raw) renew(id string, ms int64) RenewResponse {
	var out RenewResponse
	r.post(strings.Replace(PathRenew, "{id}", id, 1), RenewRequest{Protocol: 1, LeaseMS: ms, Token: r.iss.Issue(id, 0, RenewAction)}, &out)
	return out
}

// clock is a settable clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// encode is the Arrow IPC encoding of trajectories: "byte-identical" is
// equality of these bytes.
func encode(t testing.TB, trajs []schemas.Trajectory) []byte {
	t.Helper()
	b, err := schemas.Trajectories.Encode(nil, trajs)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// value reads a counter or gauge.
func value(m prometheus.Metric) float64 {
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		panic(err)
	}
	if d.Counter != nil {
		return d.Counter.GetValue()
	}
	return d.Gauge.GetValue()
}
