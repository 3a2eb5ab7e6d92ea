// Package objective is the CPU reference of the policy objective (pipeline
// document §12, §13): log-softmax gather of target log-probs, the clipped
// token surrogate, normalizations with global denominators, KL to a
// reference, entropy, clip statistics and the gradient with respect to the
// logits. The CUDA backend is checked against it.
package objective

// Normalization modes (docs/PIPELINE.md §13: "token, sequence, turn, or task
// normalization").
const (
	TokenMean        = "token-mean"          // sum over all masked tokens / global masked-token count
	SeqMeanTokenSum  = "seq-mean-token-sum"  // per sequence: token sum; then / global sequence count
	SeqMeanTokenMean = "seq-mean-token-mean" // per sequence: token mean; then / global sequence count
	// TokenSum: the sum over all masked tokens / Options.NormTokens, a
	// constant the loss declares (not the batch's count): a batch with
	// fewer trained tokens takes a proportionally smaller gradient, where
	// TokenMean gives every batch the same gradient scale however few
	// tokens it has (with Adam, a full step of noise). docs/PIPELINE.md §13.
	TokenSum = "token-sum"
)

// KL estimators of KL(pi || ref) on sampled tokens, with
// logr = ref_logprob - cur_logprob:
//
//	k1 = -logr
//	k2 = logr^2 / 2
//	k3 = exp(logr) - 1 - logr
const (
	K1 = "k1"
	K2 = "k2"
	K3 = "k3"
)

// Where a KL-to-reference term enters (docs/PIPELINE.md §8: "in reward or in loss,
// never both").
const (
	KLNone   = "none"
	KLLoss   = "loss"
	KLReward = "reward"
)

// Off-policy corrections (docs/PIPELINE.md §13, §15): how a sample's behavior
// policy, older than the trainer's, enters the objective.
const (
	// OffPolicyNone: the clipped surrogate of the ratio to the behavior
	// policy, r = π/μ (the default).
	OffPolicyNone = "none"
	// OffPolicyTIS: truncated importance sampling against the behavior
	// policy: the policy gradient weighted by min(π/μ, ISCap), no trust
	// region beyond the cap (ISCap > 0 required).
	OffPolicyTIS = "tis"
	// OffPolicyDecoupled: the decoupled clipped objective (decoupled PPO):
	// the importance weight w = π_prox/μ (capped at ISCap when set) times
	// the clipped surrogate of r = π/π_prox, π_prox being the policy at the
	// start of the update, so the trust region is measured from the
	// trainer's own policy, not from the behavior policy.
	OffPolicyDecoupled = "decoupled"
)

// Ratio levels (docs/PIPELINE.md §13: "token- versus sequence-level ratio").
const (
	// RatioToken: every token's own ratio π/μ (the default; "" too).
	RatioToken = "token"
	// RatioSequence: every token of a sequence takes the sequence's
	// ratio, the geometric mean of its tokens' ratios, exp of the mean
	// log ratio over its trained tokens; the gradient reaches each token
	// through its own log-prob only (the other tokens' part of the mean is
	// held constant: GSPO's token form). With a constant advantage per
	// sequence and SeqMeanTokenMean this is GSPO's sequence objective, value
	// and gradient.
	RatioSequence = "sequence"
)

