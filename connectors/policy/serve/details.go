package serve

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
)

// tokenProb is one entry of a top list.
type tokenProb struct {
	id int32
	p  float64 // probability (post-sampling lists) or log-probability (raw lists)
}

// details recomputes, for each sampled id of s, the raw log-prob (the
// model's own distribution at temperature 1, no grammar or truncation:
// llama.cpp's `logprob` without post_sampling_probs) and the top-n lists of
// the raw and of the behavior distribution. The logits of each generated
// position are computed by model.NextLogits, the sampler's own routine, so
// they are the sampler's bit for bit; memory is one row, whatever the
// prompt's length. It stops with ctx's error between two positions.
func (c *core) details(ctx context.Context, l *loaded, prompt []int32, st model.Settings, s model.Sample, n int) (rawLP []float32, rawTop, postTop [][]tokenProb, err error) {
	st.Grammar = c.cfg.Grammar
	V := l.m.Config.Vocab
	seq := append(append(make([]int32, 0, len(prompt)+len(s.Tokens)), prompt...), s.Tokens...)
	raw := make([]float32, V)
	beh := make([]float32, V)
	rawLP = make([]float32, len(s.Tokens))
	for k, tok := range s.Tokens {
		if err := ctx.Err(); err != nil {
			return nil, nil, nil, err
		}
		// The distribution tok was drawn from: after the prompt and the
		// k ids sampled before it.
		if err := l.m.NextLogits(st.Behavior, seq[:len(prompt)+k], raw, beh); err != nil {
			return nil, nil, nil, fmt.Errorf("serve: recompute logits: %w", err)
		}
		if err := objective.LogSoftmaxGather(raw, 1, V, []int32{tok}, rawLP[k:k+1]); err != nil {
			return nil, nil, nil, fmt.Errorf("serve: %w", err)
		}
		if n > 0 {
			rawTop = append(rawTop, top(raw, n, true))
			postTop = append(postTop, top(beh, n, false))
		}
	}
	return rawLP, rawTop, postTop, nil
}

// top returns the n most likely ids of a logit row (probabilities, or
// log-probabilities when logs), most likely first, ties by id; ids of
// probability 0 are left out.
func top(row []float32, n int, logs bool) []tokenProb {
	m := math.Inf(-1)
	for _, z := range row {
		m = math.Max(m, float64(z))
	}
	var sum float64
	for _, z := range row {
		sum += math.Exp(float64(z) - m)
	}
	var all []tokenProb
	for v, z := range row {
		if math.IsInf(float64(z), -1) {
			continue
		}
		p := math.Exp(float64(z)-m) / sum
		if logs {
			p = float64(z) - m - math.Log(sum)
		}
		all = append(all, tokenProb{id: int32(v), p: p})
	}
	slices.SortStableFunc(all, func(a, b tokenProb) int {
		switch {
		case a.p > b.p:
			return -1
		case a.p < b.p:
			return 1
		}
		return int(a.id - b.id)
	})
	if len(all) > n {
		all = all[:n]
	}
	return all
}
