// Package llamacpp is the client of llama.cpp's llama-server for
// trajflow's rollout (rollout.Policy, rollout.Tokenizer): token-id prompts
// in, exact ids and sampling-distribution log-probs out.
//
// One request per model.Request:
//
//	POST /completion {"prompt": [ids...], "n_predict": MaxTokens, "seed": Seed32(Request.Seed),
//	  "temperature": T, "top_k": K (0 = off), "top_p": P (1 = off),
//	  "samplers": ["temperature", "top_k", "top_p"],
//	  "min_p": 0, "typical_p": 1, "repeat_penalty": 1, "repeat_last_n": 0,
//	  "presence_penalty": 0, "frequency_penalty": 0, "dry_multiplier": 0,
//	  "xtc_probability": 0, "mirostat": 0, "top_n_sigma": -1, "dynatemp_range": 0,
//	  "n_probs": 1, "post_sampling_probs": true, "return_tokens": true,
//	  "cache_prompt": false, "stream": false, "model": NAME (router mode)}
//
// The sampler chain. llama-server's defaults are not neutral (temperature
// 0.8, top_k 40, top_p 0.95, min_p 0.05, penalties, DRY, XTC); every
// setting is sent, and "samplers" restricts the chain to temperature, then
// top-k, then top-p: the order of model.Behavior (truncation of the
// tempered distribution; llama-server's default order applies temperature
// last). The fields sent are hashed into SamplerID.
//
// Log-probs. completion_probabilities[i].logprob is of the raw
// distribution (temperature 1, before the chain), whatever the request's
// temperature. With post_sampling_probs the entries carry `prob`, the
// probability after the chain, i.e. under the distribution the id was
// sampled from; the client records float32(log(prob)). llama-server's
// prob is a float32, so a log-prob closer to 0 than ~6e-8 carries that
// float32's resolution (the best the server has). A server that also
// sends `trajflow_logprob` (trajflow serve policy) gives the sampler's
// float32 log-prob itself, which a double prob cannot carry near 0; the
// client takes it after checking it agrees with prob.
//
// Stop ids. llama-server has no stop-id field: it ends at an
// end-of-generation id (EOS, end of turn) or after n_predict ids. The
// client cuts the ids after the first id of Settings.Stop and reports
// FinishStop. This is exact: ids are sampled one after another, each from
// the prefix before it, so the ids up to the first stop id are those a
// server that stopped there would have returned; the ids after it are
// generated and dropped (the cost of the mapping). A server that ended at
// an end-of-generation id that is not in Settings.Stop ended the sample
// under a rule the settings do not have: that is an ErrSettings error (add
// the model's end-of-generation ids to the stop ids), not a sample.
//
// The seed. llama-server's seed is 32 bits and 0xFFFFFFFF means "random";
// Seed32 folds the 64-bit request seed (identity below 2^32-1).
//
// cache_prompt is false: llama.cpp documents that reusing the KV cache
// can change logits with batch composition, and a sample must not depend
// on which requests came before it. Prefix reuse is a speed knob here, not
// worth a log-prob that differs from its replay (Config.CachePrompt turns
// it on, and is hashed into SamplerID).
//
// Router mode (llama-server --models-dir): the request's "model" is
// policy.ModelName of the wanted version (Want.Version; required), and the
// sample's PolicyVersion is that version; an answer whose "model" is not
// that name (another version, another model, or none) is a
// version_mismatch. Completions are sent with
// ?autoload=false, so a request for a version that is not loaded fails
// (rejected) instead of making the router load it: versions are loaded by
// weight sync only.
package llamacpp

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"sync/atomic"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// Config configures a Client.
type Config struct {
	policy.ClientConfig
	// Router: the server is a router over several models, one per policy
	// version, named policy.ModelName(version); each request names the
	// model of its wanted version.
	Router bool
	// Version is the policy version of a single-model server (0, the
	// initial policy, unless set; ignored with Router).
	Version int64
	// CachePrompt sends cache_prompt true (see the package comment).
	CachePrompt bool
}

// Client is a llama-server client. It is safe for concurrent use.
type Client struct {
	cfg  Config
	conn *policy.Conn
	id   policy.IdentityCache
	// acked is the newest version weight sync acknowledged (Served), -1
	// before: a router's tokenizer calls name its model.
	acked atomic.Int64
}

var (
	_ policy.Client     = (*Client)(nil)
	_ rollout.Tokenizer = (*Client)(nil)
)

