package serve_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
)

// firstKey is the first key of a JSON object.
func firstKey(t *testing.T, raw json.RawMessage) (string, int) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("top_logprobs entry %s is not an object", raw)
	}
	key, err := dec.Token()
	if err != nil {
		t.Fatalf("top_logprobs entry %s: %v", raw, err)
	}
	var m map[string]float64
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	return key.(string), len(m)
}

// completionAnswer is the OpenAI shape of a completion, with the fields
// of every dialect.
type completionAnswer struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index    *int    `json:"index"`
		Text     *string `json:"text"`
		Logprobs *struct {
			Tokens        []string          `json:"tokens"`
			TokenLogprobs []float64         `json:"token_logprobs"`
			TopLogprobs   []json.RawMessage `json:"top_logprobs"`
			TextOffset    []int             `json:"text_offset"`
		} `json:"logprobs"`
		FinishReason   string          `json:"finish_reason"`
		StopReason     json.RawMessage `json:"stop_reason"`
		MatchedStop    json.RawMessage `json:"matched_stop"`
		TokenIDs       []int32         `json:"token_ids"`
		PromptTokenIDs []int32         `json:"prompt_token_ids"`
	} `json:"choices"`
	Usage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	} `json:"usage"`
}

func postCompletion(t *testing.T, url, body string) completionAnswer {
	t.Helper()
	code, out, err := policytest.Post(interopCtx(t), url+"/v1/completions", body)
	if err != nil || code != http.StatusOK {
		t.Fatalf("POST /v1/completions %s: %d %s %v", body, code, out, err)
	}
	var a completionAnswer
	if err := json.Unmarshal([]byte(out), &a); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	return a
}

// TestCompletionsShape: POST /v1/completions answers OpenAI's completion
// in every dialect (id cmpl-…, object text_completion, created, model,
// one choice with text, logprobs and finish_reason, usage), with each
// dialect's own fields; logprobs n lists the sampled id first in each
// top_logprobs entry, with its log-prob, then at most n others.
func TestCompletionsShape(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	cases := []struct {
		proto, body string
	}{
		{policy.VLLM, `{"model":"policy-v00000001","prompt":[1,2,11,3],"max_tokens":5,"seed":7,"logprobs":2,"stop_token_ids":[9],"return_token_ids":true,"return_tokens_as_token_ids":true}`},
		{policy.SGLang, `{"model":"policy-v00000001","prompt":[1,2,11,3],"max_tokens":5,"seed":7,"logprobs":2,"stop_token_ids":[9]}`},
		{policy.LlamaCpp, `{"model":"policy-v00000001","prompt":[1,2,11,3],"max_tokens":5,"seed":7,"logprobs":2,"samplers":["temperature"]}`},
		{policy.LlamaCpp, `{"prompt":"TASK K1 ACT","max_tokens":5,"seed":7,"logprobs":0,"samplers":["temperature"],"post_sampling_probs":true}`},
	}
	for _, tc := range cases {
		t.Run(tc.proto, func(t *testing.T) {
			srv := policytest.Start(t, tc.proto, dir, reg, nil, 1)
			a := postCompletion(t, srv.URL, tc.body)
			if !strings.HasPrefix(a.ID, "cmpl-") || a.Object != "text_completion" || a.Created <= 0 || a.Model != "policy-v00000001" || len(a.Choices) != 1 {
				t.Fatalf("answer %+v", a)
			}
			ch := a.Choices[0]
			n := a.Usage.CompletionTokens
			switch {
			case ch.Index == nil || *ch.Index != 0 || ch.Text == nil || ch.Logprobs == nil:
				t.Fatalf("choice %+v: want index 0, text and logprobs", ch)
			case ch.FinishReason != "stop" && ch.FinishReason != "length":
				t.Fatalf("finish_reason %q", ch.FinishReason)
			case a.Usage.PromptTokens != 4 || a.Usage.TotalTokens != 4+n || n < 1:
				t.Fatalf("usage %+v", a.Usage)
			case len(ch.Logprobs.Tokens) != n || len(ch.Logprobs.TokenLogprobs) != n || len(ch.Logprobs.TopLogprobs) != n || len(ch.Logprobs.TextOffset) != n:
				t.Fatalf("logprobs %+v for %d tokens", ch.Logprobs, n)
			}
			for i, raw := range ch.Logprobs.TopLogprobs {
				key, size := firstKey(t, raw)
				var m map[string]float64
				json.Unmarshal(raw, &m)
				if key != ch.Logprobs.Tokens[i] || m[key] != ch.Logprobs.TokenLogprobs[i] || size > 3 || ch.Logprobs.TokenLogprobs[i] > 0 {
					t.Fatalf("top_logprobs[%d] %s: want %s: %v first, then at most 2 others", i, raw, ch.Logprobs.Tokens[i], ch.Logprobs.TokenLogprobs[i])
				}
			}
			switch tc.proto {
			case policy.VLLM:
				if len(ch.TokenIDs) != n || len(ch.PromptTokenIDs) != 4 || ch.StopReason == nil {
					t.Fatalf("vLLM choice: token_ids %v, prompt_token_ids %v, stop_reason %s", ch.TokenIDs, ch.PromptTokenIDs, ch.StopReason)
				}
				for i, id := range ch.TokenIDs {
					if ch.Logprobs.Tokens[i] != fmt.Sprint("token_id:", id) {
						t.Fatalf("tokens[%d] %q, token_ids[%d] %d", i, ch.Logprobs.Tokens[i], i, id)
					}
				}
				if want := "null"; ch.FinishReason == "stop" {
					want = fmt.Sprint(ch.TokenIDs[n-1])
					if string(ch.StopReason) != want {
						t.Fatalf("stop_reason %s, want %s", ch.StopReason, want)
					}
				}
			case policy.SGLang:
				if ch.MatchedStop == nil {
					t.Fatal("SGLang choice without matched_stop")
				}
			}
		})
	}
}

