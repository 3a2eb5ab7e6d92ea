package policytest

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// HostileCase is one way a server misbehaves at the HTTP level, and the
// InfraError a client must return for it.
type HostileCase struct {
	Name string
	// Serve answers a request instead of the real server (next).
	Serve  func(w http.ResponseWriter, r *http.Request, next http.Handler)
	Reason string
	// Status is the HTTP status the InfraError must carry (0: not checked).
	Status int
	// Detail must appear in the error's text ("" : not checked).
	Detail string
	// Timeout is the client's per-request timeout for the case.
	Timeout time.Duration
}

// HugeBody is the size of the HostileCases' oversized body: over the
// clients' 64 MiB bound.
const HugeBody = 100 << 20

// HostileCases are the HTTP-level misbehaviours every client must turn
// into an InfraError naming the server: a 100 MB body, headers then a
// stall, a body that never ends, 429 and 503 with Retry-After, a redirect
// to other (a URL prefix of a server that would answer; it must not be
// asked), gzip-encoded garbage, a body shorter than its Content-Length,
// HTML, an empty 200.
func HostileCases(other string) []HostileCase {
	return []HostileCase{
		{Name: "100 MB body", Reason: policy.ReasonBadResponse, Detail: "body over", Timeout: 20 * time.Second,
			Serve: func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusOK)
				chunk := bytes.Repeat([]byte(" "), 1<<20)
				if _, err := w.Write([]byte(`{"pad": "`)); err != nil {
					return
				}
				for n := 0; n < HugeBody; n += len(chunk) {
					if _, err := w.Write(chunk); err != nil {
						return // the client stopped reading
					}
				}
				w.Write([]byte(`"}`))
			}},
		{Name: "headers then a stall", Reason: policy.ReasonTimeout, Timeout: 500 * time.Millisecond,
			Serve: func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusOK)
				w.Write([]byte(`{"output_ids": [`))
				w.(http.Flusher).Flush()
				<-r.Context().Done()
			}},
		{Name: "a body that never ends", Reason: policy.ReasonTimeout, Timeout: 500 * time.Millisecond,
			Serve: func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusOK)
				w.Write([]byte(`{"pad": "`))
				for {
					if _, err := w.Write([]byte("a")); err != nil {
						return
					}
					w.(http.Flusher).Flush()
					select {
					case <-r.Context().Done():
						return
					case <-time.After(5 * time.Millisecond):
					}
				}
			}},
		{Name: "429 with Retry-After", Reason: policy.ReasonRejected, Status: http.StatusTooManyRequests, Detail: `Retry-After "3"`, Timeout: time.Second,
			Serve: func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
				w.Header().Set("Retry-After", "3")
				http.Error(w, `{"error": "too many requests"}`, http.StatusTooManyRequests)
			}},
		{Name: "503 with Retry-After", Reason: policy.ReasonServerError, Status: http.StatusServiceUnavailable, Detail: `Retry-After "1"`, Timeout: time.Second,
			Serve: func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
				w.Header().Set("Retry-After", "1")
				http.Error(w, `{"error": "overloaded"}`, http.StatusServiceUnavailable)
			}},
		{Name: "redirect to another host", Reason: policy.ReasonBadResponse, Status: http.StatusTemporaryRedirect, Detail: other, Timeout: time.Second,
			Serve: func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
				http.Redirect(w, r, other+r.URL.RequestURI(), http.StatusTemporaryRedirect)
			}},
		{Name: "gzip-encoded garbage", Reason: policy.ReasonBadResponse, Timeout: time.Second,
			Serve: func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set("Content-Encoding", "gzip")
				w.WriteHeader(http.StatusOK)
				w.Write([]byte("\x1f\x8b\x08\x00garbage that is not deflate data"))
			}},
		{Name: "body shorter than its Content-Length", Reason: policy.ReasonBadResponse, Timeout: time.Second,
			Serve: func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set("Content-Length", "1000")
				w.WriteHeader(http.StatusOK)
				w.Write([]byte(`{"output_ids": [1, 2`))
			}},
		{Name: "HTML", Reason: policy.ReasonBadResponse, Timeout: time.Second,
			Serve: func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
				w.Header().Set("Content-Type", "text/html")
				w.Write([]byte("<html><body>gateway login</body></html>"))
			}},
		{Name: "empty 200", Reason: policy.ReasonBadResponse, Timeout: time.Second,
			Serve: func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
				w.WriteHeader(http.StatusOK)
			}},
	}
}

