package sglang_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/sglang"
	"github.com/trajflow/trajflow/operators/rollout"
)

func newClient(t testing.TB, addr string, timeout time.Duration, want policy.Want) policy.Client {
	t.Helper()
	c, err := sglang.New(sglang.Config{ClientConfig: policy.ClientConfig{Addr: addr, Timeout: timeout, Want: want}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

func TestExact(t *testing.T) {
	policytest.Exact(t, policy.SGLang, newClient, policytest.RequestOptions{}, nil)
}

func TestFaults(t *testing.T) {
	meta := func(m map[string]any) map[string]any { return m["meta_info"].(map[string]any) }
	lps := func(m map[string]any) []any { return meta(m)["output_token_logprobs"].([]any) }
	setLP := func(v any) func(map[string]any) {
		return func(m map[string]any) { lps(m)[0].([]any)[0] = v }
	}
	policytest.Faults(t, policy.SGLang, "/generate", "output_token_logprobs", newClient, []policytest.FaultCase{
		policytest.F("one log-prob too few", func(m map[string]any) { l := lps(m); meta(m)["output_token_logprobs"] = l[:len(l)-1] }, policy.ReasonLengthMismatch),
		policytest.F("positive log-prob", setLP(json.Number("0.25")), policy.ReasonPositiveLogprob),
		policytest.F("log-prob out of range", setLP(json.Number("-1e999")), policy.ReasonNaNLogprob),
		policytest.F("null log-prob", setLP(nil), policy.ReasonBadResponse),
		policytest.F("log-prob below float32's range", setLP(json.Number("-1e300")), policy.ReasonNaNLogprob),
		policytest.F("id out of range", func(m map[string]any) {
			m["output_ids"].([]any)[0] = json.Number("99")
			lps(m)[0].([]any)[1] = json.Number("99")
		}, policy.ReasonTokenRange),
		policytest.F("log-prob of another id", func(m map[string]any) { lps(m)[0].([]any)[1] = json.Number("31") }, policy.ReasonBadResponse),
		policytest.F("id after a stop id", func(m map[string]any) {
			m["output_ids"].([]any)[0] = json.Number("9")
			lps(m)[0].([]any)[1] = json.Number("9")
		}, policy.ReasonAfterStop),
		policytest.F("missing output_ids", func(m map[string]any) { delete(m, "output_ids") }, policy.ReasonBadResponse),
		policytest.F("missing weight_version", func(m map[string]any) { delete(meta(m), "weight_version") }, policy.ReasonBadResponse),
		policytest.F("weight_version not a policy version", func(m map[string]any) { meta(m)["weight_version"] = "default" }, policy.ReasonVersionMismatch),
		policytest.F("aborted", func(m map[string]any) {
			meta(m)["finish_reason"] = map[string]any{"type": "abort", "message": "injected"}
		}, policy.ReasonServerError),
		policytest.F("stopped early", func(m map[string]any) {
			ids := m["output_ids"].([]any)
			m["output_ids"] = ids[:1]
			meta(m)["output_token_logprobs"] = lps(m)[:1]
		}, policy.ReasonBadResponse),
		policytest.F("unknown finish reason", func(m map[string]any) {
			meta(m)["finish_reason"] = map[string]any{"type": "cancelled"}
		}, policy.ReasonBadResponse),
		policytest.F("more ids than max_new_tokens", func(m map[string]any) {
			k := json.Number(fmt.Sprint(rollout.TokKey0))
			m["output_ids"] = append(m["output_ids"].([]any), k)
			meta(m)["output_token_logprobs"] = append(lps(m), []any{json.Number("-0.5"), k, nil})
		}, policy.ReasonBadResponse),
		policytest.F("no ids, finish length", func(m map[string]any) {
			m["output_ids"] = []any{}
			meta(m)["output_token_logprobs"] = []any{}
			meta(m)["finish_reason"] = map[string]any{"type": "length"}
		}, policy.ReasonBadResponse),
		policytest.F("ids as strings", func(m map[string]any) {
			ids := m["output_ids"].([]any)
			for i, id := range ids {
				ids[i] = fmt.Sprint(id)
			}
		}, policy.ReasonBadResponse),
		policytest.F("log-prob as a string", setLP("-0.5"), policy.ReasonBadResponse),
		policytest.F("id as a string in a log-prob entry", func(m map[string]any) {
			e := lps(m)[0].([]any)
			e[1] = fmt.Sprint(e[1])
		}, policy.ReasonBadResponse),
		policytest.F("missing output_token_logprobs", func(m map[string]any) { delete(meta(m), "output_token_logprobs") }, policy.ReasonBadResponse),
	})
}

func TestTokenizer(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	srv := policytest.Start(t, policy.SGLang, dir, reg, nil, 1)
	c := newClient(t, srv.URL, time.Second, policy.Want{}).(*sglang.Client)
	ctx := context.Background()
	ids, err := c.Tokenize(ctx, "<bos> TASK K2 ACT")
	if err != nil || len(ids) != 4 || ids[0] != rollout.TokBOS || ids[2] != rollout.TokKey0+2 || ids[3] != rollout.TokAct {
		t.Fatalf("tokenize: %v %v", ids, err)
	}
	text, err := c.Detokenize(ctx, ids)
	if err != nil || text != "<bos> TASK K2 ACT" {
		t.Fatalf("detokenize: %q %v", text, err)
	}
	if _, err := c.ApplyTemplate(ctx, nil, true); !errors.Is(err, policy.ErrNotOffered) {
		t.Fatalf("apply template: %v", err)
	}
	if _, err := c.Tokenize(ctx, "nonsense"); !policy.IsInfra(err) {
		t.Fatalf("tokenize of an unknown word: %v", err)
	}
	if _, err := c.Identity(ctx); err != nil || c.TokenizerHash() != rollout.TokenizerHash || c.ChatTemplateHash() == "" {
		t.Fatalf("hashes %q %q %v", c.TokenizerHash(), c.ChatTemplateHash(), err)
	}
}

func FuzzGenerate(f *testing.F) {
	policytest.FuzzGenerate(f, policy.SGLang, "/generate", newClient)
}

// TestHostile: a server that misbehaves at the HTTP level (oversized,
// stalled or endless bodies, 429/503, redirects, garbage encodings) gets
// an InfraError naming it, on /generate and on the info endpoints.
func TestHostile(t *testing.T) {
	policytest.Hostile(t, policy.SGLang, "/generate", newClient)
}
