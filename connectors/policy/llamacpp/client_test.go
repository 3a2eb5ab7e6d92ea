package llamacpp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/llamacpp"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

func single(version int64) policytest.NewClient {
	return func(t testing.TB, addr string, timeout time.Duration, want policy.Want) policy.Client {
		t.Helper()
		v := version
		if want.Version > 0 {
			v = want.Version
		}
		c, err := llamacpp.New(llamacpp.Config{ClientConfig: policy.ClientConfig{Addr: addr, Timeout: timeout, Want: want}, Version: v})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		return c
	}
}

func router(t testing.TB, addr string, timeout time.Duration, want policy.Want) policy.Client {
	t.Helper()
	c, err := llamacpp.New(llamacpp.Config{ClientConfig: policy.ClientConfig{Addr: addr, Timeout: timeout, Want: want}, Router: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// toServer is the request as the server samples it: trajflow serve policy
// announces "trajflow_seed" in /props, so the client sends the whole
// 64-bit seed beside llama-server's 32-bit Seed32, and the server samples
// exactly as in process (TestSeed64 checks the fold).
func toServer(r model.Request) model.Request { return r }

// TestSeed64: the 64-bit trajflow_seed must fold to the 32-bit seed sent
// beside it; a request without it samples with the 32-bit seed.
func TestSeed64(t *testing.T) {
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	srv := policytest.Start(t, policy.LlamaCpp, dir, policytest.Registry(t), nil, 1)
	ctx := context.Background()
	seed := uint64(0x123456789abcdef0)
	body := func(seed32 uint32, seed64 uint64) string {
		return fmt.Sprintf(`{"prompt":[1,2],"n_predict":2,"seed":%d,"trajflow_seed":%d,"temperature":1,"samplers":["temperature"],"min_p":0,"model":%q}`,
			seed32, seed64, policy.ModelName(1))
	}
	if code, resp, err := policytest.Post(ctx, srv.URL+"/completion", body(llamacpp.Seed32(seed)+1, seed)); err != nil || code != http.StatusBadRequest {
		t.Fatalf("a trajflow_seed that does not fold to seed: %d %s %v", code, resp, err)
	}
	if code, resp, err := policytest.Post(ctx, srv.URL+"/completion", body(llamacpp.Seed32(seed), seed)); err != nil || code != http.StatusOK {
		t.Fatalf("a trajflow_seed that folds to seed: %d %s %v", code, resp, err)
	}
}

func TestExact(t *testing.T) {
	policytest.Exact(t, policy.LlamaCpp, router, policytest.RequestOptions{StopEnd: true}, toServer)
}

// TestRouterVersions: one router serving two versions; each request names
// one and gets exactly its samples.
func TestRouterVersions(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	policytest.Release(t, dir, 2, false)
	srv := policytest.Start(t, policy.LlamaCpp, dir, reg, nil, 1, 2)
	reqs := policytest.Requests(reg, 50, 9, policytest.RequestOptions{StopEnd: true})
	ref := make([]model.Request, len(reqs))
	for i, r := range reqs {
		ref[i] = toServer(r)
	}
	for _, v := range []int64{1, 2} {
		got, err := router(t, srv.URL, 5*time.Second, policy.Want{Version: v}).Generate(context.Background(), reqs)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := policytest.Load(t, policytest.Release(t, t.TempDir(), v, false)).Generate(context.Background(), ref)
		for i := range reqs {
			if !policytest.Equal(got[i], want[i]) {
				t.Fatalf("version %d request %d: %+v, want %+v", v, i, got[i], want[i])
			}
		}
	}
	if _, err := router(t, srv.URL, time.Second, policy.Want{}).Generate(context.Background(), reqs[:1]); !errors.Is(err, policy.ErrConfig) {
		t.Fatalf("router without a version: %v", err)
	}
	_, err := router(t, srv.URL, time.Second, policy.Want{Version: 3}).Generate(context.Background(), reqs[:1])
	if ie, ok := policy.AsInfra(err); !ok || ie.Reason != policy.ReasonRejected {
		t.Fatalf("a version not loaded: %v", err)
	}
}

// TestStopCut: stop ids the server does not know are cut exactly; an
// end-of-generation id the settings lack is refused.
func TestStopCut(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	rel := policytest.Release(t, dir, 1, false)
	srv := policytest.Start(t, policy.LlamaCpp, dir, reg, nil, 1)
	c := single(1)(t, srv.URL, 5*time.Second, policy.Want{})
	reqs := policytest.Requests(reg, 200, 4, policytest.RequestOptions{StopEnd: true})
	cut := 0
	for i := range reqs {
		reqs[i].Settings.Stop = []int32{rollout.TokEnd, rollout.TokCall, rollout.TokKey0 + 1}
		reqs[i].Settings.MaxTokens = 6
	}
	got, err := c.Generate(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	ref := make([]model.Request, len(reqs))
	for i, r := range reqs {
		ref[i] = toServer(r)
	}
	want, _ := policytest.Load(t, rel).Generate(context.Background(), ref)
	for i := range reqs {
		if !policytest.Equal(got[i], want[i]) {
			t.Fatalf("request %d: %+v, want %+v", i, got[i], want[i])
		}
		if l := got[i].Tokens[len(got[i].Tokens)-1]; got[i].Finish == model.FinishStop && l != rollout.TokEnd {
			cut++
		}
	}
	if cut == 0 {
		t.Fatal("no sample was cut at a stop id the server does not know")
	}
	r := reqs[:1]
	r[0].Settings.Stop = nil
	r[0].Context = []int32{rollout.TokBOS, rollout.TokAct}
	r[0].Settings.MaxTokens = 3
	_, err = c.Generate(context.Background(), r)
	if !errors.Is(err, policy.ErrSettings) || policy.IsInfra(err) {
		t.Fatalf("end at END without END in the stop ids: %v", err)
	}
}

func TestFaults(t *testing.T) {
	probs := func(m map[string]any) []any { return m["completion_probabilities"].([]any) }
	entry := func(m map[string]any, i int) map[string]any { return probs(m)[i].(map[string]any) }
	policytest.Faults(t, policy.LlamaCpp, "/completion", "trajflow_logprob", single(1), []policytest.FaultCase{
		policytest.F("one entry too few", func(m map[string]any) { p := probs(m); m["completion_probabilities"] = p[:len(p)-1] }, policy.ReasonLengthMismatch),
		policytest.F("prob above 1", func(m map[string]any) {
			delete(entry(m, 0), "trajflow_logprob")
			entry(m, 0)["prob"] = json.Number("1.5")
		}, policy.ReasonPositiveLogprob),
		policytest.F("prob 0", func(m map[string]any) {
			delete(entry(m, 0), "trajflow_logprob")
			entry(m, 0)["prob"] = json.Number("0")
		}, policy.ReasonNaNLogprob),
		policytest.F("prob 0, log-prob below float32's range", func(m map[string]any) {
			entry(m, 0)["prob"] = json.Number("0")
			entry(m, 0)["trajflow_logprob"] = json.Number("-1e300")
		}, policy.ReasonNaNLogprob),
		policytest.F("raw logprob only", func(m map[string]any) {
			e := entry(m, 0)
			delete(e, "prob")
			e["logprob"] = json.Number("-0.5")
		}, policy.ReasonBadResponse),
		policytest.F("log-prob disagrees with prob", func(m map[string]any) { entry(m, 0)["trajflow_logprob"] = json.Number("-7") }, policy.ReasonBadResponse),
		policytest.F("id out of range", func(m map[string]any) {
			m["tokens"].([]any)[0] = json.Number("40")
			entry(m, 0)["id"] = json.Number("40")
		}, policy.ReasonTokenRange),
		policytest.F("entry of another id", func(m map[string]any) { entry(m, 0)["id"] = json.Number("30") }, policy.ReasonBadResponse),
		policytest.F("missing stop_type", func(m map[string]any) { delete(m, "stop_type") }, policy.ReasonBadResponse),
		policytest.F("stopped at a word", func(m map[string]any) {
			m["stop_type"] = "word"
			m["tokens"] = m["tokens"].([]any)[:1]
			m["completion_probabilities"] = probs(m)[:1]
		}, policy.ReasonBadResponse),
		policytest.F("served by another model", func(m map[string]any) { m["model"] = policy.ModelName(5) }, policy.ReasonVersionMismatch),
		policytest.F("prompt truncated", func(m map[string]any) { m["truncated"] = true }, policy.ReasonRejected),
		policytest.F("prompt not all evaluated", func(m map[string]any) { m["tokens_evaluated"] = json.Number("2") }, policy.ReasonBadResponse),
		// n_predict is 3: four ids are more than asked, even where the
		// client would cut them after a stop id.
		policytest.F("more ids than n_predict, a stop id among them", func(m map[string]any) {
			ids := []int32{rollout.TokKey0, rollout.TokEnd, rollout.TokKey0 + 1, rollout.TokKey0 + 2}
			toks, ps := []any{}, []any{}
			for _, id := range ids {
				n := json.Number(fmt.Sprint(id))
				toks = append(toks, n)
				ps = append(ps, map[string]any{"id": n, "prob": json.Number("0.5")})
			}
			m["tokens"], m["completion_probabilities"], m["stop_type"] = toks, ps, "limit"
		}, policy.ReasonBadResponse),
		policytest.F("no ids, stop_type limit", func(m map[string]any) {
			m["tokens"], m["completion_probabilities"], m["stop_type"] = []any{}, []any{}, "limit"
		}, policy.ReasonBadResponse),
		policytest.F("ids as strings", func(m map[string]any) {
			ids := m["tokens"].([]any)
			for i, id := range ids {
				ids[i] = fmt.Sprint(id)
			}
		}, policy.ReasonBadResponse),
		policytest.F("prob as a string", func(m map[string]any) {
			delete(entry(m, 0), "trajflow_logprob")
			entry(m, 0)["prob"] = "0.5"
		}, policy.ReasonBadResponse),
		policytest.F("negative id", func(m map[string]any) {
			m["tokens"].([]any)[0] = json.Number("-1")
			entry(m, 0)["id"] = json.Number("-1")
		}, policy.ReasonTokenRange),
	})
}

// TestRouterModel: a router's answer must name the model asked for; one
// naming another model, or none, is a version_mismatch naming the field
// and the server.
func TestRouterModel(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	fault := &policytest.Fault{Prefix: "/completion"}
	srv := policytest.Start(t, policy.LlamaCpp, dir, reg, func(h http.Handler) http.Handler { fault.Next = h; return fault }, 1)
	req := policytest.HostileRequest(reg)
	for _, tc := range []struct {
		name  string
		model any // nil: the field is left out
	}{{"another model", "smollm2-135m-instruct"}, {"a model path", "/models/policy-v00000001.gguf"}, {"no model", nil}, {"another version", policy.ModelName(2)}} {
		t.Run(tc.name, func(t *testing.T) {
			fault.Set(policytest.FaultEdit, 0, policytest.EditJSON(func(m map[string]any) {
				if tc.model == nil {
					delete(m, "model")
				} else {
					m["model"] = tc.model
				}
			}))
			defer fault.Set(policytest.FaultNone, 0, nil)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			_, err := router(t, srv.URL, 5*time.Second, policy.Exactly(1)).Generate(ctx, req)
			ie, ok := policy.AsInfra(err)
			if !ok || ie.Reason != policy.ReasonVersionMismatch || ie.Addr != srv.URL || !strings.Contains(ie.Detail, "model") {
				t.Fatalf("err %v, want a version_mismatch naming model at %s", err, srv.URL)
			}
		})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if s, err := router(t, srv.URL, 5*time.Second, policy.Exactly(1)).Generate(ctx, req); err != nil || s[0].PolicyVersion != 1 {
		t.Fatalf("the model asked for: %+v %v", s, err)
	}
}

// TestHostile: a server that misbehaves at the HTTP level (oversized,
// stalled or endless bodies, 429/503, redirects, garbage encodings) gets
// an InfraError naming it, on /completion and on the info endpoints.
func TestHostile(t *testing.T) {
	policytest.Hostile(t, policy.LlamaCpp, "/completion", single(1))
}

// TestPostSamplingProb: without trajflow_logprob (as from a real
// llama-server), float32(log(prob)) is the sampler's log-prob bit for bit
// unless the log-prob is within ~1e-9 of 0, where a double prob cannot
// carry it (then it is within 1e-15).
func TestPostSamplingProb(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	rel := policytest.Release(t, dir, 1, true)
	fault := &policytest.Fault{Prefix: "/completion"}
	srv := policytest.Start(t, policy.LlamaCpp, dir, reg, func(h http.Handler) http.Handler { fault.Next = h; return fault }, 1)
	fault.Set(policytest.FaultEdit, 0, policytest.EditJSON(func(m map[string]any) {
		for _, e := range m["completion_probabilities"].([]any) {
			delete(e.(map[string]any), "trajflow_logprob")
		}
	}))
	reqs := policytest.Requests(reg, 300, 5, policytest.RequestOptions{StopEnd: true})
	got, err := single(1)(t, srv.URL, 5*time.Second, policy.Want{}).Generate(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	ref := make([]model.Request, len(reqs))
	for i, r := range reqs {
		ref[i] = toServer(r)
	}
	want, _ := policytest.Load(t, rel).Generate(context.Background(), ref)
	exact, small, tiny := 0, 0, 0
	for i := range reqs {
		for k, lp := range want[i].Logprobs {
			g := got[i].Logprobs[k]
			switch {
			case math.Float32bits(g) == math.Float32bits(lp):
				exact++
				if lp < 0 && lp > -1e-6 {
					small++
				}
			case lp > -1e-9 && math.Abs(float64(g-lp)) < 1e-15:
				tiny++
			default:
				t.Fatalf("request %d token %d: log(prob) %v, sampler %v", i, k, g, lp)
			}
		}
	}
	t.Logf("float32(log(prob)): %d log-probs bit-identical (%d of them in (-1e-6, 0)), %d within 1e-15 in (-1e-9, 0)", exact, small, tiny)
	if small == 0 {
		t.Fatal("no log-prob near 0: the peaked model does not probe the double-prob path")
	}
	// Why trajflow_logprob exists: a double cannot carry every float32
	// log-prob this close to 0 through exp and log.
	x := float32(-1e-10)
	if float32(math.Log(math.Exp(float64(x)))) == x {
		t.Fatal("exp/log round trip of -1e-10 is exact; the extension's reason is gone")
	}
}

func TestTokenizer(t *testing.T) {
	reg := policytest.Registry(t)
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	srv := policytest.Start(t, policy.LlamaCpp, dir, reg, nil, 1)
	c := router(t, srv.URL, time.Second, policy.Want{Version: 1}).(*llamacpp.Client)
	ctx := context.Background()
	prompt, err := c.ApplyTemplate(ctx, []rollout.ChatMessage{{Role: "user", Content: "TASK K2"}}, true)
	if err != nil || prompt != "<bos> TASK K2 ACT" {
		t.Fatalf("apply template: %q %v", prompt, err)
	}
	ids, err := c.Tokenize(ctx, prompt)
	if err != nil || len(ids) != 4 || ids[0] != rollout.TokBOS || ids[2] != rollout.TokKey0+2 || ids[3] != rollout.TokAct {
		t.Fatalf("tokenize: %v %v", ids, err)
	}
	if text, err := c.Detokenize(ctx, ids); err != nil || text != prompt {
		t.Fatalf("detokenize: %q %v", text, err)
	}
	if _, err := c.Identity(ctx); err != nil || c.TokenizerHash() != rollout.TokenizerHash || c.ChatTemplateHash() == "" {
		t.Fatalf("hashes %q %q %v", c.TokenizerHash(), c.ChatTemplateHash(), err)
	}
}

func FuzzGenerate(f *testing.F) {
	policytest.FuzzGenerate(f, policy.LlamaCpp, "/completion", single(1))
}
