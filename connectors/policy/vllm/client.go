// Package vllm is the client of vLLM for trajflow's rollout
// (rollout.Policy, rollout.Tokenizer): its token-in/token-out API where the
// server has it, else its OpenAI-style completions API.
//
// One request per model.Request:
//
//	POST /inference/v1/generate {"request_id": Request.ID, "token_ids": [...], "stream": false,
//	  "sampling_params": {"n": 1, "max_tokens": MaxTokens, "temperature": T,
//	    "top_p": P (1 = off), "top_k": K (-1 = off), "min_p": 0, "presence_penalty": 0,
//	    "frequency_penalty": 0, "repetition_penalty": 1, "seed": Request.Seed,
//	    "stop_token_ids": Stop, "ignore_eos": true, "min_tokens": 0, "logprobs": 0,
//	    "skip_special_tokens": false, "detokenize": false}}
//
// The answer's choices[0].token_ids and logprobs.content[i].logprob (each
// entry's "token_id:N" checked against the id) make the sample.
//
// That endpoint is in recent vLLM builds only. When a server answers it
// 404, the client sends that request, and every later one, to the
// completions API every vLLM server has (the decision is the client's, made
// once; Identity.Endpoint records it):
//
//	POST /v1/completions {"model": the id GET /v1/models lists first, "prompt": [token ids],
//	  the same sampling fields at the top level (seed as a signed 64-bit integer),
//	  "return_tokens_as_token_ids": true, "return_token_ids": true, "stream": false, "echo": false}
//
// What the client relies on there, as vLLM defines it: a prompt that is a
// list of ints is taken as token ids, untokenized; "logprobs": 0 returns
// the log-prob of each sampled token and no alternatives, and with
// return_tokens_as_token_ids each logprobs.tokens entry is "token_id:N"
// rather than text; return_token_ids (vLLM 0.10.2 and later; older servers
// ignore it) adds choices[0].token_ids. Without token_ids the ids are read
// from the "token_id:N" entries; with both they must agree, entry for
// entry. logprobs.token_logprobs are clamped at -9999 by vLLM, and null
// where vLLM has none: both are refused. finish_reason is "stop" (at a stop
// id, the last of token_ids), "length", "abort", or "error" (newer servers
// answer 500 instead). include_stop_str_in_output is left at its default:
// it decides whether text shows a stop id's text, not whether token_ids
// and the log-probs hold the id (they do).
//
// Fields left out of a completions request take the model's generation
// config's defaults, so every sampling field is sent; a generation
// config's own stop ids are added to the request's by vLLM, and a sample
// ending at one the settings lack is refused (bad_response: start the
// server with --generation-config vllm, or put them in the settings). The
// seed is bounded to signed 64 bits there: the client sends the request's
// seed as its two's-complement int64, which the torch generator vLLM seeds
// reads as the same 64 bits. The model id is read again whenever the
// weight version changes (a server that names its models by version, as
// trajflow serve policy does, serves a new name after an update, and
// refuses the old one with 404: a request of a batch during which the
// version changed fails with version_mismatch, like the others). Both
// calls carry the same sampler values, so the sampler id does not depend
// on the endpoint. A 404 from anything in front of the server (a proxy
// that routes only /v1/...) also makes the switch.
//
// The server must run with --logprobs-mode processed_logprobs, so that the
// log-probs are of the sampling distribution (after temperature and
// top-k/top-p), not the raw model's, on either endpoint; the identity
// records the mode (verified when the server's /server_info reports it).
// vLLM answers carry no weight version: the client reads GET /weight_info
// before and after each batch, and a batch during which it changed fails
// with version_mismatch (to be retried). This is exact under the
// weight-update protocol of connectors/policy/weightsync (pause in wait
// mode, update, finish with the version, resume): a request either
// finishes before the pause or starts after the resume, so it runs on one
// version, and the version label changes only while no request runs.
package vllm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"sync/atomic"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// ProcessedLogprobs is the --logprobs-mode a training client needs.
const ProcessedLogprobs = "processed_logprobs"

// Config configures a Client.
type Config struct {
	policy.ClientConfig
	// LogprobsMode is the server's --logprobs-mode; "" means
	// processed_logprobs, the only mode accepted (raw log-probs are not
	// the behavior distribution once temperature or truncation apply).
	LogprobsMode string
}

// Client is a vLLM client. It is safe for concurrent use.
type Client struct {
	cfg  Config
	conn *policy.Conn
	id   policy.IdentityCache
	// openAI is set once the server answered POST /inference/v1/generate
	// 404: generation goes to POST /v1/completions from then on.
	openAI atomic.Bool
	models modelCache // the model id completions name
}

