package vllm_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/vllm"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// noGenerate is a client transport that answers POST
// /inference/v1/generate 404 itself, as a vLLM server without the
// token-in/token-out endpoint does, and passes every other call on.
type noGenerate struct {
	next http.RoundTripper
	hits atomic.Int64
}

func (t *noGenerate) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Path != "/inference/v1/generate" {
		return t.next.RoundTrip(r)
	}
	t.hits.Add(1)
	if r.Body != nil {
		r.Body.Close()
	}
	return &http.Response{
		StatusCode: http.StatusNotFound, Status: "404 Not Found", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{"Content-Type": {"application/json"}}, Body: io.NopCloser(strings.NewReader(`{"detail":"Not Found"}`)), Request: r,
	}, nil
}

func (t *noGenerate) CloseIdleConnections() {
	if c, ok := t.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// newCompletionsClient is a client whose server has no POST
// /inference/v1/generate: it generates by POST /v1/completions.
func newCompletionsClient(t testing.TB, addr string, timeout time.Duration, want policy.Want) policy.Client {
	t.Helper()
	hc := &http.Client{Transport: &noGenerate{next: http.DefaultTransport.(*http.Transport).Clone()}}
	c, err := vllm.New(vllm.Config{ClientConfig: policy.ClientConfig{Addr: addr, Timeout: timeout, Want: want, HTTP: hc}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// TestExactCompletions: over POST /v1/completions the client returns the
// in-process policy's samples bit for bit (seeds over the whole 64-bit
// range, half of them sent as negative int64s).
func TestExactCompletions(t *testing.T) {
	policytest.Exact(t, policy.VLLM, newCompletionsClient, policytest.RequestOptions{}, nil)
}

// TestCompletionsFallback: behind a handler that answers 404 for POST
// /inference/v1/generate only, the client switches to POST /v1/completions
// once and stays there, its samples are those the generate endpoint gives
// for the same requests (tokens and log-prob bits), its identity records
// the endpoint, and its sampler ids are those of a generate client.
func TestCompletionsFallback(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, true)
	plain := policytest.Start(t, policy.VLLM, dir, reg, nil, 1)
	var generateHits, completionHits atomic.Int64
	hidden := policytest.Start(t, policy.VLLM, dir, reg, func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/inference/v1/generate":
				generateHits.Add(1)
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusNotFound)
				w.Write([]byte(`{"detail":"Not Found"}`))
				return
			case "/v1/completions":
				completionHits.Add(1)
			}
			h.ServeHTTP(w, r)
		})
	}, 1)
	ctx := context.Background()
	viaGenerate := newClient(t, plain.URL, 10*time.Second, policy.Exactly(1))
	viaCompletions := newClient(t, hidden.URL, 10*time.Second, policy.Exactly(1))
	if id, err := viaCompletions.Identity(ctx); err != nil || id.Endpoint != "POST /inference/v1/generate" {
		t.Fatalf("identity before any generation: %+v %v", id, err)
	}
	first := policytest.Requests(reg, 1, 11, policytest.RequestOptions{})
	if _, err := viaCompletions.Generate(ctx, first); err != nil {
		t.Fatal(err)
	}
	if n := generateHits.Load(); n != 1 {
		t.Fatalf("%d calls of /inference/v1/generate for one request, want 1", n)
	}
	reqs := policytest.Requests(reg, 200, 12, policytest.RequestOptions{})
	want, err := viaGenerate.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	got, err := viaCompletions.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i := range reqs {
		if !policytest.Equal(got[i], want[i]) {
			t.Fatalf("request %d (seed %d): /v1/completions %+v, /inference/v1/generate %+v", i, reqs[i].Seed, got[i], want[i])
		}
	}
	if n := generateHits.Load(); n != 1 {
		t.Fatalf("/inference/v1/generate asked %d times: the fallback is not remembered", n)
	}
	if n := completionHits.Load(); n != int64(1+len(reqs)) {
		t.Fatalf("%d calls of /v1/completions, want %d", n, 1+len(reqs))
	}
	idG, err := viaGenerate.Identity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	idC, err := viaCompletions.Identity(ctx)
	if err != nil || idC.Endpoint != "POST /v1/completions" || idG.Endpoint != "POST /inference/v1/generate" {
		t.Fatalf("endpoints: generate client %q, completions client %+v %v", idG.Endpoint, idC, err)
	}
	for _, r := range reqs[:10] {
		if a, b := viaGenerate.SamplerID(r.Settings), viaCompletions.SamplerID(r.Settings); a != b {
			t.Fatalf("sampler ids differ by endpoint: %s, %s", a, b)
		}
	}
}