// native is one dialect's native generation call for a seed, and how to
// read its ids and log-probs.
type native struct {
	path string
	body func(seed uint64) string
	read func(m map[string]any) ([]any, []any)
}

// TestCompletionsMatchNative: a completion samples what the protocol's
// native endpoint samples for the same settings and seed: the same ids and
// the same log-prob values (vLLM, SGLang: the sampling distribution's;
// llama.cpp: the raw distribution's, or with post_sampling_probs the
// sampler's own, the native trajflow_logprob). vLLM's negative seeds are
// the two's complement of the native uint64 seed, and a text prompt is its
// words' ids after <bos>.
func TestCompletionsMatchNative(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, true)
	vllmIDs := func(m map[string]any) ([]any, []any) {
		ch := policytest.Path(m, "choices", 0).(map[string]any)
		var lps []any
		for _, e := range policytest.Path(ch, "logprobs", "content").([]any) {
			lps = append(lps, e.(map[string]any)["logprob"])
		}
		return ch["token_ids"].([]any), lps
	}
	sglangIDs := func(m map[string]any) ([]any, []any) {
		var lps []any
		for _, e := range policytest.Path(m, "meta_info", "output_token_logprobs").([]any) {
			lps = append(lps, e.([]any)[0])
		}
		return m["output_ids"].([]any), lps
	}
	llamaIDs := func(field string) func(m map[string]any) ([]any, []any) {
		return func(m map[string]any) ([]any, []any) {
			var lps []any
			for _, e := range m["completion_probabilities"].([]any) {
				lps = append(lps, e.(map[string]any)[field])
			}
			return m["tokens"].([]any), lps
		}
	}
	const llamaSampler = `"samplers":["temperature","top_k","top_p"],"temperature":1.3,"top_k":5,"top_p":0.9,"min_p":0`
	cases := []struct {
		name, proto string
		completion  func(seed uint64) string
		native      native
	}{
		{"vllm", policy.VLLM,
			func(seed uint64) string {
				return fmt.Sprintf(`{"prompt":[1,2,11,3],"max_tokens":6,"temperature":1.3,"top_k":5,"top_p":0.9,"stop_token_ids":[9],"seed":%d,"logprobs":0,"return_token_ids":true}`, int64(seed))
			},
			native{"/inference/v1/generate", func(seed uint64) string {
				return fmt.Sprintf(`{"token_ids":[1,2,11,3],"sampling_params":{"max_tokens":6,"temperature":1.3,"top_k":5,"top_p":0.9,"stop_token_ids":[9],"seed":%d,"logprobs":0}}`, seed)
			}, vllmIDs}},
		{"vllm text prompt", policy.VLLM,
			func(seed uint64) string {
				return fmt.Sprintf(`{"prompt":"TASK K1 ACT","max_tokens":6,"stop_token_ids":[9],"seed":%d,"logprobs":0,"return_token_ids":true}`, int64(seed))
			},
			native{"/inference/v1/generate", func(seed uint64) string {
				return fmt.Sprintf(`{"token_ids":[1,2,11,3],"sampling_params":{"max_tokens":6,"stop_token_ids":[9],"seed":%d,"logprobs":0}}`, seed)
			}, vllmIDs}},
		{"sglang", policy.SGLang,
			func(seed uint64) string {
				return fmt.Sprintf(`{"prompt":[1,2,11,3],"max_tokens":6,"temperature":1.3,"top_k":5,"top_p":0.9,"stop_token_ids":[9],"seed":%d,"logprobs":0}`, int64(seed))
			},
			native{"/generate", func(seed uint64) string {
				return fmt.Sprintf(`{"input_ids":[1,2,11,3],"return_logprob":true,"sampling_params":{"max_new_tokens":6,"temperature":1.3,"top_k":5,"top_p":0.9,"stop_token_ids":[9],"sampling_seed":%d}}`, seed)
			}, sglangIDs}},
		{"llamacpp raw", policy.LlamaCpp,
			func(seed uint64) string {
				return fmt.Sprintf(`{"prompt":[1,2,11,3],"max_tokens":6,%s,"seed":%d,"logprobs":0}`, llamaSampler, seed>>33)
			},
			native{"/completion", func(seed uint64) string {
				return fmt.Sprintf(`{"prompt":[1,2,11,3],"n_predict":6,%s,"seed":%d,"n_probs":1,"return_tokens":true}`, llamaSampler, seed>>33)
			}, llamaIDs("logprob")}},
		{"llamacpp post_sampling_probs", policy.LlamaCpp,
			func(seed uint64) string {
				return fmt.Sprintf(`{"prompt":[1,2,11,3],"max_tokens":6,%s,"seed":%d,"logprobs":0,"post_sampling_probs":true}`, llamaSampler, seed>>33)
			},
			native{"/completion", func(seed uint64) string {
				return fmt.Sprintf(`{"prompt":[1,2,11,3],"n_predict":6,%s,"seed":%d,"n_probs":1,"post_sampling_probs":true,"return_tokens":true}`, llamaSampler, seed>>33)
			}, llamaIDs("trajflow_logprob")}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			srv := policytest.Start(t, tc.proto, dir, reg, nil, 1)
			for _, seed := range []uint64{1, 7, 1 << 62, 1<<63 + 12345, ^uint64(0)} {
				a := postCompletion(t, srv.URL, tc.completion(seed))
				m := postJSON(t, interopCtx(t), srv.URL+tc.native.path, tc.native.body(seed), http.StatusOK)
				ids, lps := tc.native.read(m)
				ch := a.Choices[0]
				if len(ids) != len(ch.Logprobs.TokenLogprobs) || len(ids) != len(lps) {
					t.Fatalf("seed %d: %d ids natively, %d log-probs over completions", seed, len(ids), len(ch.Logprobs.TokenLogprobs))
				}
				for i := range ids {
					if ch.Logprobs.TokenLogprobs[i] != lps[i].(float64) {
						t.Fatalf("seed %d: log-prob %d: %v over completions, %v natively", seed, i, ch.Logprobs.TokenLogprobs[i], lps[i])
					}
					if tc.proto == policy.VLLM && float64(ch.TokenIDs[i]) != ids[i].(float64) {
						t.Fatalf("seed %d: id %d: %d over completions, %v natively", seed, i, ch.TokenIDs[i], ids[i])
					}
				}
			}
		})
	}
}