var (
	_ policy.Client     = (*Client)(nil)
	_ rollout.Tokenizer = (*Client)(nil)
)

// New returns a client of the server at cfg.Addr (nothing is sent yet).
func New(cfg Config) (*Client, error) {
	if cfg.LogprobsMode == "" {
		cfg.LogprobsMode = ProcessedLogprobs
	}
	if cfg.LogprobsMode != ProcessedLogprobs {
		return nil, fmt.Errorf("vllm: %w: logprobs mode %q: the recorded log-probs must be the sampling distribution's (%s)", policy.ErrConfig, cfg.LogprobsMode, ProcessedLogprobs)
	}
	conn, err := cfg.Resolve()
	if err != nil {
		return nil, fmt.Errorf("vllm: %w", err)
	}
	return &Client{cfg: cfg, conn: conn}, nil
}

// Close drops idle connections.
func (c *Client) Close() { c.conn.Close() }

// Protocol implements policy.Client.
func (c *Client) Protocol() string { return policy.VLLM }

// Addr implements policy.Client.
func (c *Client) Addr() string { return c.conn.Addr }

// Health implements policy.Client.
func (c *Client) Health(ctx context.Context) error {
	return c.conn.Call(ctx, "GET", "/health", nil, nil)
}

type samplingParams struct {
	N                 int     `json:"n"`
	MaxTokens         int     `json:"max_tokens"`
	Temperature       float64 `json:"temperature"`
	TopP              float64 `json:"top_p"`
	TopK              int     `json:"top_k"`
	MinP              float64 `json:"min_p"`
	PresencePenalty   float64 `json:"presence_penalty"`
	FrequencyPenalty  float64 `json:"frequency_penalty"`
	RepetitionPenalty float64 `json:"repetition_penalty"`
	Seed              uint64  `json:"seed"`
	StopTokenIDs      []int32 `json:"stop_token_ids"`
	IgnoreEOS         bool    `json:"ignore_eos"`
	MinTokens         int     `json:"min_tokens"`
	Logprobs          int     `json:"logprobs"`
	SkipSpecialTokens bool    `json:"skip_special_tokens"`
	Detokenize        bool    `json:"detokenize"`
}

func params(s model.Settings) samplingParams {
	topP, topK := s.TopP, s.TopK
	if topP == 0 {
		topP = 1
	}
	if topK == 0 {
		topK = -1
	}
	return samplingParams{
		N: 1, MaxTokens: s.MaxTokens, Temperature: s.Temperature, TopP: topP, TopK: topK, RepetitionPenalty: 1,
		StopTokenIDs: append([]int32{}, s.Stop...), IgnoreEOS: true,
	}
}

// SamplerID implements policy.Client.
func (c *Client) SamplerID(s model.Settings) string {
	b, _ := json.Marshal(params(s)) // plain struct: cannot fail
	return policy.SamplerID(c.id.Cached(), s, string(b))
}

type generateReq struct {
	RequestID      string         `json:"request_id,omitempty"`
	TokenIDs       []int32        `json:"token_ids"`
	SamplingParams samplingParams `json:"sampling_params"`
	Stream         bool           `json:"stream"`
}

