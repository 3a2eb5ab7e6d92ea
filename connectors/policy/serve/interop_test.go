package serve_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/serve"
)

// The tests of this file hold the answers to the shapes that the clients
// users already have (the openai SDK, plain HTTP clients following the
// real servers' documentation) read.

// interopCtx bounds every call of a test.
func interopCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// getJSON GETs url and decodes its 200 JSON answer.
func getJSON(t *testing.T, ctx context.Context, url string) map[string]any {
	t.Helper()
	code, body, err := policytest.Get(ctx, url)
	if err != nil || code != http.StatusOK {
		t.Fatalf("GET %s: %d %s %v", url, code, body, err)
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatalf("GET %s: %v: %s", url, err, body)
	}
	return m
}

// postJSON POSTs body to url and decodes its JSON answer of status want.
func postJSON(t *testing.T, ctx context.Context, url, body string, want int) map[string]any {
	t.Helper()
	code, out, err := policytest.Post(ctx, url, body)
	if err != nil || code != want {
		t.Fatalf("POST %s %s: %d %s %v, want %d", url, body, code, out, err, want)
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(out), &m); err != nil {
		t.Fatalf("POST %s: %v: %s", url, err, out)
	}
	return m
}

// TestUnservedRouteJSON: a route a protocol does not serve — the
// OpenAI-style /v1/chat/completions an openai SDK calls, llama-server's
// /slots — answers 404 with a JSON error naming the protocol's generation
// endpoints (the SDK shows the body; a bare "404 page not found" says
// nothing), while a served path asked with another method keeps the mux's
// 405.
func TestUnservedRouteJSON(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	gen := map[string]string{policy.LlamaCpp: "POST /completion", policy.SGLang: "POST /generate", policy.VLLM: "POST /inference/v1/generate"}
	for _, proto := range []string{policy.LlamaCpp, policy.SGLang, policy.VLLM} {
		t.Run(proto, func(t *testing.T) {
			srv := policytest.Start(t, proto, dir, reg, nil, 1)
			ctx := interopCtx(t)
			for _, path := range []string{"/v1/chat/completions", "/slots"} {
				req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+path, strings.NewReader(`{"model":"m","prompt":[1,3],"max_tokens":2}`))
				req.Header.Set("Content-Type", "application/json")
				res, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(res.Body)
				res.Body.Close()
				var e struct {
					Error struct {
						Message string `json:"message"`
						Code    int    `json:"code"`
					} `json:"error"`
				}
				if res.StatusCode != http.StatusNotFound || !strings.HasPrefix(res.Header.Get("Content-Type"), "application/json") {
					t.Fatalf("POST %s: %d %s %s, want a JSON 404", path, res.StatusCode, res.Header.Get("Content-Type"), b)
				}
				if err := json.Unmarshal(b, &e); err != nil || e.Error.Code != 404 || !strings.Contains(e.Error.Message, path) || !strings.Contains(e.Error.Message, gen[proto]) ||
					!strings.Contains(e.Error.Message, "POST /v1/completions") {
					t.Fatalf("POST %s: %s (%v), want error.message naming %s, %s and POST /v1/completions", path, b, err, path, gen[proto])
				}
			}
			code, body, err := policytest.Get(ctx, srv.URL+strings.TrimPrefix(gen[proto], "POST "))
			if err != nil || code != http.StatusMethodNotAllowed {
				t.Fatalf("GET on %s: %d %s %v, want 405", gen[proto], code, body, err)
			}
		})
	}
}

// TestModelListOpenAIShape: GET /v1/models of every protocol lists models
// as OpenAI clients require them (id, object "model", created, owned_by;
// strict clients fail on a model without created), and vLLM's and SGLang's
// entry has vLLM's ModelCard's max_model_len.
func TestModelListOpenAIShape(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	for _, proto := range []string{policy.LlamaCpp, policy.SGLang, policy.VLLM} {
		t.Run(proto, func(t *testing.T) {
			srv := policytest.StartWith(t, serve.Config{Protocol: proto, Releases: dir, Grammar: reg.Grammar(), MaxTokens: 7}, nil, 1)
			list := getJSON(t, interopCtx(t), srv.URL+"/v1/models")
			data, ok := list["data"].([]any)
			if list["object"] != "list" || !ok || len(data) == 0 {
				t.Fatalf("/v1/models: %v", list)
			}
			for _, d := range data {
				m := d.(map[string]any)
				id, _ := m["id"].(string)
				created, isNum := m["created"].(float64)
				owner, _ := m["owned_by"].(string)
				if id == "" || m["object"] != "model" || !isNum || created <= 0 || created != float64(int64(created)) || owner == "" {
					t.Fatalf("/v1/models entry %v: want id, object \"model\", created (integer seconds) and owned_by", m)
				}
				if proto != policy.LlamaCpp && m["max_model_len"] != float64(7) {
					t.Fatalf("/v1/models entry %v: want max_model_len 7", m)
				}
			}
		})
	}
}

