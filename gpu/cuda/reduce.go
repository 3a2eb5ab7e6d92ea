package cuda

import (
	"fmt"
	"math"

	"github.com/trajflow/trajflow/gpu/objective"
)

// Flag bits of TokenOut.Flags, written by the token_loss kernel.
const (
	FlagClipped    = 1 // the clipped branch of the surrogate is strictly smaller
	FlagLRClamped  = 2 // MaxLogRatio clamped the log ratio
	FlagNonFinite  = 4 // cur, old, ref or advantage not finite at a masked position
	FlagNoLogprob  = 8 // the target's current log-prob is -Inf (never for the built-in policy)
	flagErrorsMask = FlagNonFinite | FlagNoLogprob
)

// TokenOut are the per-position outputs of the device loss kernel, copied
// back to the host ([T] each; entries at unmasked positions are 0 except
// Logprob, which is set wherever a target exists).
type TokenOut struct {
	Logprob   []float32 // current log-prob of the target (float32, as objective.Result.CurLogprobs)
	Ratio     []float64 // r = exp(clamped cur - old)
	Surrogate []float64 // min(r A, clip(r) A)
	KL        []float64 // KL estimator value (0 without reference)
	Entropy   []float64 // H of the position's current distribution
	Flags     []int32   // Flag* bits
}

// Resize makes every slice of o hold T entries, reusing capacity.
func (o *TokenOut) Resize(T int) {
	if cap(o.Logprob) < T {
		o.Logprob = make([]float32, T)
	}
	o.Logprob = o.Logprob[:T]
	for _, p := range []*[]float64{&o.Ratio, &o.Surrogate, &o.KL, &o.Entropy} {
		if cap(*p) < T {
			*p = make([]float64, T)
		}
		*p = (*p)[:T]
	}
	if cap(o.Flags) < T {
		o.Flags = make([]int32, T)
	}
	o.Flags = o.Flags[:T]
}

// ReduceStats combines the per-token device outputs of a staged batch into
// the objective.Stats of the whole batch, exactly as objective.Compute
// defines them (float64 accumulation in position order): PolicyLoss = -Σ
// c_t s_t, KL = Σ c_t k_t, Entropy = Σ c_t H_t with the staged weights c_t,
// Loss, ratio statistics, approximate KL to the behavior policy (unclamped
// log ratio), clip fractions by advantage sign. buf is the staging buffer
// the batch was written to (host copy). A masked position flagged
// non-finite is an error wrapping ErrBatch (the CPU reference rejects such
// a batch with objective.ErrInput); a non-finite ratio, surrogate, KL or
// entropy term or loss from finite inputs wraps ErrBatch and
// objective.ErrNonFinite, as objective.Compute refuses it.
func ReduceStats(out *TokenOut, st *Staged, buf []byte, opts objective.Options) (objective.Stats, error) {
	l := st.Layout
	T := l.T
	if len(out.Logprob) != T || len(out.Flags) != T {
		return objective.Stats{}, fmt.Errorf("%w: %d outputs for %d positions", ErrBatch, len(out.Logprob), T)
	}
	w, old, adv := l.Float32s(buf, ColWeights), l.Float32s(buf, ColOld), l.Float32s(buf, ColAdv)
	mask := l.ColumnBytes(buf, ColMask)
	klOn := st.HasRef && opts.KLEstimator != ""
	klCoef := 0.0
	if opts.KLPlacement == objective.KLLoss {
		klCoef = opts.KLCoef
	}
	s := objective.Stats{Tokens: st.Den.Tokens, Sequences: st.Den.Sequences, RatioMin: math.Inf(1), RatioMax: math.Inf(-1)}
	var pol, kl, ent, akl, rsum float64
	var n int64
	for i := 0; i < T; i++ {
		if mask[i] != 1 {
			continue
		}
		f := out.Flags[i]
		if f&flagErrorsMask != 0 {
			return objective.Stats{}, fmt.Errorf("%w: masked position %d: non-finite log-prob, old log-prob, reference or advantage (flags %#x)", ErrBatch, i, f)
		}
		if !finite(out.Surrogate[i]) || !finite(out.KL[i]) || !finite(out.Ratio[i]) || !finite(out.Entropy[i]) {
			return objective.Stats{}, fmt.Errorf("%w: masked position %d: ratio %v, surrogate %v, kl %v, entropy %v (max_log_ratio %v): %w",
				ErrBatch, i, out.Ratio[i], out.Surrogate[i], out.KL[i], out.Entropy[i], opts.MaxLogRatio, objective.ErrNonFinite)
		}
		n++
		c := float64(w[i])
		pol += c * out.Surrogate[i]
		if klOn {
			kl += c * out.KL[i]
		}
		ent += c * out.Entropy[i]
		lr := float64(out.Logprob[i]) - float64(old[i])
		akl += 0.5 * lr * lr
		r := out.Ratio[i]
		rsum += r
		s.RatioMin = math.Min(s.RatioMin, r)
		s.RatioMax = math.Max(s.RatioMax, r)
		if f&FlagLRClamped != 0 {
			s.LogRatioClamped++
		}
		switch a := adv[i]; {
		case a > 0:
			s.PosTokens++
			if f&FlagClipped != 0 {
				s.ClippedPos++
			}
		case a < 0:
			s.NegTokens++
			if f&FlagClipped != 0 {
				s.ClippedNeg++
			}
		}
	}
	if n != st.Den.Tokens {
		return objective.Stats{}, fmt.Errorf("%w: %d masked positions, denominators count %d", ErrBatch, n, st.Den.Tokens)
	}
	s.PolicyLoss = -pol
	s.KL = kl
	s.Entropy = ent
	s.Loss = s.PolicyLoss + klCoef*s.KL - opts.EntropyCoef*s.Entropy
	if !finite(s.Loss) {
		return objective.Stats{}, fmt.Errorf("%w: loss %v (max_log_ratio %v): %w", ErrBatch, s.Loss, opts.MaxLogRatio, objective.ErrNonFinite)
	}
	s.ApproxKLOld = akl / float64(n)
	s.RatioMean = rsum / float64(n)
	if s.PosTokens > 0 {
		s.ClipFracPos = float64(s.ClippedPos) / float64(s.PosTokens)
	}
	if s.NegTokens > 0 {
		s.ClipFracNeg = float64(s.ClippedNeg) / float64(s.NegTokens)
	}
	return s, nil
}

