package serve_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
)

// TestMetrics: every protocol serves GET /metrics, whose counters agree
// with what the requests before it were answered: prompt and generated
// tokens, requests by route and status code (a refusal counted as 400),
// the version loaded and the load that put it there.
func TestMetrics(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	cases := []struct {
		proto, route, ok, bad string
		tokens                []any // path to the generated ids in the answer
	}{
		{policy.LlamaCpp, "POST /completion",
			`{"prompt":[1,3,6],"n_predict":7,"seed":1,"samplers":["temperature"],"return_tokens":true}`,
			`{"prompt":[1,3,6],"n_predict":7,"seed":1}`, []any{"tokens"}},
		{policy.SGLang, "POST /generate",
			`{"input_ids":[1,3,6],"sampling_params":{"max_new_tokens":7,"sampling_seed":1}}`,
			`{"input_ids":[1,3,6],"sampling_params":{"max_new_tokens":7}}`, []any{"output_ids"}},
		{policy.VLLM, "POST /inference/v1/generate",
			`{"token_ids":[1,3,6],"sampling_params":{"max_tokens":7,"seed":1}}`,
			`{"token_ids":[1,3,6],"sampling_params":{"max_tokens":7}}`, []any{"choices", 0, "token_ids"}},
	}
	for _, tc := range cases {
		t.Run(tc.proto, func(t *testing.T) {
			srv := policytest.Start(t, tc.proto, dir, reg, nil, 1)
			ctx := context.Background()
			generated := 0
			for range 2 {
				code, body, err := policytest.Post(ctx, srv.URL+strings.TrimPrefix(tc.route, "POST "), tc.ok)
				if err != nil || code != http.StatusOK {
					t.Fatalf("%d %s %v", code, body, err)
				}
				var v any
				if err := json.Unmarshal([]byte(body), &v); err != nil {
					t.Fatal(err)
				}
				generated += len(policytest.Path(v, tc.tokens...).([]any))
			}
			if code, body, err := policytest.Post(ctx, srv.URL+strings.TrimPrefix(tc.route, "POST "), tc.bad); err != nil || code != http.StatusBadRequest {
				t.Fatalf("refusal: %d %s %v", code, body, err)
			}
			code, body, err := policytest.Get(ctx, srv.URL+"/metrics")
			if err != nil || code != http.StatusOK {
				t.Fatalf("/metrics: %d %v", code, err)
			}
			parser := expfmt.NewTextParser(model.UTF8Validation)
			fams, err := parser.TextToMetricFamilies(strings.NewReader(body))
			if err != nil {
				t.Fatalf("/metrics: %v\n%s", err, body)
			}
			want := []struct {
				name   string
				labels map[string]string
				value  float64
			}{
				{"trajflow_policy_server_prompt_tokens_total", nil, 6},
				{"trajflow_policy_server_generated_tokens_total", nil, float64(generated)},
				{"trajflow_policy_server_requests_total", map[string]string{"route": tc.route, "code": "200"}, 2},
				{"trajflow_policy_server_requests_total", map[string]string{"route": tc.route, "code": "400"}, 1},
				{"trajflow_policy_server_release_loads_total", map[string]string{"outcome": "ok"}, 1},
				{"trajflow_policy_server_version", nil, 1},
				{"trajflow_policy_server_requests_in_flight", nil, 0},
				{"trajflow_policy_server_paused", nil, 0},
			}
			for _, w := range want {
				got, ok := value(fams[w.name], w.labels)
				if !ok || got != w.value {
					t.Errorf("%s%v = %v (found %v), want %v", w.name, w.labels, got, ok, w.value)
				}
			}
			if generated == 0 {
				t.Fatal("no token generated: the token count checks nothing")
			}
		})
	}
}

// value is the value of fam's sample whose labels include labels.
func value(fam *dto.MetricFamily, labels map[string]string) (float64, bool) {
	if fam == nil {
		return 0, false
	}
next:
	for _, m := range fam.GetMetric() {
		for k, v := range labels {
			found := false
			for _, l := range m.GetLabel() {
				if l.GetName() == k && l.GetValue() == v {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		}
	}
	return 0, false
}