// TestContextLength: the context lengths the info endpoints report where
// the real servers do (vLLM's and SGLang's /tokenize max_model_len,
// llama-server's /props default_generation_settings.n_ctx) are the
// smaller of the two limits — a client reading 0 would take every prompt
// for too long — and a request that fills that length is served.
func TestContextLength(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	cases := []struct {
		proto, info, infoBody string
		field                 []any
		gen, genBody          string
	}{
		{policy.VLLM, "/tokenize", `{"prompt":"TASK K1"}`, []any{"max_model_len"},
			"/inference/v1/generate", `{"token_ids":[1,2,11,3],"sampling_params":{"max_tokens":2,"seed":1}}`},
		{policy.SGLang, "/tokenize", `{"prompt":"TASK K1"}`, []any{"max_model_len"},
			"/generate", `{"input_ids":[1,2,11,3],"sampling_params":{"max_new_tokens":2,"sampling_seed":1}}`},
		{policy.LlamaCpp, "/props", "", []any{"default_generation_settings", "n_ctx"},
			"/completion", `{"prompt":[1,2,11,3],"n_predict":2,"seed":1,"samplers":["temperature"]}`},
	}
	for _, tc := range cases {
		t.Run(tc.proto, func(t *testing.T) {
			srv := policytest.StartWith(t, serve.Config{Protocol: tc.proto, Releases: dir, Grammar: reg.Grammar(), MaxTokens: 9, MaxPromptTokens: 6}, nil, 1)
			ctx := interopCtx(t)
			var info map[string]any
			if tc.infoBody == "" {
				info = getJSON(t, ctx, srv.URL+tc.info)
			} else {
				info = postJSON(t, ctx, srv.URL+tc.info, tc.infoBody, http.StatusOK)
			}
			if got := policytest.Path(info, tc.field...); got != float64(6) {
				t.Fatalf("%s %v = %v, want 6 (the smaller of --max-tokens 9 and --max-prompt-tokens 6): %v", tc.info, tc.field, got, info)
			}
			postJSON(t, ctx, srv.URL+tc.gen, tc.genBody, http.StatusOK)
		})
	}
}

// TestLlamaCompletionFields: llama-server's /completion answer always
// has "tokens" (empty without return_tokens) and "timings", whose counts
// agree with tokens_evaluated and tokens_predicted.
func TestLlamaCompletionFields(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	srv := policytest.Start(t, policy.LlamaCpp, dir, reg, nil, 1)
	ctx := interopCtx(t)
	for _, ret := range []bool{false, true} {
		body := `{"prompt":[1,2,11,3],"n_predict":6,"seed":5,"samplers":["temperature"],"return_tokens":` + map[bool]string{false: "false", true: "true"}[ret] + `}`
		m := postJSON(t, ctx, srv.URL+"/completion", body, http.StatusOK)
		toks, ok := m["tokens"].([]any)
		n := m["tokens_predicted"].(float64)
		switch {
		case !ok:
			t.Fatalf("return_tokens %v: no tokens list: %v", ret, m)
		case !ret && len(toks) != 0, ret && float64(len(toks)) != n:
			t.Fatalf("return_tokens %v: tokens %v, tokens_predicted %v", ret, toks, n)
		}
		tm, ok := m["timings"].(map[string]any)
		if !ok || tm["predicted_n"] != n || tm["prompt_n"] != m["tokens_evaluated"] {
			t.Fatalf("return_tokens %v: timings %v, want predicted_n %v and prompt_n %v", ret, m["timings"], n, m["tokens_evaluated"])
		}
		for _, k := range []string{"prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms", "predicted_per_token_ms", "predicted_per_second", "cache_n"} {
			if _, ok := tm[k].(float64); !ok {
				t.Fatalf("timings.%s missing or not a number: %v", k, tm)
			}
		}
	}
}

// TestSGLangRequestID: a /generate without rid is named as SGLang names
// it (a fresh uuid4 in hex, in meta_info.id), so that clients keying
// answers by id do not see every such request as one; a given rid is
// answered as given.
func TestSGLangRequestID(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	srv := policytest.Start(t, policy.SGLang, dir, reg, nil, 1)
	ctx := interopCtx(t)
	hex32 := regexp.MustCompile(`^[0-9a-f]{32}$`)
	seen := map[any]bool{}
	for range 2 {
		m := postJSON(t, ctx, srv.URL+"/generate", `{"input_ids":[1,2,11,3],"sampling_params":{"max_new_tokens":2,"sampling_seed":1}}`, http.StatusOK)
		id, _ := policytest.Path(m, "meta_info", "id").(string)
		if !hex32.MatchString(id) || seen[id] {
			t.Fatalf("meta_info.id %q: want a fresh 32-hex-digit id", id)
		}
		seen[id] = true
	}
	m := postJSON(t, ctx, srv.URL+"/generate", `{"rid":"r-7","input_ids":[1,2,11,3],"sampling_params":{"max_new_tokens":2,"sampling_seed":1}}`, http.StatusOK)
	if id := policytest.Path(m, "meta_info", "id"); id != "r-7" {
		t.Fatalf("meta_info.id %v, want the rid r-7", id)
	}
}

// TestBatchPromptsRefused: the batched prompts SGLang's input_ids and
// llama-server's prompt accept (a list of lists) are refused naming the
// batch, not as a malformed id.
func TestBatchPromptsRefused(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	for _, tc := range []struct{ proto, path, body string }{
		{policy.SGLang, "/generate", `{"input_ids":[[1,2,11,3],[1,2,12,3]],"sampling_params":{"max_new_tokens":2,"sampling_seed":1}}`},
		{policy.LlamaCpp, "/completion", `{"prompt":[[1,2,11,3],[1,2,12,3]],"n_predict":2,"seed":1,"samplers":["temperature"]}`},
		{policy.VLLM, "/inference/v1/generate", `{"token_ids":[[1,2,11,3]],"sampling_params":{"max_tokens":2,"seed":1}}`},
	} {
		srv := policytest.Start(t, tc.proto, dir, reg, nil, 1)
		code, body, err := policytest.Post(interopCtx(t), srv.URL+tc.path, tc.body)
		if err != nil || code != http.StatusBadRequest || !strings.Contains(body, "batch of") || !strings.Contains(body, "one prompt per request") {
			t.Fatalf("%s %s: %d %s %v, want 400 naming the batch", tc.proto, tc.path, code, body, err)
		}
	}
}