// HostileRequest is the request the hostile suites send.
func HostileRequest(reg *rollout.Registry) []model.Request {
	return []model.Request{{
		Context: []int32{rollout.TokBOS, rollout.TokTask, rollout.TokKey0, rollout.TokAct},
		Settings: model.Settings{Behavior: model.Behavior{Temperature: 1, Grammar: reg.Grammar()}, MaxTokens: 3,
			Stop: []int32{rollout.TokEnd}},
		Seed: 7, ID: "turn-7",
	}}
}

// CheckHostile checks that err is an InfraError of hc's reason (and
// status and detail) naming addr, and that it came within bound.
func CheckHostile(t testing.TB, hc HostileCase, addr string, err error, took, bound time.Duration) {
	t.Helper()
	ie, ok := policy.AsInfra(err)
	switch {
	case !ok:
		t.Fatalf("err %v, want an InfraError %s", err, hc.Reason)
	case ie.Reason != hc.Reason || ie.Addr != addr:
		t.Fatalf("err %v, want an InfraError %s at %s", err, hc.Reason, addr)
	case hc.Status != 0 && ie.Status != hc.Status:
		t.Fatalf("err %v: status %d, want %d", err, ie.Status, hc.Status)
	case hc.Detail != "" && !strings.Contains(err.Error(), hc.Detail):
		t.Fatalf("err %v: want %q in it", err, hc.Detail)
	case !strings.Contains(err.Error(), addr):
		t.Fatalf("err %v does not name %s", err, addr)
	case errors.Is(err, context.DeadlineExceeded) && hc.Reason != policy.ReasonTimeout:
		t.Fatalf("err %v: the caller's deadline passed", err)
	case took > bound:
		t.Fatalf("answered after %v, bound %v", took, bound)
	}
}

// Hostile points a client of protocol at a server that misbehaves in each
// of the HostileCases, on the generation endpoint path (with the
// identity already fetched) and on every endpoint (a fresh client, so the
// info endpoints meet it first), and checks the InfraError it returns,
// within the case's timeout and a bound, under a caller's deadline that
// keeps a regression from hanging. The redirect's target, a healthy server
// of the same protocol, must not be asked.
func Hostile(t *testing.T, protocol, path string, newClient NewClient) {
	reg := Registry(t)
	dir := t.TempDir()
	Release(t, dir, 1, false)
	var otherHits atomic.Int64
	other := Start(t, protocol, dir, reg, func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			otherHits.Add(1)
			h.ServeHTTP(w, r)
		})
	}, 1)
	fault := &Fault{}
	srv := Start(t, protocol, dir, reg, func(h http.Handler) http.Handler { fault.Next = h; return fault }, 1)
	req := HostileRequest(reg)
	for _, hc := range HostileCases(other.URL) {
		for _, every := range []bool{false, true} {
			name := hc.Name + " on " + path
			if every {
				name = hc.Name + " on every endpoint"
			}
			t.Run(name, func(t *testing.T) {
				c := newClient(t, srv.URL, hc.Timeout, policy.Want{Version: 1})
				if !every {
					if _, err := c.Identity(context.Background()); err != nil {
						t.Fatal(err)
					}
				}
				fault.SetFunc(func(w http.ResponseWriter, r *http.Request, next http.Handler) {
					if every || r.URL.Path == path {
						hc.Serve(w, r, next)
						return
					}
					next.ServeHTTP(w, r)
				})
				defer fault.Set(FaultNone, 0, nil)
				hits := otherHits.Load()
				bound := hc.Timeout + 10*time.Second
				ctx, cancel := context.WithTimeout(context.Background(), 2*bound)
				defer cancel()
				t0 := time.Now()
				_, err := c.Generate(ctx, req)
				CheckHostile(t, hc, srv.URL, err, time.Since(t0), bound)
				if n := otherHits.Load() - hits; n != 0 {
					t.Fatalf("the redirect was followed: %d requests reached %s", n, other.URL)
				}
			})
		}
	}
}
