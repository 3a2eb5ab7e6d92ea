package vllm_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/vllm"
	"github.com/trajflow/trajflow/operators/rollout"
)

func newClient(t testing.TB, addr string, timeout time.Duration, want policy.Want) policy.Client {
	t.Helper()
	c, err := vllm.New(vllm.Config{ClientConfig: policy.ClientConfig{Addr: addr, Timeout: timeout, Want: want}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

func TestExact(t *testing.T) {
	policytest.Exact(t, policy.VLLM, newClient, policytest.RequestOptions{}, nil)
}

func TestFaults(t *testing.T) {
	choice := func(m map[string]any) map[string]any { return m["choices"].([]any)[0].(map[string]any) }
	content := func(m map[string]any) []any { return choice(m)["logprobs"].(map[string]any)["content"].([]any) }
	setLP := func(v any) func(map[string]any) {
		return func(m map[string]any) { content(m)[0].(map[string]any)["logprob"] = v }
	}
	policytest.Faults(t, policy.VLLM, "/inference/v1/generate", "logprob", newClient, []policytest.FaultCase{
		policytest.F("one log-prob too few", func(m map[string]any) {
			c := content(m)
			choice(m)["logprobs"].(map[string]any)["content"] = c[:len(c)-1]
		}, policy.ReasonLengthMismatch),
		policytest.F("positive log-prob", setLP(json.Number("0.5")), policy.ReasonPositiveLogprob),
		policytest.F("clamped log-prob", setLP(json.Number("-9999.0")), policy.ReasonNaNLogprob),
		policytest.F("log-prob below float32's range", setLP(json.Number("-1e300")), policy.ReasonNaNLogprob),
		policytest.F("missing log-prob", func(m map[string]any) { delete(content(m)[0].(map[string]any), "logprob") }, policy.ReasonBadResponse),
		policytest.F("id out of range", func(m map[string]any) {
			choice(m)["token_ids"].([]any)[0] = json.Number("64")
			content(m)[0].(map[string]any)["token"] = "token_id:64"
		}, policy.ReasonTokenRange),
		policytest.F("log-prob of another id", func(m map[string]any) { content(m)[0].(map[string]any)["token"] = "token_id:30" }, policy.ReasonBadResponse),
		policytest.F("no choices", func(m map[string]any) { m["choices"] = []any{} }, policy.ReasonBadResponse),
		policytest.F("aborted", func(m map[string]any) { choice(m)["finish_reason"] = "abort" }, policy.ReasonServerError),
		policytest.F("id after a stop id", func(m map[string]any) {
			choice(m)["token_ids"].([]any)[0] = json.Number("9")
			content(m)[0].(map[string]any)["token"] = "token_id:9"
		}, policy.ReasonAfterStop),
		policytest.F("unknown finish reason", func(m map[string]any) { choice(m)["finish_reason"] = "cancelled" }, policy.ReasonBadResponse),
		policytest.F("finish reason error", func(m map[string]any) { choice(m)["finish_reason"] = "error" }, policy.ReasonServerError),
		policytest.F("more ids than max_tokens", func(m map[string]any) {
			k := json.Number(fmt.Sprint(rollout.TokKey0))
			choice(m)["token_ids"] = append(choice(m)["token_ids"].([]any), k)
			choice(m)["logprobs"].(map[string]any)["content"] = append(content(m), map[string]any{"token": fmt.Sprint("token_id:", k), "logprob": json.Number("-0.5")})
		}, policy.ReasonBadResponse),
		policytest.F("no ids, finish length", func(m map[string]any) {
			choice(m)["token_ids"] = []any{}
			choice(m)["logprobs"].(map[string]any)["content"] = []any{}
			choice(m)["finish_reason"] = "length"
		}, policy.ReasonBadResponse),
		policytest.F("ids as strings", func(m map[string]any) {
			ids := choice(m)["token_ids"].([]any)
			for i, id := range ids {
				ids[i] = fmt.Sprint(id)
			}
		}, policy.ReasonBadResponse),
		policytest.F("log-prob as a string", setLP("-0.5"), policy.ReasonBadResponse),
		policytest.F("missing logprobs", func(m map[string]any) { delete(choice(m), "logprobs") }, policy.ReasonBadResponse),
	})
}

// TestVersionBracket: a weight switch during a batch fails its requests
// with version_mismatch (they may have run on either version), over either
// endpoint; the next batch is served by the new version (over
// /v1/completions, under the new version's model name, which the client
// reads again when the version changes).
func TestVersionBracket(t *testing.T) {
	for _, tc := range []struct {
		name, path string
		newClient  policytest.NewClient
	}{
		{"generate", "/inference/v1/generate", newClient},
		{"completions", "/v1/completions", newCompletionsClient},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := policytest.Registry(t)
			dir := t.TempDir()
			policytest.Release(t, dir, 1, false)
			policytest.Release(t, dir, 2, false)
			var srv *policytest.Server
			switched := make(chan struct{})
			fault := &policytest.Fault{Prefix: tc.path}
			srv = policytest.Start(t, policy.VLLM, dir, reg, func(h http.Handler) http.Handler {
				fault.Next = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					h.ServeHTTP(w, r)
					if r.URL.Path != tc.path {
						return
					}
					select {
					case <-switched:
					default:
						close(switched)
						if err := srv.Load(2); err != nil {
							t.Error(err)
						}
					}
				})
				return fault
			}, 1)
			fault.Set(policytest.FaultSlow, 0, nil)
			c := tc.newClient(t, srv.URL, 5*time.Second, policy.Want{})
			reqs := policytest.Requests(reg, 4, 3, policytest.RequestOptions{})
			got, err := c.Generate(context.Background(), reqs)
			if ie, ok := policy.AsInfra(err); !ok || ie.Reason != policy.ReasonVersionMismatch {
				t.Fatalf("err %v (samples %+v)", err, got)
			}
			s, err := c.Generate(context.Background(), reqs)
			if err != nil || s[0].PolicyVersion != 2 {
				t.Fatalf("after the switch: %+v %v", s, err)
			}
		})
	}
}

