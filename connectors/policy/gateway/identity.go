package gateway

import (
	"context"
	"errors"
	"fmt"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

var _ rollout.Tokenizer = (*Gateway)(nil)

// Identity asks every replica for its identity (policy.Client.Identity)
// and returns the first replica's that answered. The replicas must agree
// on what a sample's meaning depends on — protocol, server software,
// vocabulary, tokenizer and template hashes, grammar, log-prob semantics —
// or the call fails with ErrConfig: a gateway over different models would
// record one sampler id for samples of several. Replicas that do not
// answer are skipped (their health checks keep them out); it fails when
// none answers.
func (g *Gateway) Identity(ctx context.Context) (policy.Identity, error) {
	var first *policy.Identity
	var firstName string
	var errs []error
	for _, r := range g.reps {
		id, err := r.c.Identity(ctx)
		if err != nil {
			errs = append(errs, fmt.Errorf("replica %s: %w", r.name, err))
			continue
		}
		if first == nil {
			first, firstName = &id, r.name
			continue
		}
		if a, b := comparable(*first), comparable(id); a != b {
			return policy.Identity{}, fmt.Errorf("gateway: %w: replicas %s and %s serve different policies: %+v and %+v", policy.ErrConfig, firstName, r.name, a, b)
		}
	}
	if first == nil {
		return policy.Identity{}, fmt.Errorf("gateway: no replica answered its identity: %w", errors.Join(errs...))
	}
	g.mu.Lock()
	g.idRep = g.byName[firstName]
	g.mu.Unlock()
	return *first, nil
}

// comparable is the part of an identity every replica must share.
func comparable(id policy.Identity) policy.Identity {
	return policy.Identity{Protocol: id.Protocol, Server: id.Server, Vocab: id.Vocab, TokenizerHash: id.TokenizerHash,
		ChatTemplateHash: id.ChatTemplateHash, Grammar: id.Grammar, Logprobs: id.Logprobs, Seed64: id.Seed64}
}

// SamplerID is the sampler id of settings s (policy.Client.SamplerID) of
// the replica whose identity Identity returned (call Identity first; the
// first replica's before).
func (g *Gateway) SamplerID(s model.Settings) string {
	g.mu.Lock()
	r := g.idRep
	g.mu.Unlock()
	if r == nil {
		r = g.reps[0]
	}
	return r.c.SamplerID(s)
}

// tokenizers are the replicas whose clients are tokenizers, healthy ones
// with a closed breaker first, in configuration order.
func (g *Gateway) tokenizers() []rollout.Tokenizer {
	g.mu.Lock()
	defer g.mu.Unlock()
	var good, rest []rollout.Tokenizer
	for _, r := range g.reps {
		tk, ok := r.c.(rollout.Tokenizer)
		if !ok {
			continue
		}
		if r.healthy && r.state == BreakerClosed {
			good = append(good, tk)
		} else {
			rest = append(rest, tk)
		}
	}
	return append(good, rest...)
}

// tokenizerCall runs f on one replica's tokenizer, trying the next one
// after an infrastructure failure (every replica serves the same
// tokenizer: Identity checks it).
func tokenizerCall[T any](ctx context.Context, g *Gateway, f func(rollout.Tokenizer) (T, error)) (T, error) {
	var zero T
	tks := g.tokenizers()
	if len(tks) == 0 {
		return zero, fmt.Errorf("gateway: %w: no replica's client is a tokenizer", policy.ErrNotOffered)
	}
	var last error
	for _, tk := range tks {
		v, err := f(tk)
		if err == nil || !policy.IsInfra(err) || ctx.Err() != nil {
			return v, err
		}
		last = err
	}
	return zero, last
}

// ApplyTemplate implements rollout.Tokenizer on a replica (see tokenizerCall).
func (g *Gateway) ApplyTemplate(ctx context.Context, msgs []rollout.ChatMessage, add bool) (string, error) {
	return tokenizerCall(ctx, g, func(tk rollout.Tokenizer) (string, error) { return tk.ApplyTemplate(ctx, msgs, add) })
}

// Tokenize implements rollout.Tokenizer on a replica.
func (g *Gateway) Tokenize(ctx context.Context, text string) ([]int32, error) {
	return tokenizerCall(ctx, g, func(tk rollout.Tokenizer) ([]int32, error) { return tk.Tokenize(ctx, text) })
}

// Detokenize implements rollout.Tokenizer on a replica.
func (g *Gateway) Detokenize(ctx context.Context, ids []int32) (string, error) {
	return tokenizerCall(ctx, g, func(tk rollout.Tokenizer) (string, error) { return tk.Detokenize(ctx, ids) })
}

// TokenizerHash implements rollout.Tokenizer: the replicas' tokenizer hash
// (known once Identity succeeded).
func (g *Gateway) TokenizerHash() string {
	for _, tk := range g.tokenizers() {
		if h := tk.TokenizerHash(); h != "" {
			return h
		}
	}
	return ""
}

// ChatTemplateHash implements rollout.Tokenizer: the replicas' template
// hash (known once Identity succeeded).
func (g *Gateway) ChatTemplateHash() string {
	for _, tk := range g.tokenizers() {
		if h := tk.ChatTemplateHash(); h != "" {
			return h
		}
	}
	return ""
}