// Options declares the loss.
type Options struct {
	ClipLow       float64 `yaml:"clip_low" json:"clip_low"`   // ratio lower bound 1-ClipLow
	ClipHigh      float64 `yaml:"clip_high" json:"clip_high"` // ratio upper bound 1+ClipHigh
	Normalization string  `yaml:"normalization" json:"normalization"`
	KLPlacement   string  `yaml:"kl_placement" json:"kl_placement"`
	KLEstimator   string  `yaml:"kl_estimator" json:"kl_estimator"`
	KLCoef        float64 `yaml:"kl_coef" json:"kl_coef"`
	EntropyCoef   float64 `yaml:"entropy_coef" json:"entropy_coef"`
	// NormTokens is TokenSum's denominator (> 0 with TokenSum, 0
	// otherwise).
	NormTokens int64 `yaml:"norm_tokens" json:"norm_tokens,omitempty"`
	// MaxLogRatio clamps current-old log ratios to [-MaxLogRatio,
	// MaxLogRatio] before exponentiation (numerical guard; 0 = off, when a
	// ratio that overflows is an ErrNonFinite error). The learning contract
	// defaults it to DefaultMaxLogRatio.
	MaxLogRatio float64 `yaml:"max_log_ratio" json:"max_log_ratio"`
	// OffPolicy is the off-policy correction: "" or OffPolicyNone,
	// OffPolicyTIS, OffPolicyDecoupled.
	OffPolicy string `yaml:"off_policy" json:"off_policy,omitempty"`
	// ISCap truncates the importance weight to the behavior policy
	// (OffPolicyTIS: required; OffPolicyDecoupled: 0 = no cap); 0 or >= 1
	// (on policy the weight is exactly 1). Must be 0 with no correction.
	ISCap float64 `yaml:"is_cap" json:"is_cap,omitempty"`
	// Ratio is the ratio level: "" (RatioToken) or RatioSequence, which
	// needs no off-policy correction. The learning contract leaves it out
	// of its hash when it is the default, so a contract written before
	// the key existed keeps its hash.
	Ratio string `yaml:"ratio" json:"ratio,omitempty" contract:"omitzero"`
}

// SequenceRatio reports whether o declares the sequence-level ratio.
func (o Options) SequenceRatio() bool { return o.Ratio == RatioSequence }

// PerToken turns a normalized sum Σ c_t x_t of o's loss over tokens
// trained tokens (the Entropy and KL of Stats) into a mean per trained
// token where o's normalization divides by a constant: token-sum's is
// NormTokens, not the batch's count. Every other normalization's value is
// returned as it is (token-mean's is that mean already).
func (o Options) PerToken(x float64, tokens int64) float64 {
	if o.Normalization == TokenSum && tokens > 0 {
		return x * float64(o.NormTokens) / float64(tokens)
	}
	return x
}

// Weight is the normalization weight c_t of one masked token under o
// (Compute): den are the batch's global denominators and segTokens the
// masked tokens of the token's sequence (used by SeqMeanTokenMean only).
// The CPU objective and the CUDA stage both take it from here.
func (o Options) Weight(den Denominators, segTokens int32) float64 {
	switch o.Normalization {
	case TokenMean:
		return 1 / float64(den.Tokens)
	case SeqMeanTokenSum:
		return 1 / float64(den.Sequences)
	case TokenSum:
		return 1 / float64(o.NormTokens)
	default: // SeqMeanTokenMean
		return 1 / (float64(segTokens) * float64(den.Sequences))
	}
}

// Corrected reports whether o declares an off-policy correction.
func (o Options) Corrected() bool { return o.OffPolicy != "" && o.OffPolicy != OffPolicyNone }

// DefaultMaxLogRatio is the default MaxLogRatio: ratios are kept within
// [e^-20, e^20] = [2.1e-9, 4.9e8]. It never changes a sane run: the clip
// range ([0.8, 1.28] in the demo) cuts the surrogate's gradient at log
// ratios of about ±0.25 already, a policy step that moves a token's
// log-prob by 20 nats is a broken run, not a trust region, and on policy
// the ratio is exactly 1 (log ratio exactly 0: current log-probs are
// rounded to float32 like the stored ones) and never clamped. A clamped
// token contributes its clamped value and no surrogate gradient, like a
// clipped one. 20 keeps r·A and its gradient far inside float32 (e^88 would
// overflow) for any advantage below 1e29, where an unclamped finite log
// ratio of 710 already overflows float64.
const DefaultMaxLogRatio = 20
