package serve_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/serve"
)

// TestRefusals: settings the built-in policy cannot apply exactly, and
// fields it does not know, are refused with 400 naming them; never
// ignored.
func TestRefusals(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	cases := []struct {
		proto, path, body, word string
	}{
		{policy.LlamaCpp, "/completion", `{"prompt":[1,3],"n_predict":2,"seed":1}`, "min_p"}, // llama-server's default min_p 0.05
		{policy.LlamaCpp, "/completion", `{"prompt":[1,3],"n_predict":2,"min_p":0}`, "seed"},
		{policy.LlamaCpp, "/completion", `{"prompt":[1,3],"n_predict":2,"min_p":0,"seed":4294967295}`, "random"},
		{policy.LlamaCpp, "/completion", `{"prompt":[1,3],"n_predict":2,"min_p":0,"seed":1,"top_p":0.5}`, "temperature first"},
		{policy.LlamaCpp, "/completion", `{"prompt":[1,3],"n_predict":2,"seed":1,"samplers":["temperature"],"repeat_penalty":1.1}`, ""},
		{policy.LlamaCpp, "/completion", `{"prompt":[1,3],"n_predict":2,"seed":1,"samplers":["penalties","temperature"],"repeat_penalty":1.1}`, "repeat_penalty"},
		{policy.LlamaCpp, "/completion", `{"prompt":"TASK","n_predict":2,"seed":1,"min_p":0}`, "token ids"},
		{policy.LlamaCpp, "/completion", `{"prompt":[1,3],"n_predict":2,"seed":1,"min_p":0,"grammar":"root ::= x"}`, "grammar"},
		{policy.LlamaCpp, "/completion?autoload=true", `{"prompt":[1,3],"n_predict":2,"seed":1,"min_p":0}`, "autoload"},
		{policy.SGLang, "/generate", `{"input_ids":[1,3],"sampling_params":{"max_new_tokens":2}}`, "sampling_seed"},
		{policy.SGLang, "/generate", `{"input_ids":[1,3],"sampling_params":{"max_new_tokens":2,"sampling_seed":1,"min_p":0.1}}`, "min_p"},
		{policy.SGLang, "/generate", `{"input_ids":[1,3],"sampling_params":{"max_new_tokens":2,"sampling_seed":1,"stop":["END"]}}`, "stop"},
		{policy.SGLang, "/generate", `{"input_ids":[1,3],"sampling_params":{"max_new_tokens":2,"sampling_seed":1,"regex":"a"}}`, "regex"},
		{policy.SGLang, "/generate", `{"text":"TASK","sampling_params":{"max_new_tokens":2,"sampling_seed":1}}`, "input_ids"},
		{policy.SGLang, "/update_weights_from_disk", `{"model_path":"/etc/passwd"}`, "outside"},
		{policy.SGLang, "/update_weights_from_disk", `{"model_path":""}`, "model path is required"},
		{policy.SGLang, "/update_weights_from_disk", `{"model_path":"policy-v00000001.json","weight_version":"7"}`, "weight_version"},
		{policy.VLLM, "/inference/v1/generate", `{"token_ids":[1,3],"sampling_params":{"max_tokens":2,"seed":1,"repetition_penalty":1.2}}`, "repetition_penalty"},
		{policy.VLLM, "/inference/v1/generate", `{"token_ids":[1,3],"sampling_params":{"max_tokens":2}}`, "seed"},
		{policy.VLLM, "/inference/v1/generate", `{"token_ids":[1,3],"sampling_params":{"max_tokens":2,"seed":1,"logprobs":5}}`, "logprobs"},
		{policy.VLLM, "/finish_weight_update", `{"weight_version":"1"}`, "no weights were updated"},
		{policy.LlamaCpp, "/completion", `{"prompt":[1,3],"n_predict":2,"seed":1,"samplers":["temperature"],"temperature":1e-40}`, "temperature 1e-40 is below"},
		{policy.VLLM, "/tokenize", `{"prompt":"<unused-5> TASK"}`, "id -5"},
		// n_probs sizes the answer (n_probs × n_predict entries): bounded
		// as the OpenAI endpoints' logprobs.
		{policy.LlamaCpp, "/completion", `{"prompt":[1,3],"n_predict":2,"seed":1,"samplers":["temperature"],"n_probs":21}`, "n_probs 21 not in [0, 20]"},
		{policy.LlamaCpp, "/completion", `{"prompt":[1,3],"n_predict":2,"seed":1,"samplers":["temperature"],"n_probs":-1}`, "n_probs -1"},
		// Past the default limit (serve.DefaultMaxTokens): refused before
		// any work, the largest bound included (it once crashed the server).
		{policy.LlamaCpp, "/completion", `{"prompt":[1,3],"n_predict":65537,"seed":1,"samplers":["temperature"]}`, "n_predict 65537 exceeds this server's limit of 65536"},
		{policy.SGLang, "/generate", `{"input_ids":[1,3],"sampling_params":{"max_new_tokens":9223372036854775807,"sampling_seed":1}}`, "sampling_params.max_new_tokens 9223372036854775807 exceeds"},
		{policy.VLLM, "/inference/v1/generate", `{"token_ids":[1,3],"sampling_params":{"max_tokens":9223372036854775807,"seed":1}}`, "sampling_params.max_tokens 9223372036854775807 exceeds"},
	}
	servers := map[string]string{}
	for _, p := range []string{policy.LlamaCpp, policy.SGLang, policy.VLLM} {
		servers[p] = policytest.Start(t, p, dir, reg, nil, 1).URL
	}
	for _, tc := range cases {
		code, body, err := policytest.Post(context.Background(), servers[tc.proto]+tc.path, tc.body)
		if err != nil {
			t.Fatal(err)
		}
		if tc.word == "" { // a non-neutral setting of a sampler left out of the chain is not applied
			if code != http.StatusOK {
				t.Errorf("%s %s %s: %d %s", tc.proto, tc.path, tc.body, code, body)
			}
			continue
		}
		if code != http.StatusBadRequest || !strings.Contains(body, tc.word) {
			t.Errorf("%s %s %s: %d %s, want 400 naming %q", tc.proto, tc.path, tc.body, code, body, tc.word)
		}
	}
}

