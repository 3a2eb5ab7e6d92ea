package vllm

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
)

// completionsReq is the body of POST /v1/completions: the sampling fields
// of the generate call, at the top level where the completions API takes
// them, so that both calls hand vLLM the same sampling parameters.
type completionsReq struct {
	Model  string  `json:"model"`
	Prompt []int32 `json:"prompt"`
	samplingParams
	// Seed shadows the sampling field: the completions API bounds the seed
	// to signed 64 bits.
	Seed int64 `json:"seed"`
	// Detokenize shadows the sampling field, so that it is never sent: it
	// is not a completions field (the text is always made).
	Detokenize *bool `json:"detokenize,omitempty"`

	ReturnTokensAsTokenIDs bool `json:"return_tokens_as_token_ids"`
	ReturnTokenIDs         bool `json:"return_token_ids"`
	Stream                 bool `json:"stream"`
	Echo                   bool `json:"echo"`
}

type completionsResp struct {
	Choices *[]struct {
		TokenIDs *[]int64 `json:"token_ids"`
		Logprobs *struct {
			Tokens        *[]string       `json:"tokens"`
			TokenLogprobs *[]policy.Float `json:"token_logprobs"`
		} `json:"logprobs"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
}

// complete generates r by POST /v1/completions.
func (c *Client) complete(ctx context.Context, id policy.Identity, r model.Request, version int64) (model.Sample, error) {
	name, err := c.models.get(ctx, c, version)
	if err != nil {
		return model.Sample{}, err
	}
	body := completionsReq{
		Model: name, Prompt: append([]int32{}, r.Context...), samplingParams: params(r.Settings),
		Seed: int64(r.Seed), ReturnTokensAsTokenIDs: true, ReturnTokenIDs: true,
	}
	var resp completionsResp
	if err := c.conn.Call(ctx, "POST", completionsPath, body, &resp); err != nil {
		return model.Sample{}, err
	}
	if resp.Choices == nil || len(*resp.Choices) != 1 {
		n := 0
		if resp.Choices != nil {
			n = len(*resp.Choices)
		}
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, c.conn.Addr, "POST %s: %d entries in choices, want one", completionsPath, n)
	}
	ch := (*resp.Choices)[0]
	a := answer{
		path: "POST " + completionsPath, finish: ch.FinishReason, ids: ch.TokenIDs, derive: true,
		lpsField: "choices[0].logprobs.token_logprobs", lpAt: "choices[0].logprobs.token_logprobs[%d]", tokAt: "choices[0].logprobs.tokens[%d]",
	}
	if lp := ch.Logprobs; lp != nil {
		if lp.Tokens != nil {
			a.tokens = *lp.Tokens
		}
		if lp.TokenLogprobs != nil {
			a.lps = *lp.TokenLogprobs
		}
	}
	return a.sample(c.conn.Addr, id, r, version)
}

// modelCache holds the model id completions requests name, and the weight
// version at which it was read.
type modelCache struct {
	mu   sync.Mutex
	name string
	at   int64
	set  bool
}

// get returns the model id to name at weight version v: the one read at v,
// else the first GET /v1/models lists now. The lock is held while it is
// read, so that the requests of a batch ask once.
func (m *modelCache) get(ctx context.Context, c *Client, v int64) (string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.set && m.at == v {
		return m.name, nil
	}
	models, err := c.listModels(ctx)
	if err != nil {
		return "", err
	}
	if len(models) == 0 || models[0].ID == "" {
		return "", policy.Infra(policy.ReasonBadResponse, c.conn.Addr, "GET /v1/models: no model id (data[0].id)")
	}
	m.name, m.at, m.set = models[0].ID, v, true
	return m.name, nil
}

type modelCard struct {
	ID   string `json:"id"`
	Root string `json:"root"`
}

// listModels reads GET /v1/models.
func (c *Client) listModels(ctx context.Context) ([]modelCard, error) {
	var list struct {
		Data []modelCard `json:"data"`
	}
	if err := c.conn.Call(ctx, "GET", "/v1/models", nil, &list); err != nil {
		return nil, err
	}
	return list.Data, nil
}

// answer is choices[0] of either endpoint's answer, before validation, and
// the names of its fields for errors.
type answer struct {
	path   string   // the call, "POST /..."
	finish *string  // finish_reason (nil: absent)
	ids    *[]int64 // token_ids (nil: absent)
	// tokens are the log-prob entries' tokens ("token_id:N", or text when
	// the server did not write ids; nil: absent), lps their log-probs (nil:
	// absent).
	tokens []string
	lps    []policy.Float
	// derive: without ids, read them from tokens (completions).
	derive bool
	// lpsField names the log-prob list; lpAt and tokAt format the fields of
	// its i-th log-prob and token.
	lpsField, lpAt, tokAt string
}

// sample validates a and returns the sample: one finish reason of vLLM's
// (abort and error are server errors), ids present (or read from
// "token_id:N" tokens) and agreeing with every "token_id:N" token,
// log-probs present, none at vLLM's -9999 clamp, as many tokens as
// log-probs; then policy.Check.
func (a answer) sample(addr string, id policy.Identity, r model.Request, version int64) (model.Sample, error) {
	bad := func(format string, args ...any) (model.Sample, error) {
		return model.Sample{}, policy.Infra(policy.ReasonBadResponse, addr, "%s: %s", a.path, fmt.Sprintf(format, args...))
	}
	switch {
	case a.finish == nil:
		return bad("missing choices[0].finish_reason")
	case *a.finish == "abort":
		return model.Sample{}, policy.Infra(policy.ReasonServerError, addr, "%s: request %s aborted by the server", a.path, r.ID)
	}
	ids, idsField := []int64(nil), "choices[0].token_ids"
	switch {
	case a.ids != nil:
		ids = *a.ids
	case !a.derive:
		return bad("missing choices[0].token_ids")
	case a.tokens == nil:
		return bad("missing choices[0].token_ids and choices[0].logprobs.tokens")
	default:
		idsField = "choices[0].logprobs.tokens"
		ids = make([]int64, len(a.tokens))
		for i, t := range a.tokens {
			n, isID, err := tokenID(t)
			if !isID || err != nil {
				return bad("no choices[0].token_ids, and %s = %q is not \"token_id:N\"", fmt.Sprintf(a.tokAt, i), t)
			}
			ids[i] = n
		}
	}
	if a.lps == nil {
		return bad("missing %s", a.lpsField)
	}
	raw := policy.Raw{Tokens: ids, Version: version, TokensField: idsField, LogprobsField: a.lpsField}
	switch *a.finish {
	case "stop":
		raw.Finish = policy.FinishStop
	case "length":
		raw.Finish = policy.FinishLength
	case "error":
		return model.Sample{}, policy.Infra(policy.ReasonServerError, addr, "%s: choices[0].finish_reason \"error\" for request %s", a.path, r.ID)
	default:
		// vLLM's finish reasons are stop, length, abort and error: another
		// word is a server whose answer this client cannot read.
		return bad("choices[0].finish_reason %q is not stop, length, abort or error", *a.finish)
	}
	if a.tokens != nil && len(a.tokens) != len(a.lps) {
		return model.Sample{}, policy.Infra(policy.ReasonLengthMismatch, addr, "%s: %d entries in choices[0].logprobs.tokens, %d in %s", a.path, len(a.tokens), len(a.lps), a.lpsField)
	}
	for i, lp := range a.lps {
		if !lp.Set {
			return bad("%s missing", fmt.Sprintf(a.lpAt, i))
		}
		// vLLM clamps log-probs at -9999 and writes -9999 when it has none.
		if lp.V <= -9999 {
			return model.Sample{}, policy.Infra(policy.ReasonNaNLogprob, addr, "%s: %s = %v (vLLM's clamp: no log-prob)", a.path, fmt.Sprintf(a.lpAt, i), lp.V)
		}
		if i < len(a.tokens) && i < len(ids) {
			if n, isID, err := tokenID(a.tokens[i]); isID && (err != nil || n != ids[i]) {
				return bad("%s is of %q, %s[%d] = %d", fmt.Sprintf(a.tokAt, i), a.tokens[i], idsField, i, ids[i])
			}
		}
		raw.Logprobs = append(raw.Logprobs, lp.V)
	}
	return policy.Check(addr, r, id.Vocab, policy.Want{}, raw)
}

// tokenID reads a "token_id:N" token: isID reports the prefix, err a
// malformed number after it.
func tokenID(s string) (n int64, isID bool, err error) {
	rest, ok := strings.CutPrefix(s, "token_id:")
	if !ok {
		return 0, false, nil
	}
	n, err = strconv.ParseInt(rest, 10, 64)
	return n, true, err
}
