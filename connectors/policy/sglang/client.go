// Package sglang is the client of SGLang's native API for trajflow's
// rollout (rollout.Policy, rollout.Tokenizer): token-id prompts in, exact
// ids and sampling-distribution log-probs out, the served weight version
// per request.
//
// One request per model.Request:
//
//	POST /generate {"input_ids": [...], "rid": Request.ID, "stream": false,
//	  "return_logprob": true, "logprob_start_len": -1, "top_logprobs_num": 0,
//	  "sampling_params": {"max_new_tokens": MaxTokens, "stop_token_ids": Stop,
//	    "temperature": T, "top_p": P (1 = off), "top_k": K (-1 = off), "min_p": 0,
//	    "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1,
//	    "min_new_tokens": 0, "n": 1, "ignore_eos": true, "skip_special_tokens": false,
//	    "no_stop_trim": true, "sampling_seed": Request.Seed}}
//
// ignore_eos is set so that generation ends exactly at Settings.Stop (the
// EOS id ends it only when listed there); SGLang's ignore_eos does not mask
// EOS. The answer's output_ids, meta_info.output_token_logprobs ([logprob,
// id, text] per id, the ids checked against output_ids), finish_reason and
// weight_version (the served policy version, a decimal string) make the
// Sample. SGLang computes the returned log-probs after temperature and
// top-k/top-p scaling in the versions that have weight_version; the server
// version is recorded in the identity because this changed across
// versions.
package sglang

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// Config configures a Client.
type Config struct {
	policy.ClientConfig
}

// Client is an SGLang client. It is safe for concurrent use.
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
	conn, err := cfg.Resolve()
	if err != nil {
		return nil, fmt.Errorf("sglang: %w", err)
	}
	return &Client{cfg: cfg, conn: conn}, nil
}

// Close drops idle connections.
func (c *Client) Close() { c.conn.Close() }

// Protocol implements policy.Client.
func (c *Client) Protocol() string { return policy.SGLang }

// Addr implements policy.Client.
func (c *Client) Addr() string { return c.conn.Addr }

// Health implements policy.Client.
func (c *Client) Health(ctx context.Context) error {
	return c.conn.Call(ctx, "GET", "/health", nil, nil)
}

type samplingParams struct {
	MaxNewTokens      int     `json:"max_new_tokens"`
	StopTokenIDs      []int32 `json:"stop_token_ids"`
	Temperature       float64 `json:"temperature"`
	TopP              float64 `json:"top_p"`
	TopK              int     `json:"top_k"`
	MinP              float64 `json:"min_p"`
	FrequencyPenalty  float64 `json:"frequency_penalty"`
	PresencePenalty   float64 `json:"presence_penalty"`
	RepetitionPenalty float64 `json:"repetition_penalty"`
	MinNewTokens      int     `json:"min_new_tokens"`
	N                 int     `json:"n"`
	IgnoreEOS         bool    `json:"ignore_eos"`
	SkipSpecialTokens bool    `json:"skip_special_tokens"`
	NoStopTrim        bool    `json:"no_stop_trim"`
	SamplingSeed      uint64  `json:"sampling_seed"`
}

type generateReq struct {
	InputIDs             []int32        `json:"input_ids"`
	SamplingParams       samplingParams `json:"sampling_params"`
	ReturnLogprob        bool           `json:"return_logprob"`
	LogprobStartLen      int            `json:"logprob_start_len"`
	TopLogprobsNum       int            `json:"top_logprobs_num"`
	ReturnTextInLogprobs bool           `json:"return_text_in_logprobs"`
	Rid                  string         `json:"rid,omitempty"`
	Stream               bool           `json:"stream"`
}

// params are the sampling params sent for s (seed 0; the request's seed
// is set per request).
func params(s model.Settings) samplingParams {
	topP, topK := s.TopP, s.TopK
	if topP == 0 {
		topP = 1
	}
	if topK == 0 {
		topK = -1
	}
	stop := append([]int32{}, s.Stop...)
	return samplingParams{
		MaxNewTokens: s.MaxTokens, StopTokenIDs: stop, Temperature: s.Temperature, TopP: topP, TopK: topK,
		RepetitionPenalty: 1, N: 1, IgnoreEOS: true, NoStopTrim: true,
	}
}

