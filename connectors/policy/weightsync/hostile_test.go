package weightsync_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/weightsync"
)

// TestLoadStuckLoading: a llama.cpp router that reports the release
// "loading" for ever fails the load with a timeout InfraError after
// Replica.Timeout, not when the caller gives up (or never).
func TestLoadStuckLoading(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	rel := policytest.Release(t, dir, 1, false)
	fault := &policytest.Fault{Prefix: "/models"}
	srv := policytest.Start(t, policy.LlamaCpp, dir, reg, func(h http.Handler) http.Handler { fault.Next = h; return fault })
	loading := policytest.EditJSON(func(m map[string]any) {
		for _, e := range m["data"].([]any) {
			e.(map[string]any)["status"] = map[string]any{"value": "loading"}
		}
	})
	fault.SetFunc(func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if r.Method == "POST" {
			w.Write([]byte(`{"success": true}`)) // accepted, never loaded
			return
		}
		rec := httptest.NewRecorder()
		next.ServeHTTP(rec, r)
		w.Write(loading(rec.Body.Bytes()))
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	t0 := time.Now()
	_, err := weightsync.Load(ctx, weightsync.Replica{Protocol: policy.LlamaCpp, Addr: srv.URL, Timeout: 300 * time.Millisecond, PollInterval: 10 * time.Millisecond}, rel)
	ie, ok := policy.AsInfra(err)
	if !ok || ie.Reason != policy.ReasonTimeout || ie.Addr != srv.URL || ctx.Err() != nil {
		t.Fatalf("err %v, want a timeout InfraError at %s", err, srv.URL)
	}
	if took := time.Since(t0); took > 10*time.Second {
		t.Fatalf("gave up after %v", took)
	}
}

// TestLoadHostile: weight sync's calls to a replica whose every endpoint
// misbehaves (policytest.HostileCases) fail with an InfraError naming the
// replica, bounded by Replica.Timeout; a redirect is never followed.
func TestLoadHostile(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	rel := policytest.Release(t, dir, 1, false)
	for _, proto := range []string{policy.LlamaCpp, policy.SGLang, policy.VLLM} {
		t.Run(proto, func(t *testing.T) {
			var otherHits atomic.Int64
			other := policytest.Start(t, proto, dir, reg, func(h http.Handler) http.Handler {
				return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { otherHits.Add(1); h.ServeHTTP(w, r) })
			})
			fault := &policytest.Fault{}
			srv := policytest.Start(t, proto, dir, reg, func(h http.Handler) http.Handler { fault.Next = h; return fault })
			for _, hc := range policytest.HostileCases(other.URL) {
				t.Run(hc.Name, func(t *testing.T) {
					fault.SetFunc(hc.Serve)
					defer fault.Set(policytest.FaultNone, 0, nil)
					bound := hc.Timeout + 10*time.Second
					ctx, cancel := context.WithTimeout(context.Background(), 2*bound)
					defer cancel()
					t0 := time.Now()
					_, err := weightsync.Load(ctx, weightsync.Replica{Protocol: proto, Addr: srv.URL, Timeout: hc.Timeout}, rel)
					if errors.Is(err, weightsync.ErrVerify) {
						t.Fatalf("err %v: a broken answer is not a verification", err)
					}
					policytest.CheckHostile(t, hc, srv.URL, err, time.Since(t0), bound)
					if n := otherHits.Load(); n != 0 {
						t.Fatalf("the redirect was followed: %d requests reached %s", n, other.URL)
					}
				})
			}
		})
	}
}