// New returns a client of the server at cfg.Addr (nothing is sent yet).
func New(cfg Config) (*Client, error) {
	if !cfg.Router && cfg.Version < 0 {
		return nil, fmt.Errorf("llamacpp: %w: a single-model server's Config.Version %d is not a policy version", policy.ErrConfig, cfg.Version)
	}
	conn, err := cfg.Resolve()
	if err != nil {
		return nil, fmt.Errorf("llamacpp: %w", err)
	}
	c := &Client{cfg: cfg, conn: conn}
	c.acked.Store(-1)
	return c, nil
}

// Served records that weight sync acknowledged version v on the server
// (gateway.SetReady calls it): a router's tokenizer calls, which carry no
// version, name the model of the newest such version.
func (c *Client) Served(v int64) {
	for {
		cur := c.acked.Load()
		if v <= cur || c.acked.CompareAndSwap(cur, v) {
			return
		}
	}
}

// Close drops idle connections.
func (c *Client) Close() { c.conn.Close() }

// Protocol implements policy.Client.
func (c *Client) Protocol() string { return policy.LlamaCpp }

// Addr implements policy.Client.
func (c *Client) Addr() string { return c.conn.Addr }

// Health implements policy.Client.
func (c *Client) Health(ctx context.Context) error {
	var h struct {
		Status string `json:"status"`
	}
	if err := c.conn.Call(ctx, "GET", "/health", nil, &h); err != nil {
		return err
	}
	if h.Status != "ok" {
		return policy.Infra(policy.ReasonServerError, c.conn.Addr, "GET /health: status %q", h.Status)
	}
	return nil
}

// Seed32 is the 32-bit llama-server seed of a 64-bit request seed: the
// xor of its halves (so seeds below 2^32-1 are sent as they are), with
// 0xFFFFFFFF, llama-server's "random seed", mapped to 0xFFFFFFFE.
func Seed32(s uint64) uint32 {
	x := uint32(s) ^ uint32(s>>32)
	if x == math.MaxUint32 {
		x--
	}
	return x
}

type completionReq struct {
	Prompt            []int32  `json:"prompt"`
	NPredict          int      `json:"n_predict"`
	Seed              uint32   `json:"seed"`
	Temperature       float64  `json:"temperature"`
	TopK              int      `json:"top_k"`
	TopP              float64  `json:"top_p"`
	Samplers          []string `json:"samplers"`
	MinP              float64  `json:"min_p"`
	TypicalP          float64  `json:"typical_p"`
	RepeatPenalty     float64  `json:"repeat_penalty"`
	RepeatLastN       int      `json:"repeat_last_n"`
	PresencePenalty   float64  `json:"presence_penalty"`
	FrequencyPenalty  float64  `json:"frequency_penalty"`
	DryMultiplier     float64  `json:"dry_multiplier"`
	XTCProbability    float64  `json:"xtc_probability"`
	Mirostat          int      `json:"mirostat"`
	TopNSigma         float64  `json:"top_n_sigma"`
	DynatempRange     float64  `json:"dynatemp_range"`
	NProbs            int      `json:"n_probs"`
	PostSamplingProbs bool     `json:"post_sampling_probs"`
	ReturnTokens      bool     `json:"return_tokens"`
	CachePrompt       bool     `json:"cache_prompt"`
	Stream            bool     `json:"stream"`
	Model             string   `json:"model,omitempty"`
	// TrajflowSeed is the request's whole 64-bit seed, sent only to a
	// server whose /props says it reads it (trajflow serve policy:
	// "trajflow_seed": true), so that the built-in policy behind this
	// protocol samples exactly as in process. llama-server's seed is the
	// 32-bit Seed32.
	TrajflowSeed *uint64 `json:"trajflow_seed,omitempty"`
}

func (c *Client) params(s model.Settings) completionReq {
	topP := s.TopP
	if topP == 0 {
		topP = 1
	}
	return completionReq{
		NPredict: s.MaxTokens, Temperature: s.Temperature, TopK: s.TopK, TopP: topP,
		Samplers: []string{"temperature", "top_k", "top_p"}, TypicalP: 1, RepeatPenalty: 1, TopNSigma: -1,
		NProbs: 1, PostSamplingProbs: true, ReturnTokens: true, CachePrompt: c.cfg.CachePrompt,
	}
}