// TestCompletionsRefusals: what the built-in policy cannot serve is
// refused with 400 naming the field, and a model the server does not serve
// with 404, in every dialect.
func TestCompletionsRefusals(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	const ok = `"prompt":[1,3],"max_tokens":2,"seed":1`
	cases := []struct {
		proto, body string
		code        int
		word        string
	}{
		{policy.VLLM, `{` + ok + `,"stream":true}`, 400, "stream"},
		{policy.VLLM, `{` + ok + `,"Seed":2}`, 400, `key "Seed": keys are case-sensitive, the field is "seed"`},
		{policy.VLLM, `{` + ok + `,"seed":2}`, 400, `key "seed" given twice`},
		{policy.SGLang, `{` + ok + `,"MAX_TOKENS":9}`, 400, `key "MAX_TOKENS"`},
		{policy.LlamaCpp, `{` + ok + `,"max_tokens":3}`, 400, `key "max_tokens" given twice`},
		{policy.VLLM, `{` + ok + `,"echo":true}`, 400, "echo"},
		{policy.VLLM, `{` + ok + `,"n":2}`, 400, "n 2"},
		{policy.VLLM, `{` + ok + `,"best_of":3}`, 400, "best_of 3"},
		{policy.VLLM, `{` + ok + `,"suffix":"END"}`, 400, "suffix"},
		{policy.VLLM, `{` + ok + `,"stop":["END"]}`, 400, "stop strings"},
		{policy.VLLM, `{` + ok + `,"logprobs":21}`, 400, "logprobs 21"},
		{policy.VLLM, `{` + ok + `,"logprobs":-1}`, 400, "logprobs -1"},
		{policy.VLLM, `{` + ok + `,"min_p":0.1}`, 400, "min_p 0.1"},
		{policy.VLLM, `{` + ok + `,"repetition_penalty":1.2}`, 400, "repetition_penalty"},
		{policy.VLLM, `{` + ok + `,"logit_bias":{"3":1}}`, 400, "logit_bias"},
		{policy.VLLM, `{` + ok + `,"prompt_logprobs":1}`, 400, "prompt_logprobs"},
		{policy.VLLM, `{` + ok + `,"detokenize":false}`, 400, "detokenize"},
		{policy.VLLM, `{` + ok + `,"top_k":-3}`, 400, "top_k -3"},
		{policy.VLLM, `{` + ok + `,"stream_options":{"include_usage":true}}`, 400, "stream_options"},
		{policy.VLLM, `{` + ok + `,"sampling_params":{}}`, 400, "sampling_params"},
		{policy.VLLM, `{"prompt":[1,3],"max_tokens":2}`, 400, "seed is required"},
		{policy.VLLM, `{"max_tokens":2,"seed":1}`, 400, "prompt is required"},
		{policy.VLLM, `{"prompt":[[1,3],[1,4]],"max_tokens":2,"seed":1}`, 400, "batch of 2"},
		{policy.VLLM, `{"prompt":["TASK","ACT"],"max_tokens":2,"seed":1}`, 400, "batch of 2"},
		{policy.VLLM, `{"prompt":"TASK FOO","max_tokens":2,"seed":1}`, 400, "FOO"},
		{policy.VLLM, `{"prompt":[1,3],"max_tokens":65537,"seed":1}`, 400, "max_tokens 65537 exceeds"},
		{policy.VLLM, `{"model":"policy-v00000009",` + ok + `}`, 404, "policy-v00000009"},
		{policy.SGLang, `{` + ok + `,"stream":true}`, 400, "stream"},
		{policy.SGLang, `{"prompt":[1,3],"max_tokens":2}`, 400, "seed is required"},
		{policy.SGLang, `{` + ok + `,"min_tokens":2}`, 400, "min_tokens 2"},
		{policy.SGLang, `{` + ok + `,"regex":"a"}`, 400, "regex"},
		{policy.SGLang, `{` + ok + `,"stop":"END"}`, 400, "stop strings"},
		{policy.SGLang, `{` + ok + `,"n":2}`, 400, "n 2"},
		{policy.SGLang, `{` + ok + `,"echo":true}`, 400, "echo"},
		{policy.SGLang, `{` + ok + `,"min_p":0.2}`, 400, "min_p 0.2"},
		{policy.SGLang, `{` + ok + `,"max_new_tokens":3}`, 400, "max_new_tokens"},
		{policy.SGLang, `{"model":"policy-v00000009",` + ok + `}`, 404, "policy-v00000009"},
		{policy.LlamaCpp, `{"prompt":[1,3],"seed":1,"samplers":["temperature"]}`, 400, "max_tokens is required"},
		{policy.LlamaCpp, `{"prompt":[1,3],"max_tokens":0,"seed":1,"samplers":["temperature"]}`, 400, "max_tokens 0 must be positive"},
		{policy.LlamaCpp, `{` + ok + `}`, 400, "min_p"}, // llama-server's default min_p 0.05
		{policy.LlamaCpp, `{"prompt":[1,3],"max_tokens":2,"samplers":["temperature"]}`, 400, "seed"},
		{policy.LlamaCpp, `{` + ok + `,"samplers":["temperature"],"n":2}`, 400, "n 2"},
		{policy.LlamaCpp, `{` + ok + `,"samplers":["temperature"],"echo":true}`, 400, "echo"},
		{policy.LlamaCpp, `{` + ok + `,"samplers":["temperature"],"stream":true}`, 400, "stream"},
		{policy.LlamaCpp, `{` + ok + `,"samplers":["temperature"],"stop":["END"]}`, 400, "stop strings"},
		{policy.LlamaCpp, `{` + ok + `,"samplers":["temperature"],"ignore_eos":true}`, 400, "ignore_eos"},
		{policy.LlamaCpp, `{` + ok + `,"samplers":["temperature"],"logprobs":30}`, 400, "logprobs 30"},
		{policy.LlamaCpp, `{"model":"policy-v00000009",` + ok + `,"samplers":["temperature"]}`, 404, "policy-v00000009"},
	}
	servers := map[string]string{}
	for _, p := range []string{policy.LlamaCpp, policy.SGLang, policy.VLLM} {
		servers[p] = policytest.Start(t, p, dir, reg, nil, 1).URL
	}
	for _, tc := range cases {
		code, body, err := policytest.Post(interopCtx(t), servers[tc.proto]+"/v1/completions", tc.body)
		if err != nil {
			t.Fatal(err)
		}
		var e struct {
			Error struct {
				Message string `json:"message"`
				Code    int    `json:"code"`
			} `json:"error"`
		}
		if code != tc.code || json.Unmarshal([]byte(body), &e) != nil || e.Error.Code != tc.code || !strings.Contains(e.Error.Message, tc.word) {
			t.Errorf("%s %s: %d %s, want %d naming %q", tc.proto, tc.body, code, body, tc.code, tc.word)
		}
	}
}