// TestMaxTokens: a server started with a limit serves a request at it,
// refuses one past it naming the field and the limit, and reports the
// limit in its info endpoint.
func TestMaxTokens(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	cases := []struct {
		proto, path, at, past, info string
	}{
		{policy.LlamaCpp, "/completion",
			`{"prompt":[1,3],"n_predict":5,"seed":1,"samplers":["temperature"]}`, `{"prompt":[1,3],"n_predict":6,"seed":1,"samplers":["temperature"]}`, "/props"},
		{policy.SGLang, "/generate",
			`{"input_ids":[1,3],"sampling_params":{"max_new_tokens":5,"sampling_seed":1}}`, `{"input_ids":[1,3],"sampling_params":{"max_new_tokens":6,"sampling_seed":1}}`, "/get_server_info"},
		{policy.VLLM, "/inference/v1/generate",
			`{"token_ids":[1,3],"sampling_params":{"max_tokens":5,"seed":1}}`, `{"token_ids":[1,3],"sampling_params":{"max_tokens":6,"seed":1}}`, "/server_info"},
	}
	for _, tc := range cases {
		t.Run(tc.proto, func(t *testing.T) {
			g := reg.Grammar()
			srv := policytest.StartWith(t, serve.Config{Protocol: tc.proto, Releases: dir, Grammar: g, MaxTokens: 5}, nil, 1)
			ctx := context.Background()
			if code, body, err := policytest.Post(ctx, srv.URL+tc.path, tc.at); err != nil || code != http.StatusOK {
				t.Fatalf("at the limit: %d %s %v", code, body, err)
			}
			code, body, err := policytest.Post(ctx, srv.URL+tc.path, tc.past)
			if err != nil || code != http.StatusBadRequest || !strings.Contains(body, "6 exceeds this server's limit of 5 tokens") {
				t.Fatalf("past the limit: %d %s %v, want 400 naming 6 and the limit 5", code, body, err)
			}
			code, body, err = policytest.Get(ctx, srv.URL+tc.info)
			if err != nil || code != http.StatusOK {
				t.Fatalf("%s: %d %s %v", tc.info, code, body, err)
			}
			var info struct {
				MaxTokens int `json:"max_tokens"`
			}
			if err := json.Unmarshal([]byte(body), &info); err != nil || info.MaxTokens != 5 {
				t.Fatalf("%s reports max_tokens %d (%v), want 5: %s", tc.info, info.MaxTokens, err, body)
			}
		})
	}
	if _, err := serve.New(serve.Config{Protocol: policy.VLLM, Releases: dir, MaxTokens: -1}); !errors.Is(err, policy.ErrConfig) {
		t.Fatalf("a negative limit: %v, want policy.ErrConfig", err)
	}
}
