package objective

import (
	"fmt"
	"math"
)

// Validate checks that the options declare a usable loss:
//   - 0 <= ClipLow < 1 and ClipHigh >= 0 (the trust region [1-ClipLow,
//     1+ClipHigh] contains 1 and has a positive lower bound);
//   - Normalization is one of TokenMean, SeqMeanTokenSum, SeqMeanTokenMean,
//     TokenSum (there is no default: the normalization changes the
//     objective, docs/PIPELINE.md §13); NormTokens is > 0 with TokenSum
//     and 0 otherwise;
//   - KLPlacement is "", KLNone, KLLoss or KLReward ("" means KLNone);
//   - KLEstimator is "", K1, K2 or K3, and is set when KLPlacement is KLLoss;
//   - KLCoef, EntropyCoef and MaxLogRatio are finite and >= 0, and
//     EntropyCoef at most math.MaxFloat32 (the CUDA step passes it to its
//     kernels as a float32, where a larger one is +Inf);
//   - OffPolicy is "", OffPolicyNone, OffPolicyTIS or OffPolicyDecoupled;
//     ISCap is 0 or a finite value >= 1, > 0 for OffPolicyTIS and 0
//     without a correction;
//   - Ratio is "", RatioToken or RatioSequence, and RatioSequence has no
//     off-policy correction (not implemented with one).
//
// Every error wraps ErrOptions.
func (o Options) Validate() error {
	finite := func(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }
	switch {
	case !finite(o.ClipLow) || o.ClipLow < 0 || o.ClipLow >= 1:
		return fmt.Errorf("objective: clip_low %v not in [0, 1): %w", o.ClipLow, ErrOptions)
	case !finite(o.ClipHigh) || o.ClipHigh < 0:
		return fmt.Errorf("objective: clip_high %v not finite and >= 0: %w", o.ClipHigh, ErrOptions)
	case !finite(o.KLCoef) || o.KLCoef < 0:
		return fmt.Errorf("objective: kl_coef %v not finite and >= 0: %w", o.KLCoef, ErrOptions)
	case !finite(o.EntropyCoef) || o.EntropyCoef < 0:
		return fmt.Errorf("objective: entropy_coef %v not finite and >= 0: %w", o.EntropyCoef, ErrOptions)
	case o.EntropyCoef > math.MaxFloat32:
		return fmt.Errorf("objective: entropy_coef %v beyond float32's range (at most %v; the CUDA kernels take it as a float32): %w", o.EntropyCoef, float64(math.MaxFloat32), ErrOptions)
	case !finite(o.MaxLogRatio) || o.MaxLogRatio < 0:
		return fmt.Errorf("objective: max_log_ratio %v not finite and >= 0: %w", o.MaxLogRatio, ErrOptions)
	}
	switch o.Normalization {
	case TokenMean, SeqMeanTokenSum, SeqMeanTokenMean, TokenSum:
	default:
		return fmt.Errorf("objective: normalization %q: %w", o.Normalization, ErrOptions)
	}
	if (o.Normalization == TokenSum) != (o.NormTokens > 0) || o.NormTokens < 0 {
		return fmt.Errorf("objective: norm_tokens %d with normalization %q: want > 0 with %s and 0 otherwise: %w", o.NormTokens, o.Normalization, TokenSum, ErrOptions)
	}
	switch o.KLPlacement {
	case "", KLNone, KLLoss, KLReward:
	default:
		return fmt.Errorf("objective: kl_placement %q: %w", o.KLPlacement, ErrOptions)
	}
	switch o.KLEstimator {
	case "", K1, K2, K3:
	default:
		return fmt.Errorf("objective: kl_estimator %q: %w", o.KLEstimator, ErrOptions)
	}
	if o.KLPlacement == KLLoss && o.KLEstimator == "" {
		return fmt.Errorf("objective: kl_placement %q needs kl_estimator: %w", KLLoss, ErrOptions)
	}
	if !finite(o.ISCap) || (o.ISCap != 0 && o.ISCap < 1) {
		return fmt.Errorf("objective: is_cap %v: want 0 (no cap) or a finite cap >= 1 (a cap below 1 would down-weight on-policy tokens): %w", o.ISCap, ErrOptions)
	}
	switch o.OffPolicy {
	case "", OffPolicyNone:
		if o.ISCap != 0 {
			return fmt.Errorf("objective: is_cap %v without an off_policy correction: %w", o.ISCap, ErrOptions)
		}
	case OffPolicyTIS:
		if o.ISCap <= 0 {
			return fmt.Errorf("objective: off_policy %q needs is_cap > 0: %w", OffPolicyTIS, ErrOptions)
		}
	case OffPolicyDecoupled:
	default:
		return fmt.Errorf("objective: off_policy %q (want %q, %q or %q): %w", o.OffPolicy, OffPolicyNone, OffPolicyTIS, OffPolicyDecoupled, ErrOptions)
	}
	switch o.Ratio {
	case "", RatioToken:
	case RatioSequence:
		if o.Corrected() {
			return fmt.Errorf("objective: ratio %q with off_policy %q is not implemented: %w", RatioSequence, o.OffPolicy, ErrOptions)
		}
	default:
		return fmt.Errorf("objective: ratio %q (want %q or %q): %w", o.Ratio, RatioToken, RatioSequence, ErrOptions)
	}
	return nil
}
