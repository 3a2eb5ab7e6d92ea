package loop_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy/serve"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// faulty is an SGLang-protocol policy server (the built-in policy,
// connectors/policy/serve) whose first `first` generation requests after
// arm fail with one fault.
type faulty struct {
	next  http.Handler
	kind  string
	first int64
	n     atomic.Int64
	armed atomic.Bool
}

// Faults of a policy server, at the run level.
const (
	faultDown      = "down"      // the connection is closed before an answer
	faultSlow      = "slow"      // the answer comes after the client's timeout
	fault500       = "500"       // HTTP 500
	faultTruncated = "truncated" // the JSON answer is cut in half
	faultLengths   = "lengths"   // one log-prob fewer than ids
	faultNaN       = "nan"       // a NaN log-prob
	faultVersion   = "version"   // another weight version than the one wanted
	faultNone      = ""
)

func (f *faulty) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/generate" || !f.armed.Load() || f.n.Add(1) > f.first {
		f.next.ServeHTTP(w, r)
		return
	}
	switch f.kind {
	case faultDown:
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close()
		}
		return
	case faultSlow:
		select {
		case <-time.After(3 * time.Second):
		case <-r.Context().Done():
		}
		return
	case fault500:
		http.Error(w, `{"error":"injected"}`, http.StatusInternalServerError)
		return
	}
	rec := httptest.NewRecorder()
	f.next.ServeHTTP(rec, r)
	body := rec.Body.Bytes()
	switch f.kind {
	case faultTruncated:
		body = body[:len(body)/2]
	case faultNaN:
		// The first log-prob becomes the literal NaN (not JSON: what a
		// server printing a C++ NaN writes).
		key := []byte(`"output_token_logprobs":[[`)
		if i := bytes.Index(body, key); i >= 0 {
			j := i + len(key)
			k := j + bytes.IndexByte(body[j:], ',')
			body = append(append(append([]byte{}, body[:j]...), "NaN"...), body[k:]...)
		}
	case faultLengths, faultVersion:
		var m map[string]any
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.UseNumber()
		if err := dec.Decode(&m); err == nil {
			meta := m["meta_info"].(map[string]any)
			lps := meta["output_token_logprobs"].([]any)
			if f.kind == faultLengths {
				meta["output_token_logprobs"] = lps[:len(lps)-1]
			} else {
				meta["weight_version"] = "7"
			}
			body, _ = json.Marshal(m)
		}
	}
	for k, v := range rec.Header() {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.Code)
	w.Write(body)
}

// startServed starts n SGLang-protocol policy servers over the releases
// directory of the demo output out, each wrapped by wrap (nil: none), and
// returns their URLs and servers.
func startServed(t *testing.T, out string, n int, wrap func(i int, h http.Handler) http.Handler) ([]string, []*httptest.Server) {
	t.Helper()
	releases := filepath.Join(out, "releases")
	if err := os.MkdirAll(releases, 0o755); err != nil {
		t.Fatal(err)
	}
	reg, err := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	if err != nil {
		t.Fatal(err)
	}
	var urls []string
	var srvs []*httptest.Server
	for i := range n {
		srv, err := serve.New(serve.Config{Protocol: contract.PolicySGLang, Releases: releases, Grammar: reg.Grammar()})
		if err != nil {
			t.Fatal(err)
		}
		var h http.Handler = srv
		if wrap != nil {
			h = wrap(i, h)
		}
		hs := httptest.NewServer(h)
		t.Cleanup(hs.Close)
		urls = append(urls, hs.URL)
		srvs = append(srvs, hs)
	}
	return urls, srvs
}

func servedOptions(t *testing.T, out string, urls []string, updates int) loop.Options {
	t.Helper()
	p := contract.Policy{Protocol: contract.PolicySGLang, Endpoints: urls, TimeoutMS: 2000}
	return loop.Options{Updates: updates, Seed: 1, Out: out, EvalSamples: 1, Quiet: true, Policy: p}
}