// SamplerID implements policy.Client. The stop rule (ids cut after the
// first stop id; the server's end-of-generation ids end the sample) is
// part of what is hashed.
func (c *Client) SamplerID(s model.Settings) string {
	b, _ := json.Marshal(c.params(s)) // plain struct: cannot fail
	return policy.SamplerID(c.id.Cached(), s, string(b)+" stop:cut-after-first-stop-id,server-eog-ends")
}

type completionResp struct {
	Tokens *[]int64 `json:"tokens"`
	Probs  *[]struct {
		ID              *int64       `json:"id"`
		Prob            policy.Float `json:"prob"`
		Logprob         policy.Float `json:"logprob"`
		TrajflowLogprob policy.Float `json:"trajflow_logprob"`
	} `json:"completion_probabilities"`
	StopType        *string `json:"stop_type"`
	Model           string  `json:"model"`
	Truncated       bool    `json:"truncated"`
	TokensEvaluated *int    `json:"tokens_evaluated"`
}

// Generate implements rollout.Policy with the client's Want.
func (c *Client) Generate(ctx context.Context, reqs []model.Request) ([]model.Sample, error) {
	return policy.Generate(ctx, reqs, c.cfg.Concurrency, c.cfg.Want, c.one)
}

// GenerateEach implements policy.Client.
func (c *Client) GenerateEach(ctx context.Context, reqs []model.Request, want policy.Want) ([]model.Sample, []error) {
	return policy.GenerateEach(ctx, reqs, c.cfg.Concurrency, want, c.one)
}

// served is the version a request is served by and the model it names.
func (c *Client) served(want policy.Want) (int64, string, error) {
	if !c.cfg.Router {
		return c.cfg.Version, "", nil
	}
	if want.Any() {
		return 0, "", fmt.Errorf("llamacpp: %w: a router names the model of a version: want a version (policy.Exactly, policy.AtLeast)", policy.ErrConfig)
	}
	return want.Version, policy.ModelName(want.Version), nil
}