func TestCompletionsFaults(t *testing.T) {
	choice := func(m map[string]any) map[string]any { return m["choices"].([]any)[0].(map[string]any) }
	logprobs := func(m map[string]any) map[string]any { return choice(m)["logprobs"].(map[string]any) }
	lps := func(m map[string]any) []any { return logprobs(m)["token_logprobs"].([]any) }
	setLP := func(v any) func(map[string]any) {
		return func(m map[string]any) { lps(m)[0] = v }
	}
	setID := func(id int) func(map[string]any) {
		return func(m map[string]any) {
			choice(m)["token_ids"].([]any)[0] = json.Number(fmt.Sprint(id))
			logprobs(m)["tokens"].([]any)[0] = fmt.Sprint("token_id:", id)
		}
	}
	policytest.Faults(t, policy.VLLM, "/v1/completions", "token_logprobs", newCompletionsClient, []policytest.FaultCase{
		policytest.F("one log-prob too few", func(m map[string]any) { l := lps(m); logprobs(m)["token_logprobs"] = l[:len(l)-1] }, policy.ReasonLengthMismatch),
		policytest.F("positive log-prob", setLP(json.Number("0.5")), policy.ReasonPositiveLogprob),
		policytest.F("clamped log-prob", setLP(json.Number("-9999.0")), policy.ReasonNaNLogprob),
		policytest.F("null log-prob", setLP(nil), policy.ReasonBadResponse),
		policytest.F("log-prob as a string", setLP("-0.5"), policy.ReasonBadResponse),
		policytest.F("id out of range", setID(64), policy.ReasonTokenRange),
		policytest.F("id after a stop id", setID(9), policy.ReasonAfterStop),
		policytest.F("a token of another id", func(m map[string]any) { logprobs(m)["tokens"].([]any)[0] = "token_id:30" }, policy.ReasonBadResponse),
		policytest.F("no token_ids nor tokens", func(m map[string]any) { delete(choice(m), "token_ids"); delete(logprobs(m), "tokens") }, policy.ReasonBadResponse),
		policytest.F("no logprobs", func(m map[string]any) { choice(m)["logprobs"] = nil }, policy.ReasonBadResponse),
		policytest.F("two choices", func(m map[string]any) { m["choices"] = append(m["choices"].([]any), choice(m)) }, policy.ReasonBadResponse),
		policytest.F("aborted", func(m map[string]any) { choice(m)["finish_reason"] = "abort" }, policy.ReasonServerError),
		policytest.F("finish reason error", func(m map[string]any) { choice(m)["finish_reason"] = "error" }, policy.ReasonServerError),
		policytest.F("unknown finish reason", func(m map[string]any) { choice(m)["finish_reason"] = "cancelled" }, policy.ReasonBadResponse),
		policytest.F("more ids than max_tokens", func(m map[string]any) {
			k := json.Number(fmt.Sprint(rollout.TokKey0))
			choice(m)["token_ids"] = append(choice(m)["token_ids"].([]any), k)
			logprobs(m)["tokens"] = append(logprobs(m)["tokens"].([]any), fmt.Sprint("token_id:", k))
			logprobs(m)["token_logprobs"] = append(lps(m), json.Number("-0.5"))
		}, policy.ReasonBadResponse),
	})
}

