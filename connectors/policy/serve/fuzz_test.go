package serve_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
)

// FuzzGenerateRequest: whatever body a client posts to the generation
// endpoints of any of the three protocols (the native one and
// /v1/completions), the server answers 200 with a JSON document or refuses
// with a 4xx status and a JSON body; never a panic (the handler is called
// directly, so one would fail the fuzz) or a 5xx for a request it could
// have refused.
func FuzzGenerateRequest(f *testing.F) {
	reg := policytest.Registry(f)
	dir := f.TempDir()
	policytest.Release(f, dir, 1, false)
	type proto struct {
		name, path string
		h          http.Handler
	}
	var protos []proto
	for _, p := range []struct{ name, path string }{
		{policy.LlamaCpp, "/completion"}, {policy.SGLang, "/generate"}, {policy.VLLM, "/inference/v1/generate"},
		{policy.LlamaCpp, "/v1/completions"}, {policy.SGLang, "/v1/completions"}, {policy.VLLM, "/v1/completions"},
	} {
		srv := policytest.Start(f, p.name, dir, reg, nil, 1)
		protos = append(protos, proto{p.name, p.path, srv.Server})
	}
	f.Add(uint8(0), []byte(`{"prompt":[1,3,6,12],"n_predict":3,"seed":1,"min_p":0,"samplers":["temperature"],"n_probs":1,"post_sampling_probs":true,"return_tokens":true}`))
	f.Add(uint8(1), []byte(`{"input_ids":[1,3,6,12],"sampling_params":{"max_new_tokens":3,"sampling_seed":1},"return_logprob":true}`))
	f.Add(uint8(2), []byte(`{"token_ids":[1,3,6,12],"sampling_params":{"max_tokens":3,"seed":1,"logprobs":0}}`))
	f.Add(uint8(1), []byte(`{"input_ids":[-1,99999],"sampling_params":{"max_new_tokens":-3,"sampling_seed":1,"temperature":1e308}}`))
	f.Add(uint8(2), []byte(`{"token_ids":[],"sampling_params":{"max_tokens":1000000000,"seed":1}}`))
	f.Add(uint8(0), []byte(`{"prompt":[1],"n_predict":3,"seed":1,"min_p":0,"top_k":-5,"top_p":"NaN"}`))
	f.Add(uint8(3), []byte(`{"model":"policy-v00000001","prompt":"TASK K1 ACT","max_tokens":3,"seed":1,"samplers":["temperature"],"logprobs":2}`))
	f.Add(uint8(4), []byte(`{"prompt":[1,3,6,12],"max_tokens":3,"seed":-1,"logprobs":20,"stop_token_ids":[9],"no_stop_trim":true}`))
	f.Add(uint8(5), []byte(`{"prompt":[1,3,6,12],"max_tokens":3,"seed":-9223372036854775808,"logprobs":1,"return_token_ids":true,"return_tokens_as_token_ids":true,"include_stop_str_in_output":true}`))
	f.Add(uint8(5), []byte(`{"prompt":["TASK",""],"max_tokens":-1,"seed":1,"logprobs":-1,"model":""}`))
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		p := protos[int(which)%len(protos)]
		req := httptest.NewRequest(http.MethodPost, p.path, bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		rec := httptest.NewRecorder()
		p.h.ServeHTTP(rec, req)
		switch {
		case rec.Code == http.StatusOK, rec.Code >= 400 && rec.Code < 500:
		default:
			t.Fatalf("%s %s: status %d: %s", p.name, body, rec.Code, rec.Body.Bytes())
		}
		if !json.Valid(rec.Body.Bytes()) {
			t.Fatalf("%s %s: status %d with a body that is not JSON: %q", p.name, body, rec.Code, rec.Body.Bytes())
		}
	})
}