// TestCompletionsVersionSwitch: a completion runs on one version. A
// request waiting at a pause while the weights are switched runs on the
// new version when it named none, and is answered 404 when it named the
// version replaced; after the switch, the new version's name is served.
func TestCompletionsVersionSwitch(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	policytest.Release(t, dir, 2, false)
	srv := policytest.Start(t, policy.VLLM, dir, reg, nil, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	postJSON(t, ctx, srv.URL+"/pause?mode=wait", "", http.StatusOK)
	type result struct {
		code int
		body string
	}
	bodies := []string{
		`{"model":"policy-v00000001","prompt":[1,2,11,3],"max_tokens":3,"seed":5}`,
		`{"prompt":[1,2,11,3],"max_tokens":3,"seed":5}`,
	}
	results := make([]result, len(bodies))
	var wg sync.WaitGroup
	for i, b := range bodies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			code, out, err := policytest.Post(ctx, srv.URL+"/v1/completions", b)
			if err != nil {
				t.Error(err)
			}
			results[i] = result{code, out}
		}()
	}
	time.Sleep(200 * time.Millisecond) // the requests reach the pause
	postJSON(t, ctx, srv.URL+"/start_weight_update", "", http.StatusOK)
	postJSON(t, ctx, srv.URL+"/update_weights", `{"update_info":{"model_path":"policy-v00000002.json"}}`, http.StatusOK)
	postJSON(t, ctx, srv.URL+"/finish_weight_update", `{"weight_version":"2"}`, http.StatusOK)
	postJSON(t, ctx, srv.URL+"/resume", "", http.StatusOK)
	wg.Wait()
	if r := results[0]; r.code != http.StatusNotFound || !strings.Contains(r.body, "policy-v00000001") {
		t.Fatalf("a request naming the replaced version: %d %s, want 404 naming it", r.code, r.body)
	}
	var a completionAnswer
	if r := results[1]; r.code != http.StatusOK || json.Unmarshal([]byte(r.body), &a) != nil || a.Model != "policy-v00000002" {
		t.Fatalf("a request naming no version: %d %s, want an answer of policy-v00000002", r.code, r.body)
	}
	if a := postCompletion(t, srv.URL, `{"model":"policy-v00000002","prompt":[1,2,11,3],"max_tokens":3,"seed":5}`); a.Model != "policy-v00000002" {
		t.Fatalf("model %s", a.Model)
	}
	models := getJSON(t, ctx, srv.URL+"/v1/models")
	if id := policytest.Path(models, "data", 0, "id"); id != "policy-v00000002" {
		t.Fatalf("/v1/models lists %v", id)
	}
}