// SamplerID implements policy.Client.
func (c *Client) SamplerID(s model.Settings) string {
	b, _ := json.Marshal(params(s)) // plain struct: cannot fail
	return policy.SamplerID(c.id.Cached(), s, string(b))
}

type generateResp struct {
	OutputIDs *[]int64 `json:"output_ids"`
	MetaInfo  *struct {
		ID           string `json:"id"`
		FinishReason *struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"finish_reason"`
		WeightVersion       *string              `json:"weight_version"`
		OutputTokenLogprobs *[][]json.RawMessage `json:"output_token_logprobs"`
	} `json:"meta_info"`
}

// Generate implements rollout.Policy with the client's Want.
func (c *Client) Generate(ctx context.Context, reqs []model.Request) ([]model.Sample, error) {
	return policy.Generate(ctx, reqs, c.cfg.Concurrency, c.cfg.Want, c.one)
}

// GenerateEach implements policy.Client.
func (c *Client) GenerateEach(ctx context.Context, reqs []model.Request, want policy.Want) ([]model.Sample, []error) {
	return policy.GenerateEach(ctx, reqs, c.cfg.Concurrency, want, c.one)
}

func (c *Client) one(ctx context.Context, r model.Request, want policy.Want) (model.Sample, error) {
	if err := r.Settings.Validate(); err != nil {
		return model.Sample{}, fmt.Errorf("sglang: %w", err)
	}
	id, err := c.Identity(ctx)
	if err != nil {
		return model.Sample{}, err
	}
	if err := policy.CheckGrammar(id, r.Settings); err != nil {
		return model.Sample{}, err
	}
	p := params(r.Settings)
	p.SamplingSeed = r.Seed
	q := generateReq{InputIDs: r.Context, SamplingParams: p, ReturnLogprob: true, LogprobStartLen: -1, Rid: r.ID}
	var resp generateResp
	if err := c.conn.Call(ctx, "POST", "/generate", q, &resp); err != nil {
		return model.Sample{}, err
	}
	addr := c.conn.Addr
	switch {
	case resp.OutputIDs == nil:
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /generate: missing output_ids")
	case resp.MetaInfo == nil:
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /generate: missing meta_info")
	case resp.MetaInfo.FinishReason == nil:
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /generate: missing meta_info.finish_reason")
	case resp.MetaInfo.WeightVersion == nil:
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /generate: missing meta_info.weight_version")
	case resp.MetaInfo.OutputTokenLogprobs == nil && resp.MetaInfo.FinishReason.Type != "abort":
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /generate: missing meta_info.output_token_logprobs")
	case r.ID != "" && resp.MetaInfo.ID != "" && resp.MetaInfo.ID != r.ID:
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /generate: meta_info.id %q answers request %q", resp.MetaInfo.ID, r.ID)
	}
	m := resp.MetaInfo
	raw := policy.Raw{Tokens: *resp.OutputIDs, TokensField: "output_ids", LogprobsField: "meta_info.output_token_logprobs"}
	switch m.FinishReason.Type {
	case "stop":
		raw.Finish = policy.FinishStop
	case "length":
		raw.Finish = policy.FinishLength
	case "abort":
		return model.Sample{}, policy.Infra(policy.ReasonServerError, addr, "POST /generate: request %s aborted: %s", r.ID, m.FinishReason.Message)
	default:
		// SGLang's finish types are stop, length and abort: another word
		// is a server whose answer this client cannot read.
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "POST /generate: meta_info.finish_reason.type %q is not stop, length or abort", m.FinishReason.Type)
	}
	v, err := policy.ParseWeightVersion(*m.WeightVersion)
	if err != nil {
		return model.Sample{}, policy.Infra(policy.ReasonVersionMismatch, addr, "POST /generate: meta_info.%v", err)
	}
	raw.Version = v
	for i, e := range *m.OutputTokenLogprobs {
		if len(e) < 2 {
			return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "meta_info.output_token_logprobs[%d] has %d fields, want [logprob, id, text]", i, len(e))
		}
		var lp policy.Float
		var tid int64
		if err := json.Unmarshal(e[0], &lp); err != nil || !lp.Set {
			return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "meta_info.output_token_logprobs[%d][0] = %s is not a log-prob", i, e[0])
		}
		if err := json.Unmarshal(e[1], &tid); err != nil {
			return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "meta_info.output_token_logprobs[%d][1] = %s is not a token id", i, e[1])
		}
		if i < len(raw.Tokens) && tid != raw.Tokens[i] {
			return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "meta_info.output_token_logprobs[%d] is of id %d, output_ids[%d] = %d", i, tid, i, raw.Tokens[i])
		}
		raw.Logprobs = append(raw.Logprobs, lp.V)
	}
	return policy.Check(addr, r, id.Vocab, want, raw)
}

// Identity implements policy.Client: GET /get_server_info (version, vocab
// size, tokenizer and template hashes, grammar, when reported) and GET
// /get_model_info (model path).
func (c *Client) Identity(ctx context.Context) (policy.Identity, error) {
	return c.id.Get(ctx, func(ctx context.Context) (policy.Identity, error) {
		var si struct {
			Version          string `json:"version"`
			ModelPath        string `json:"model_path"`
			VocabSize        int    `json:"vocab_size"`
			TokenizerHash    string `json:"tokenizer_hash"`
			ChatTemplateHash string `json:"chat_template_hash"`
			Grammar          string `json:"grammar"`
			CheckpointHash   string `json:"checkpoint_hash"`
		}
		if err := c.conn.Call(ctx, "GET", "/get_server_info", nil, &si); err != nil {
			return policy.Identity{}, err
		}
		var mi struct {
			ModelPath string `json:"model_path"`
		}
		if err := c.conn.Call(ctx, "GET", "/get_model_info", nil, &mi); err != nil {
			return policy.Identity{}, err
		}
		if si.Version == "" {
			return policy.Identity{}, policy.Infra(policy.ReasonBadResponse, c.conn.Addr, "GET /get_server_info: missing version")
		}
		th, err := c.cfg.ResolveTokenizer(si.TokenizerHash)
		if err != nil {
			return policy.Identity{}, err
		}
		return policy.Identity{
			Protocol: policy.SGLang, Addr: c.conn.Addr, Server: "sglang " + si.Version, Model: mi.ModelPath,
			ModelHash: si.CheckpointHash, Vocab: si.VocabSize, TokenizerHash: th, ChatTemplateHash: si.ChatTemplateHash,
			Grammar: si.Grammar, Logprobs: "meta_info.output_token_logprobs of sglang " + si.Version + " (after temperature and top-k/top-p)",
		}, nil
	})
}

// ApplyTemplate implements rollout.Tokenizer: SGLang's native API renders
// chat templates only inside generation, so this is not offered.
func (c *Client) ApplyTemplate(ctx context.Context, msgs []rollout.ChatMessage, addGenerationPrompt bool) (string, error) {
	return "", fmt.Errorf("sglang %s: chat template rendering: %w", c.conn.Addr, policy.ErrNotOffered)
}

// Tokenize implements rollout.Tokenizer (POST /tokenize, no special tokens
// added).
func (c *Client) Tokenize(ctx context.Context, text string) ([]int32, error) {
	return c.conn.Tokenize(ctx, text)
}

// Detokenize implements rollout.Tokenizer (POST /detokenize).
func (c *Client) Detokenize(ctx context.Context, ids []int32) (string, error) {
	var resp struct {
		Text *string `json:"text"`
	}
	if err := c.conn.Call(ctx, "POST", "/detokenize", map[string]any{"tokens": ids, "skip_special_tokens": false}, &resp); err != nil {
		return "", err
	}
	if resp.Text == nil {
		return "", policy.Infra(policy.ReasonBadResponse, c.conn.Addr, "POST /detokenize: missing text")
	}
	return *resp.Text, nil
}

// TokenizerHash implements rollout.Tokenizer (from the identity; "" until
// Identity or a generation has fetched it).
func (c *Client) TokenizerHash() string { return c.id.Cached().TokenizerHash }

// ChatTemplateHash implements rollout.Tokenizer (from the identity).
func (c *Client) ChatTemplateHash() string { return c.id.Cached().ChatTemplateHash }