func (c *Client) one(ctx context.Context, r model.Request, want policy.Want) (model.Sample, error) {
	if err := r.Settings.Validate(); err != nil {
		return model.Sample{}, fmt.Errorf("llamacpp: %w", err)
	}
	version, name, err := c.served(want)
	if err != nil {
		return model.Sample{}, err
	}
	if err := want.Check(c.conn.Addr, version); err != nil {
		return model.Sample{}, err
	}
	id, err := c.Identity(ctx)
	if err != nil {
		return model.Sample{}, err
	}
	if err := policy.CheckGrammar(id, r.Settings); err != nil {
		return model.Sample{}, err
	}
	q := c.params(r.Settings)
	q.Prompt, q.Seed, q.Model = r.Context, Seed32(r.Seed), name
	if id.Seed64 {
		seed := r.Seed
		q.TrajflowSeed = &seed
	}
	var resp completionResp
	path := "/completion"
	if c.cfg.Router {
		path += "?autoload=false" // a request never makes the router load a version weight sync did not
	}
	if err := c.conn.Call(ctx, "POST", path, q, &resp); err != nil {
		return model.Sample{}, err
	}
	addr := c.conn.Addr
	switch {
	case resp.Tokens == nil:
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /completion: missing tokens (return_tokens)")
	case resp.Probs == nil:
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /completion: missing completion_probabilities (n_probs)")
	case resp.StopType == nil:
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /completion: missing stop_type")
	case resp.Truncated:
		return model.Sample{}, policy.Infra(policy.ReasonRejected, addr, "POST /completion: the prompt of %d ids was truncated to the server's context", len(r.Context))
	case !c.cfg.CachePrompt && resp.TokensEvaluated != nil && *resp.TokensEvaluated != len(r.Context):
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /completion: tokens_evaluated %d, the prompt has %d ids", *resp.TokensEvaluated, len(r.Context))
	}
	if name != "" && resp.Model != name {
		// A router names the model that answered: any other name (or none)
		// is not the version asked for.
		return model.Sample{}, policy.Infra(policy.ReasonVersionMismatch, addr, "POST /completion: model %q answered, asked for %s", resp.Model, name)
	}
	if v, err := policy.ParseModelName(resp.Model); err == nil && v != version {
		return model.Sample{}, policy.Infra(policy.ReasonVersionMismatch, addr, "POST /completion: answered by model %s, asked for version %d", resp.Model, version)
	}
	toks, probs := *resp.Tokens, *resp.Probs
	raw := policy.Raw{Tokens: toks, Version: version, TokensField: "tokens", LogprobsField: "completion_probabilities"}
	for i, p := range probs {
		if p.ID == nil || (i < len(toks) && *p.ID != toks[i]) {
			if len(probs) < len(toks) {
				// llama-server leaves out the entry of a token after which
				// the text ends inside a UTF-8 character (deploy/local/
				// LLAMA.md): that token's log-prob is unknown.
				return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "completion_probabilities[%d].id does not match tokens[%d]: %d entries for %d tokens (the server left out the entry of a token, so its log-prob is unknown)", i, i, len(probs), len(toks))
			}
			return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "completion_probabilities[%d].id does not match tokens[%d]", i, i)
		}
		if !p.Prob.Set {
			return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "completion_probabilities[%d].prob missing: the server did not honor post_sampling_probs", i)
		}
		lp := math.Log(p.Prob.V) // a prob of 0 gives -Inf, refused by Check
		if p.TrajflowLogprob.Set {
			x := p.TrajflowLogprob.V
			if !(math.Abs(math.Exp(x)-p.Prob.V) <= 1e-6*p.Prob.V+1e-300) {
				return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "completion_probabilities[%d]: trajflow_logprob %v disagrees with prob %v", i, x, p.Prob.V)
			}
			lp = x
		}
		raw.Logprobs = append(raw.Logprobs, lp)
	}
	if len(raw.Logprobs) != len(raw.Tokens) {
		return model.Sample{}, policy.Infra(policy.ReasonLengthMismatch, addr, "%d ids in tokens, %d entries in completion_probabilities", len(raw.Tokens), len(raw.Logprobs))
	}
	if len(toks) > r.Settings.MaxTokens {
		// More than n_predict is a server that did not do what was asked:
		// cutting at a stop id below must not hide it.
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /completion: %d ids in tokens, n_predict %d", len(toks), r.Settings.MaxTokens)
	}
	// Cut after the first stop id (exact: see the package comment).
	for i, t := range toks {
		if t >= 0 && t <= math.MaxInt32 && slices.Contains(r.Settings.Stop, int32(t)) {
			raw.Tokens, raw.Logprobs = toks[:i+1], raw.Logprobs[:i+1]
			raw.Finish = policy.FinishStop
			break
		}
	}
	if raw.Finish == "" {
		switch *resp.StopType {
		case "limit":
			raw.Finish = policy.FinishLength
		case "eos":
			if len(toks) > 0 {
				return model.Sample{}, fmt.Errorf("llamacpp %s: %w: the server ended at end-of-generation id %d, which is not among the stop ids %v (add the model's end-of-generation ids to them)",
					addr, policy.ErrSettings, toks[len(toks)-1], r.Settings.Stop)
			}
			raw.Finish = policy.FinishStop
		default:
			return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /completion: stop_type %q (no stop words were sent)", *resp.StopType)
		}
	}
	return policy.Check(addr, r, id.Vocab, want, raw)
}

// Identity implements policy.Client: GET /props (build, model path, chat
// template; and trajflow serve's vocabulary, tokenizer hash and grammar)
// and GET /v1/models (the vocabulary of a loaded model).
func (c *Client) Identity(ctx context.Context) (policy.Identity, error) {
	return c.id.Get(ctx, func(ctx context.Context) (policy.Identity, error) {
		var props struct {
			BuildInfo     string `json:"build_info"`
			ModelPath     string `json:"model_path"`
			ChatTemplate  string `json:"chat_template"`
			NVocab        int    `json:"n_vocab"`
			TokenizerHash string `json:"tokenizer_hash"`
			Grammar       string `json:"grammar"`
			TrajflowSeed  bool   `json:"trajflow_seed"`
		}
		err := c.conn.Call(ctx, "GET", "/props", nil, &props)
		if ie, ok := policy.AsInfra(err); ok && ie.Reason == policy.ReasonRejected && c.cfg.Router {
			err = nil // a router without a model to ask: the models list below still names it
			props.BuildInfo = "router"
		}
		if err != nil {
			return policy.Identity{}, err
		}
		var models struct {
			Data []struct {
				ID   string `json:"id"`
				Path string `json:"path"`
				Meta *struct {
					NVocab int `json:"n_vocab"`
				} `json:"meta"`
			} `json:"data"`
		}
		if err := c.conn.Call(ctx, "GET", "/v1/models", nil, &models); err != nil {
			return policy.Identity{}, err
		}
		vocab := props.NVocab
		for _, m := range models.Data {
			if vocab == 0 && m.Meta != nil {
				vocab = m.Meta.NVocab
			}
		}
		th, err := c.cfg.ResolveTokenizer(props.TokenizerHash)
		if err != nil {
			return policy.Identity{}, err
		}
		tpl := ""
		if props.ChatTemplate != "" {
			tpl = policy.HashText(props.ChatTemplate)
		}
		mp, modelHash := props.ModelPath, ""
		if c.cfg.Router {
			mp = "router"
		} else if th == "" && mp != "" {
			// A GGUF file embeds its tokenizer: a llama-server reports no
			// tokenizer hash, so the model file's sha256 names it (and the
			// weights), when the file is readable here.
			if h, err := fileSHA256(mp); err == nil {
				th, modelHash = h, h
			}
		}
		return policy.Identity{
			Protocol: policy.LlamaCpp, Addr: c.conn.Addr, Server: "llama.cpp " + props.BuildInfo, Model: mp, ModelHash: modelHash,
			Vocab: vocab, TokenizerHash: th, ChatTemplateHash: tpl, Grammar: props.Grammar,
			Logprobs: "log(completion_probabilities[i].prob) with post_sampling_probs (after temperature, top-k, top-p)",
			Seed64:   props.TrajflowSeed,
		}, nil
	})
}

