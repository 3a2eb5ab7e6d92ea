// Package vllm is the client of vLLM's token-in/token-out API for
// trajflow's rollout (rollout.Policy, rollout.Tokenizer).
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
// entry's "token_id:N" checked against the id) make the sample. The server
// must run with --logprobs-mode processed_logprobs, so that the log-probs
// are of the sampling distribution (after temperature and top-k/top-p),
// not the raw model's; the identity records the mode (verified when the
// server's /server_info reports it). vLLM answers carry no weight version:
// the client reads GET /weight_info before and after each batch, and a
// batch during which it changed fails with version_mismatch (to be
// retried). This is exact under the weight-update protocol of
// connectors/policy/weightsync (pause in wait mode, update, finish with
// the version, resume): a request either finishes before the pause or
// starts after the resume, so it runs on one version, and the version
// label changes only while no request runs.
package vllm

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"

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
// before and after the batch (see the package comment).
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
		if errs != nil && errs[i] != nil {
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

func (c *Client) one(ctx context.Context, id policy.Identity, r model.Request, version int64) (model.Sample, error) {
	if err := r.Settings.Validate(); err != nil {
		return model.Sample{}, fmt.Errorf("vllm: %w", err)
	}
	if err := policy.CheckGrammar(id, r.Settings); err != nil {
		return model.Sample{}, err
	}
	p := params(r.Settings)
	p.Seed = r.Seed
	var resp generateResp
	if err := c.conn.Call(ctx, "POST", "/inference/v1/generate", generateReq{RequestID: r.ID, TokenIDs: r.Context, SamplingParams: p}, &resp); err != nil {
		return model.Sample{}, err
	}
	addr := c.conn.Addr
	if resp.Choices == nil || len(*resp.Choices) != 1 {
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /inference/v1/generate: want one choice")
	}
	ch := (*resp.Choices)[0]
	switch {
	case ch.FinishReason == nil:
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "missing choices[0].finish_reason")
	case *ch.FinishReason == "abort":
		return model.Sample{}, policy.Infra(policy.ReasonServerError, addr, "request %s aborted by the server", r.ID)
	case ch.TokenIDs == nil:
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "missing choices[0].token_ids")
	case ch.Logprobs == nil || ch.Logprobs.Content == nil:
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "missing choices[0].logprobs.content")
	}
	raw := policy.Raw{Tokens: *ch.TokenIDs, Version: version, TokensField: "choices[0].token_ids", LogprobsField: "choices[0].logprobs.content"}
	switch *ch.FinishReason {
	case "stop":
		raw.Finish = policy.FinishStop
	case "length":
		raw.Finish = policy.FinishLength
	case "error":
		return model.Sample{}, policy.Infra(policy.ReasonServerError, addr, "POST /inference/v1/generate: choices[0].finish_reason \"error\" for request %s", r.ID)
	default:
		// vLLM's finish reasons are stop, length, abort and error: another
		// word is a server whose answer this client cannot read.
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /inference/v1/generate: choices[0].finish_reason %q is not stop, length, abort or error", *ch.FinishReason)
	}
	for i, e := range *ch.Logprobs.Content {
		if !e.Logprob.Set {
			return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "choices[0].logprobs.content[%d].logprob missing", i)
		}
		// vLLM clamps log-probs at -9999 and writes -9999 when it has none.
		if e.Logprob.V <= -9999 {
			return model.Sample{}, policy.Infra(policy.ReasonNaNLogprob, addr, "choices[0].logprobs.content[%d].logprob = %v (vLLM's clamp: no log-prob)", i, e.Logprob.V)
		}
		if i < len(raw.Tokens) {
			if n, err := strconv.ParseInt(strings.TrimPrefix(e.Token, "token_id:"), 10, 64); err == nil && n != raw.Tokens[i] {
				return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "choices[0].logprobs.content[%d] is of %s, token_ids[%d] = %d", i, e.Token, i, raw.Tokens[i])
			}
		}
		raw.Logprobs = append(raw.Logprobs, e.Logprob.V)
	}
	return policy.Check(addr, r, id.Vocab, policy.Want{}, raw)
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
// searched for logprobs_mode).
func (c *Client) Identity(ctx context.Context) (policy.Identity, error) {
	return c.id.Get(ctx, func(ctx context.Context) (policy.Identity, error) {
		var ver struct {
			Version string `json:"version"`
		}
		if err := c.conn.Call(ctx, "GET", "/version", nil, &ver); err != nil {
			return policy.Identity{}, err
		}
		var models struct {
			Data []struct {
				ID   string `json:"id"`
				Root string `json:"root"`
			} `json:"data"`
		}
		if err := c.conn.Call(ctx, "GET", "/v1/models", nil, &models); err != nil {
			return policy.Identity{}, err
		}
		if ver.Version == "" || len(models.Data) == 0 {
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
		err := c.conn.Call(ctx, "GET", "/server_info", nil, &si)
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
		m := models.Data[0]
		return policy.Identity{
			Protocol: policy.VLLM, Addr: c.conn.Addr, Server: "vllm " + ver.Version, Model: m.ID + " " + m.Root,
			Vocab: si.VocabSize, TokenizerHash: th, ChatTemplateHash: si.ChatTemplateHash, Grammar: si.Grammar, Logprobs: logprobs,
		}, nil
	})
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