type generateResp struct {
	Choices *[]struct {
		TokenIDs *[]int64 `json:"token_ids"`
		Logprobs *struct {
			Content *[]struct {
				Token   string       `json:"token"`
				Logprob policy.Float `json:"logprob"`
			} `json:"content"`
		} `json:"logprobs"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
}

// Generate implements rollout.Policy with the client's Want.
func (c *Client) Generate(ctx context.Context, reqs []model.Request) ([]model.Sample, error) {
	out, errs := c.GenerateEach(ctx, reqs, c.cfg.Want)
	if errs != nil {
		return nil, policy.FirstError(ctx, errs)
	}
	return out, nil
}

// GenerateEach implements policy.Client: the weight version is read
// before and after the batch (see the package comment); when it changed,
// every request fails with version_mismatch but those that failed
// otherwise (a completion refused 404 for its model's old name excepted).
func (c *Client) GenerateEach(ctx context.Context, reqs []model.Request, want policy.Want) ([]model.Sample, []error) {
	fail := func(err error) ([]model.Sample, []error) {
		errs := make([]error, len(reqs))
		for i := range errs {
			errs[i] = err
		}
		return make([]model.Sample, len(reqs)), errs
	}
	if len(reqs) == 0 {
		return nil, nil
	}
	id, err := c.Identity(ctx)
	if err != nil {
		return fail(err)
	}
	before, err := c.WeightVersion(ctx)
	if err != nil {
		return fail(err)
	}
	if err := want.Check(c.conn.Addr, before); err != nil {
		return fail(err)
	}
	out, errs := policy.GenerateEach(ctx, reqs, c.cfg.Concurrency, policy.Want{}, func(ctx context.Context, r model.Request, _ policy.Want) (model.Sample, error) {
		return c.one(ctx, id, r, before)
	})
	after, err := c.WeightVersion(ctx)
	for i := range out {
		if errs != nil && errs[i] != nil && !(err == nil && after != before && modelGone(errs[i])) {
			continue
		}
		var e error
		switch {
		case err != nil:
			e = err
		case after != before:
			e = policy.Infra(policy.ReasonVersionMismatch, c.conn.Addr, "weight version changed from %d to %d during the batch: request %s may have run on either", before, after, reqs[i].ID)
		}
		if e != nil {
			if errs == nil {
				errs = make([]error, len(reqs))
			}
			errs[i] = e
		}
	}
	return out, errs
}

// modelGone reports a completion refused for its model: under a server
// that names its models by version, one sent as the version changed.
func modelGone(err error) bool {
	ie, ok := policy.AsInfra(err)
	return ok && ie.Status == http.StatusNotFound && strings.Contains(ie.Detail, completionsPath)
}

// one generates r, by POST /inference/v1/generate until the server answers
// it 404, by POST /v1/completions from then on.
func (c *Client) one(ctx context.Context, id policy.Identity, r model.Request, version int64) (model.Sample, error) {
	if err := r.Settings.Validate(); err != nil {
		return model.Sample{}, fmt.Errorf("vllm: %w", err)
	}
	if err := policy.CheckGrammar(id, r.Settings); err != nil {
		return model.Sample{}, err
	}
	if !c.openAI.Load() {
		s, err := c.generate(ctx, id, r, version)
		if ie, ok := policy.AsInfra(err); !ok || ie.Status != http.StatusNotFound {
			return s, err
		}
		c.openAI.Store(true) // no token-in/token-out endpoint: completions from now on
	}
	return c.complete(ctx, id, r, version)
}

// Endpoints.
const (
	generatePath    = "/inference/v1/generate"
	completionsPath = "/v1/completions"
)

// endpoint is the generation call the client makes now (Identity.Endpoint).
func (c *Client) endpoint() string {
	if c.openAI.Load() {
		return "POST " + completionsPath
	}
	return "POST " + generatePath
}

func (c *Client) generate(ctx context.Context, id policy.Identity, r model.Request, version int64) (model.Sample, error) {
	p := params(r.Settings)
	p.Seed = r.Seed
	var resp generateResp
	if err := c.conn.Call(ctx, "POST", generatePath, generateReq{RequestID: r.ID, TokenIDs: r.Context, SamplingParams: p}, &resp); err != nil {
		return model.Sample{}, err
	}
	if resp.Choices == nil || len(*resp.Choices) != 1 {
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, c.conn.Addr, "POST %s: want one choice", generatePath)
	}
	ch := (*resp.Choices)[0]
	a := answer{
		path: "POST " + generatePath, finish: ch.FinishReason, ids: ch.TokenIDs,
		lpsField: "choices[0].logprobs.content", lpAt: "choices[0].logprobs.content[%d].logprob", tokAt: "choices[0].logprobs.content[%d]",
	}
	if ch.Logprobs != nil && ch.Logprobs.Content != nil {
		a.tokens = make([]string, 0, len(*ch.Logprobs.Content))
		a.lps = make([]policy.Float, 0, len(*ch.Logprobs.Content))
		for _, e := range *ch.Logprobs.Content {
			a.tokens = append(a.tokens, e.Token)
			a.lps = append(a.lps, e.Logprob)
		}
	}
	return a.sample(c.conn.Addr, id, r, version)
}

// WeightVersion reads GET /weight_info.
func (c *Client) WeightVersion(ctx context.Context) (int64, error) {
	var wi struct {
		WeightVersion *string `json:"weight_version"`
	}
	if err := c.conn.Call(ctx, "GET", "/weight_info", nil, &wi); err != nil {
		return 0, err
	}
	if wi.WeightVersion == nil {
		return 0, policy.Infra(policy.ReasonVersionMismatch, c.conn.Addr, "GET /weight_info: no weight version (no release loaded by weight sync)")
	}
	v, err := policy.ParseWeightVersion(*wi.WeightVersion)
	if err != nil {
		return 0, policy.Infra(policy.ReasonVersionMismatch, c.conn.Addr, "GET /weight_info: %v", err)
	}
	return v, nil
}

var modeInConfig = regexp.MustCompile(`logprobs_mode\W+(\w+)`)

// Identity implements policy.Client: GET /version, GET /v1/models, and GET
// /server_info when the server has it (its logprobs_mode, vocabulary,
// tokenizer and template hashes, grammar; or vLLM's vllm_config text,
// searched for logprobs_mode). Its Endpoint is the generation call the
// client makes now: POST /inference/v1/generate until the server answered
// that 404, POST /v1/completions since.
func (c *Client) Identity(ctx context.Context) (policy.Identity, error) {
	id, err := c.id.Get(ctx, c.identity)
	if err != nil {
		return policy.Identity{}, err
	}
	id.Endpoint = c.endpoint()
	return id, nil
}

func (c *Client) identity(ctx context.Context) (policy.Identity, error) {
	var ver struct {
		Version string `json:"version"`
	}
	if err := c.conn.Call(ctx, "GET", "/version", nil, &ver); err != nil {
		return policy.Identity{}, err
	}
	models, err := c.listModels(ctx)
	if err != nil {
		return policy.Identity{}, err
	}
	if ver.Version == "" || len(models) == 0 {
		return policy.Identity{}, policy.Infra(policy.ReasonBadResponse, c.conn.Addr, "GET /version and /v1/models: missing version or model")
	}
	var si struct {
		LogprobsMode     string `json:"logprobs_mode"`
		VLLMConfig       string `json:"vllm_config"`
		VocabSize        int    `json:"vocab_size"`
		TokenizerHash    string `json:"tokenizer_hash"`
		ChatTemplateHash string `json:"chat_template_hash"`
		Grammar          string `json:"grammar"`
	}
	err = c.conn.Call(ctx, "GET", "/server_info", nil, &si)
	if ie, ok := policy.AsInfra(err); ok && ie.Status == 404 {
		err = nil // no /server_info (not in dev mode): nothing more is reported
	}
	if err != nil {
		return policy.Identity{}, err
	}
	mode := si.LogprobsMode
	if m := modeInConfig.FindStringSubmatch(si.VLLMConfig); mode == "" && m != nil {
		mode = m[1]
	}
	logprobs := c.cfg.LogprobsMode + " (the server reports it)"
	switch {
	case mode == "":
		logprobs = c.cfg.LogprobsMode + " (as configured; the server does not report its mode)"
	case mode != c.cfg.LogprobsMode:
		return policy.Identity{}, fmt.Errorf("vllm: %w: the server at %s runs with --logprobs-mode %s, want %s", policy.ErrConfig, c.conn.Addr, mode, c.cfg.LogprobsMode)
	}
	th, err := c.cfg.ResolveTokenizer(si.TokenizerHash)
	if err != nil {
		return policy.Identity{}, err
	}
	m := models[0]
	return policy.Identity{
		Protocol: policy.VLLM, Addr: c.conn.Addr, Server: "vllm " + ver.Version, Model: m.ID + " " + m.Root,
		Vocab: si.VocabSize, TokenizerHash: th, ChatTemplateHash: si.ChatTemplateHash, Grammar: si.Grammar, Logprobs: logprobs,
	}, nil
}

// ApplyTemplate implements rollout.Tokenizer: vLLM's /tokenize renders a
// chat template only into ids, not text, so this is not offered (render
// and tokenize in one call would be needed to stay exact).
func (c *Client) ApplyTemplate(ctx context.Context, msgs []rollout.ChatMessage, addGenerationPrompt bool) (string, error) {
	return "", fmt.Errorf("vllm %s: chat template rendering to text: %w", c.conn.Addr, policy.ErrNotOffered)
}

// Tokenize implements rollout.Tokenizer (POST /tokenize, no special tokens
// added).
func (c *Client) Tokenize(ctx context.Context, text string) ([]int32, error) {
	return c.conn.Tokenize(ctx, text)
}

// Detokenize implements rollout.Tokenizer (POST /detokenize).
func (c *Client) Detokenize(ctx context.Context, ids []int32) (string, error) {
	var resp struct {
		Prompt *string `json:"prompt"`
	}
	if err := c.conn.Call(ctx, "POST", "/detokenize", map[string]any{"tokens": ids}, &resp); err != nil {
		return "", err
	}
	if resp.Prompt == nil {
		return "", policy.Infra(policy.ReasonBadResponse, c.conn.Addr, "POST /detokenize: missing prompt")
	}
	return *resp.Prompt, nil
}

// TokenizerHash implements rollout.Tokenizer (from the identity).
func (c *Client) TokenizerHash() string { return c.id.Cached().TokenizerHash }

// ChatTemplateHash implements rollout.Tokenizer (from the identity).
func (c *Client) ChatTemplateHash() string { return c.id.Cached().ChatTemplateHash }