// modelField is the "model" of tokenizer calls in router mode (the newest
// version acknowledged by Served, else the client's Want version), empty
// otherwise. Every version of a policy shares its tokenizer.
func (c *Client) modelField() string {
	if !c.cfg.Router {
		return ""
	}
	if v := c.acked.Load(); v >= 0 {
		return policy.ModelName(v)
	}
	if !c.cfg.Want.Any() {
		return policy.ModelName(c.cfg.Want.Version)
	}
	return ""
}

// ApplyTemplate implements rollout.Tokenizer (POST /apply-template).
func (c *Client) ApplyTemplate(ctx context.Context, msgs []rollout.ChatMessage, addGenerationPrompt bool) (string, error) {
	q := map[string]any{"messages": msgs, "add_generation_prompt": addGenerationPrompt}
	if m := c.modelField(); m != "" {
		q["model"] = m
	}
	var resp struct {
		Prompt *string `json:"prompt"`
	}
	if err := c.conn.Call(ctx, "POST", "/apply-template", q, &resp); err != nil {
		return "", err
	}
	if resp.Prompt == nil {
		return "", policy.Infra(policy.ReasonBadResponse, c.conn.Addr, "POST /apply-template: missing prompt")
	}
	return *resp.Prompt, nil
}

// Tokenize implements rollout.Tokenizer (POST /tokenize: special tokens
// parsed, no BOS added).
func (c *Client) Tokenize(ctx context.Context, text string) ([]int32, error) {
	q := map[string]any{"content": text, "add_special": false, "parse_special": true}
	if m := c.modelField(); m != "" {
		q["model"] = m
	}
	var resp struct {
		Tokens *[]int32 `json:"tokens"`
	}
	if err := c.conn.Call(ctx, "POST", "/tokenize", q, &resp); err != nil {
		return nil, err
	}
	if resp.Tokens == nil {
		return nil, policy.Infra(policy.ReasonBadResponse, c.conn.Addr, "POST /tokenize: missing tokens")
	}
	return *resp.Tokens, nil
}

// Detokenize implements rollout.Tokenizer (POST /detokenize).
func (c *Client) Detokenize(ctx context.Context, ids []int32) (string, error) {
	q := map[string]any{"tokens": ids}
	if m := c.modelField(); m != "" {
		q["model"] = m
	}
	var resp struct {
		Content *string `json:"content"`
	}
	if err := c.conn.Call(ctx, "POST", "/detokenize", q, &resp); err != nil {
		return "", err
	}
	if resp.Content == nil {
		return "", policy.Infra(policy.ReasonBadResponse, c.conn.Addr, "POST /detokenize: missing content")
	}
	return *resp.Content, nil
}

// TokenizerHash implements rollout.Tokenizer (from the identity).
func (c *Client) TokenizerHash() string { return c.id.Cached().TokenizerHash }

// ChatTemplateHash implements rollout.Tokenizer (from the identity).
func (c *Client) ChatTemplateHash() string { return c.id.Cached().ChatTemplateHash }

// fileSHA256 is "sha256:<hex>" of a file.
func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}