// fakeVLLM is a vLLM server without /inference/v1/generate whose
// /v1/completions answers body; it keeps the last completions request.
func fakeVLLM(t *testing.T, body string) (*httptest.Server, *atomic.Value) {
	t.Helper()
	var last atomic.Value
	mux := http.NewServeMux()
	answer := func(path, s string) {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Write([]byte(s))
		})
	}
	answer("GET /version", `{"version":"0.11.0"}`)
	answer("GET /v1/models", `{"object":"list","data":[{"id":"org/model","root":"/models/m"}]}`)
	answer("GET /weight_info", `{"weight_version":"3"}`)
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		last.Store(string(b))
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(body))
	})
	srv := httptest.NewServer(mux) // anything else, /inference/v1/generate and /server_info among them: 404
	t.Cleanup(srv.Close)
	return srv, &last
}

// TestCompletionsAnswers: answers of POST /v1/completions, as a vLLM
// server writes them or not: ids read from token_ids or, without them,
// from "token_id:N" tokens; every malformed answer an InfraError naming
// the field.
func TestCompletionsAnswers(t *testing.T) {
	choice := func(fields string) string {
		return `{"id":"cmpl-1","object":"text_completion","created":1,"model":"org/model","choices":[{"index":0,"text":"a b",` + fields + `}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}`
	}
	const lp = `"logprobs":{"tokens":["token_id:4","token_id:9"],"token_logprobs":[-0.5,-0.25],"top_logprobs":[{"token_id:4":-0.5},{"token_id:9":-0.25}],"text_offset":[0,2]}`
	cases := []struct {
		name, body string
		reason     string // "" : a sample
		field      string // named by the error
	}{
		{"token_ids and tokens", choice(`"token_ids":[4,9],` + lp + `,"finish_reason":"stop","stop_reason":9`), "", ""},
		{"ids from tokens (no return_token_ids)", choice(lp + `,"finish_reason":"stop"`), "", ""},
		{"length", choice(`"token_ids":[4,5,6],"logprobs":{"tokens":["token_id:4","token_id:5","token_id:6"],"token_logprobs":[-1,-2,-3]},"finish_reason":"length"`), "", ""},
		{"missing token_ids and logprobs", choice(`"finish_reason":"stop"`), policy.ReasonBadResponse, "choices[0].token_ids"},
		{"missing token_ids, text tokens", choice(`"logprobs":{"tokens":["a","b"],"token_logprobs":[-0.5,-0.25]},"finish_reason":"stop"`), policy.ReasonBadResponse, "choices[0].logprobs.tokens[0]"},
		{"malformed token id", choice(`"logprobs":{"tokens":["token_id:4","token_id:x"],"token_logprobs":[-0.5,-0.25]},"finish_reason":"stop"`), policy.ReasonBadResponse, "choices[0].logprobs.tokens[1]"},
		{"disagreeing ids", choice(`"token_ids":[4,8],` + lp + `,"finish_reason":"stop"`), policy.ReasonBadResponse, "choices[0].logprobs.tokens[1]"},
		{"missing token_logprobs", choice(`"token_ids":[4,9],"logprobs":{"tokens":["token_id:4","token_id:9"]},"finish_reason":"stop"`), policy.ReasonBadResponse, "choices[0].logprobs.token_logprobs"},
		{"null log-prob", choice(`"token_ids":[4,9],"logprobs":{"tokens":["token_id:4","token_id:9"],"token_logprobs":[null,-0.25]},"finish_reason":"stop"`), policy.ReasonBadResponse, "choices[0].logprobs.token_logprobs[0]"},
		{"NaN log-prob", choice(`"token_ids":[4,9],"logprobs":{"tokens":["token_id:4","token_id:9"],"token_logprobs":[NaN,-0.25]},"finish_reason":"stop"`), policy.ReasonNaNLogprob, "/v1/completions"},
		{"clamped log-prob", choice(`"token_ids":[4,9],"logprobs":{"tokens":["token_id:4","token_id:9"],"token_logprobs":[-0.5,-9999.0]},"finish_reason":"stop"`), policy.ReasonNaNLogprob, "choices[0].logprobs.token_logprobs[1]"},
		{"tokens and log-probs of different lengths", choice(`"token_ids":[4,9],"logprobs":{"tokens":["token_id:4","token_id:9"],"token_logprobs":[-0.5]},"finish_reason":"stop"`), policy.ReasonLengthMismatch, "choices[0].logprobs.token_logprobs"},
		{"ids and log-probs of different lengths", choice(`"token_ids":[4,9],"logprobs":{"token_logprobs":[-0.5]},"finish_reason":"stop"`), policy.ReasonLengthMismatch, "choices[0].token_ids"},
		{"two choices", `{"choices":[{"index":0,"token_ids":[4,9],` + lp + `,"finish_reason":"stop"},{"index":1,"token_ids":[4,9],` + lp + `,"finish_reason":"stop"}]}`, policy.ReasonBadResponse, "choices"},
		{"no choices", `{"choices":[]}`, policy.ReasonBadResponse, "choices"},
		{"missing finish_reason", choice(`"token_ids":[4,9],` + lp), policy.ReasonBadResponse, "choices[0].finish_reason"},
		{"unknown finish_reason", choice(`"token_ids":[4,9],` + lp + `,"finish_reason":"cancelled"`), policy.ReasonBadResponse, "choices[0].finish_reason"},
		{"stop without a stop id", choice(`"token_ids":[4,5],"logprobs":{"tokens":["token_id:4","token_id:5"],"token_logprobs":[-1,-2]},"finish_reason":"stop"`), policy.ReasonBadResponse, "choices[0].token_ids"},
		{"aborted", choice(`"token_ids":[],"logprobs":null,"finish_reason":"abort"`), policy.ReasonServerError, "aborted"},
		{"finish reason error", choice(`"token_ids":[4],` + lp + `,"finish_reason":"error"`), policy.ReasonServerError, "choices[0].finish_reason"},
	}
	req := []model.Request{{Context: []int32{1, 2, 3}, Settings: model.Settings{Behavior: model.Behavior{Temperature: 1}, MaxTokens: 3, Stop: []int32{9}},
		Seed: 1<<63 + 5, ID: "r"}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			srv, last := fakeVLLM(t, tc.body)
			c := newClient(t, srv.URL, 2*time.Second, policy.Exactly(3))
			got, err := c.Generate(context.Background(), req)
			if tc.reason == "" {
				if err != nil || len(got) != 1 || got[0].PolicyVersion != 3 || got[0].Tokens[0] != 4 {
					t.Fatalf("%+v %v, want a sample", got, err)
				}
			} else {
				ie, ok := policy.AsInfra(err)
				if !ok || ie.Reason != tc.reason || ie.Addr != srv.URL || !strings.Contains(err.Error(), tc.field) {
					t.Fatalf("err %v, want an InfraError %s naming %s", err, tc.reason, tc.field)
				}
			}
			var sent map[string]any
			if err := json.Unmarshal([]byte(last.Load().(string)), &sent); err != nil {
				t.Fatal(err)
			}
			for k, v := range map[string]any{
				"model": "org/model", "seed": float64(-(1 << 63) + 5), "logprobs": float64(0), "n": float64(1), "max_tokens": float64(3),
				"return_tokens_as_token_ids": true, "return_token_ids": true, "stream": false, "echo": false, "ignore_eos": true,
				"skip_special_tokens": false, "top_k": float64(-1), "top_p": float64(1), "min_p": float64(0), "repetition_penalty": float64(1),
			} {
				if sent[k] != v {
					t.Errorf("sent %s = %v, want %v (body %s)", k, sent[k], v, last.Load())
				}
			}
			if p, ok := sent["prompt"].([]any); !ok || len(p) != 3 || p[2] != float64(3) {
				t.Errorf("sent prompt %v, want the ids [1 2 3]", sent["prompt"])
			}
			if s, ok := sent["stop_token_ids"].([]any); !ok || !slices.Equal(s, []any{float64(9)}) {
				t.Errorf("sent stop_token_ids %v", sent["stop_token_ids"])
			}
			if _, ok := sent["detokenize"]; ok {
				t.Errorf("sent detokenize, not a completions field: %s", last.Load())
			}
		})
	}
}

func FuzzCompletions(f *testing.F) {
	policytest.FuzzGenerate(f, policy.VLLM, "/v1/completions", newCompletionsClient)
}

// TestHostileCompletions: TestHostile over POST /v1/completions.
func TestHostileCompletions(t *testing.T) {
	policytest.Hostile(t, policy.VLLM, "/v1/completions", newCompletionsClient)
}