func TestLogprobsMode(t *testing.T) {
	if _, err := vllm.New(vllm.Config{ClientConfig: policy.ClientConfig{Addr: "http://127.0.0.1:1"}, LogprobsMode: "raw_logprobs"}); !errors.Is(err, policy.ErrConfig) {
		t.Fatalf("raw_logprobs accepted: %v", err)
	}
	// A server that reports another mode is refused at its identity.
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	fault := &policytest.Fault{Prefix: "/server_info"}
	srv := policytest.Start(t, policy.VLLM, dir, reg, func(h http.Handler) http.Handler { fault.Next = h; return fault }, 1)
	fault.Set(policytest.FaultEdit, 0, policytest.EditJSON(func(m map[string]any) {
		delete(m, "logprobs_mode")
		m["vllm_config"] = "model='x', logprobs_mode='raw_logprobs', seed=0"
	}))
	c := newClient(t, srv.URL, time.Second, policy.Want{})
	if _, err := c.Identity(context.Background()); !errors.Is(err, policy.ErrConfig) {
		t.Fatalf("identity of a raw_logprobs server: %v", err)
	}
}

func TestTokenizer(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	srv := policytest.Start(t, policy.VLLM, dir, reg, nil, 1)
	c := newClient(t, srv.URL, time.Second, policy.Want{}).(*vllm.Client)
	ctx := context.Background()
	ids, err := c.Tokenize(ctx, "ANS V3 END")
	if err != nil || len(ids) != 3 || ids[0] != rollout.TokAns || ids[1] != rollout.TokVal0+3 {
		t.Fatalf("tokenize: %v %v", ids, err)
	}
	if text, err := c.Detokenize(ctx, ids); err != nil || text != "ANS V3 END" {
		t.Fatalf("detokenize: %q %v", text, err)
	}
	if _, err := c.ApplyTemplate(ctx, nil, true); !errors.Is(err, policy.ErrNotOffered) {
		t.Fatalf("apply template: %v", err)
	}
}

func FuzzGenerate(f *testing.F) {
	policytest.FuzzGenerate(f, policy.VLLM, "/inference/v1/generate", newClient)
}

// TestHostile: a server that misbehaves at the HTTP level (oversized,
// stalled or endless bodies, 429/503, redirects, garbage encodings) gets
// an InfraError naming it, on the generation endpoint and on the info
// endpoints.
func TestHostile(t *testing.T) {
	policytest.Hostile(t, policy.VLLM, "/inference/v1/generate", newClient)
}