// runDemo runs the loop and checks that nothing was lost or admitted
// twice.
func runDemo(t *testing.T, o loop.Options) *loop.Summary {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s, err := loop.Run(ctx, o, io.Discard)
	if err != nil {
		t.Fatalf("demo: %v", err)
	}
	if s.Lost != 0 || s.DuplicatesAdmitted != 0 || s.AttemptsLaunched != o.Updates*16*16 {
		t.Fatalf("launched %d, lost %d, duplicates %d", s.AttemptsLaunched, s.Lost, s.DuplicatesAdmitted)
	}
	return s
}

// TestPolicyFaultsRetried: a policy server that is down, slow, answers
// 500, truncated JSON, ids and log-probs of different lengths, a NaN
// log-prob, or another weight version than the group wants: each is an
// infrastructure failure of the groups it hit, counted in the census by
// its reason (policy_<reason>), retried under the next attempt number,
// never a task failure (no quarantine, nothing lost, nothing admitted
// twice).
func TestPolicyFaultsRetried(t *testing.T) {
	for _, tc := range []struct{ kind, reason string }{
		{faultDown, "policy_unreachable"},
		{faultSlow, "policy_timeout"},
		{fault500, "policy_server_error"},
		{faultTruncated, "policy_bad_response"},
		{faultLengths, "policy_length_mismatch"},
		{faultNaN, "policy_nan_logprob"},
		{faultVersion, "policy_version_mismatch"},
	} {
		t.Run(tc.kind, func(t *testing.T) {
			out := t.TempDir()
			f := &faulty{kind: tc.kind, first: 2}
			f.armed.Store(true)
			urls, _ := startServed(t, out, 1, func(_ int, h http.Handler) http.Handler { f.next = h; return f })
			s := runDemo(t, servedOptions(t, out, urls, 1))
			if s.Quarantined != 0 || s.InfraRetries[tc.reason] == 0 {
				t.Fatalf("quarantined %d, infrastructure retries %v: want the %s failures retried", s.Quarantined, s.InfraRetries, tc.reason)
			}
			for r := range s.InfraRetries {
				if r != tc.reason {
					t.Fatalf("retries for %s besides %s: %v", r, tc.reason, s.InfraRetries)
				}
			}
			t.Logf("%s: %d faulty answers; retried tries %v; admitted %d, filtered %d", tc.kind, f.first, s.InfraRetries, s.TrajectoriesAdmitted, s.TrajectoriesFiltered)
		})
	}
}

// TestPolicyReplicaKilled: two replicas behind the gateway; one is killed
// (its listener closed and its connections dropped) during the first
// round. The run completes with nothing lost or admitted twice; the
// gateway sends the dead replica's requests to the other one, with the
// same seeds, so the batches are still those of the in-process demo.
func TestPolicyReplicaKilled(t *testing.T) {
	const updates = 2
	want := testkit.Demo(t, loop.Options{Updates: updates, Seed: 1})
	out := t.TempDir()
	var served atomic.Int64
	var once sync.Once
	var victim *httptest.Server
	kill := make(chan struct{})
	urls, srvs := startServed(t, out, 2, func(i int, h http.Handler) http.Handler {
		if i != 0 {
			return h
		}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/generate" && served.Add(1) == 40 {
				once.Do(func() { close(kill) })
			}
			h.ServeHTTP(w, r)
		})
	})
	victim = srvs[0]
	go func() {
		<-kill
		victim.Listener.Close() // whatever connects afterwards is refused
		victim.CloseClientConnections()
	}()
	s := runDemo(t, servedOptions(t, out, urls, updates))
	select {
	case <-kill:
	default:
		t.Fatal("the replica was never killed: it served fewer than 40 requests")
	}
	t.Logf("killed after %d requests; stage retries %v; admitted %d", served.Load(), s.InfraRetries, s.TrajectoriesAdmitted)
	if len(s.InfraRetries) == 0 && !reflect.DeepEqual(s.BatchHashes, want.BatchHashes) {
		t.Fatalf("no group was retried, yet the batches differ from the in-process demo:\n%v\n%v", s.BatchHashes, want.BatchHashes)
	}
	if strings.Join(s.BatchHashes, "") == "" {
		t.Fatal("no batch")
	}
}
