// Package objective is the CPU reference of the policy objective (pipeline
// document §12, §13): log-softmax gather of target log-probs, the clipped
// token surrogate, normalizations with global denominators, KL to a
// reference, entropy, clip statistics and the gradient with respect to the
// logits. The CUDA backend is checked against it.
package objective

// Normalization modes (pipeline §13: "token, sequence, turn, or task
// normalization").
const (
	TokenMean        = "token-mean"          // sum over all masked tokens / global masked-token count
	SeqMeanTokenSum  = "seq-mean-token-sum"  // per sequence: token sum; then / global sequence count
	SeqMeanTokenMean = "seq-mean-token-mean" // per sequence: token mean; then / global sequence count
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

// Where a KL-to-reference term enters (pipeline §8: "in reward or in loss,
// never both").
const (
	KLNone   = "none"
	KLLoss   = "loss"
	KLReward = "reward"
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
	// MaxLogRatio clamps current-old log ratios to [-MaxLogRatio,
	// MaxLogRatio] before exponentiation (numerical guard; 0 = off).
	MaxLogRatio float64 `yaml:"max_log_ratio" json:"max_log_ratio"`
}