// LSE is the running state of the online log-sum-exp over a stream of
// logits x (the rule the lse_chunk kernel applies to each vocabulary chunk
// and when merging the partial states of its threads):
//
//	M = max x,  S = Σ exp(x - M),  A = Σ exp(x - M)·(x - M)
//
// so that log Σ exp x = M + log S and the entropy of softmax(x) is
// H = log S - A/S. The zero value is the state of the empty stream.
type LSE struct{ M, S, A float64 }

// Add folds one logit into the state.
func (x LSE) Add(v float64) LSE { return x.Merge(LSE{M: v, S: 1, A: 0}) }

// Merge returns the state of the concatenation of the two streams:
// rescaling to the larger maximum M, S = S1 e^(M1-M) + S2 e^(M2-M) and
// A = e^(M1-M) (A1 + S1 (M1-M)) + e^(M2-M) (A2 + S2 (M2-M)). Empty states
// (S == 0) contribute nothing, so -Inf logits never produce NaN.
func (x LSE) Merge(y LSE) LSE {
	if x.S == 0 {
		return y
	}
	if y.S == 0 {
		return x
	}
	m := math.Max(x.M, y.M)
	ex, ey := math.Exp(x.M-m), math.Exp(y.M-m)
	return LSE{M: m, S: x.S*ex + y.S*ey, A: ex*(x.A+x.S*(x.M-m)) + ey*(y.A+y.S*(y.M-m))}
}

// LogZ is log Σ exp x.
func (x LSE) LogZ() float64 { return x.M + math.Log(x.S) }

// Entropy is -Σ p log p of softmax(x).
func (x LSE) Entropy() float64 { return math.Log(x.S) - x.A/x.S }

// StatsClose returns an error naming the first statistic of got that
// differs from want by more than rel·max(|want|, 1e-3) (relative, with an
// absolute floor for values near 0). It is the comparison of the device step with the CPU
// reference (gpu/README.md, "Tolerances").
func StatsClose(got, want objective.Stats, rel float64) error {
	for _, f := range []struct {
		name string
		g, w float64
	}{
		{"loss", got.Loss, want.Loss}, {"policy_loss", got.PolicyLoss, want.PolicyLoss},
		{"kl", got.KL, want.KL}, {"entropy", got.Entropy, want.Entropy},
		{"approx_kl_old", got.ApproxKLOld, want.ApproxKLOld}, {"ratio_mean", got.RatioMean, want.RatioMean},
		{"ratio_min", got.RatioMin, want.RatioMin}, {"ratio_max", got.RatioMax, want.RatioMax},
		{"clip_frac_pos", got.ClipFracPos, want.ClipFracPos}, {"clip_frac_neg", got.ClipFracNeg, want.ClipFracNeg},
	} {
		if d := math.Abs(f.g - f.w); !(d <= rel*math.Max(math.Abs(f.w), 1e-3)) {
			return fmt.Errorf("%s: got %.9g, want %.9g (|diff| %.3g)", f.name, f.g, f.w, d)
		}
	}
	return nil
}

func finite(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }
