// Package advantage turns rewarded trajectories into scored ones: returns,
// advantages and group statistics (docs/PIPELINE.md §10).
package advantage

// Estimator names.
const (
	GRPO = "grpo"
	RLOO = "rloo"
	GAE  = "gae"
)

// Zero-variance group policies: what happens to a group whose contributing
// returns are all equal, up to the rounding error of computing them
// (Stats, ReturnBound) (docs/PIPELINE.md §10: "handle zero-variance groups according
// to the declared algorithm").
const (
	ZeroVarKeep = "keep" // advantages are 0; the group is admitted and counts in denominators
	ZeroVarDrop = "drop" // the group is filtered with reason "zero_variance" and counted
	// ZeroVarPenalizeFailed trains a group that failed whole (GRPO and RLOO
	// only): when every contributing return is <= 0 each member gets the
	// advantage it would have had if one more attempt had returned one unit
	// more than the best of them (FailedAdvantages); any other zero-variance
	// group is dropped as with ZeroVarDrop (docs/PIPELINE.md §10).
	ZeroVarPenalizeFailed = "penalize_failed"
)

// Standard-deviation conventions for GRPO.
const (
	StdSample     = "sample"     // divide by n-1 (torch.std default)
	StdPopulation = "population" // divide by n
)

// Options declares the estimator. The zero value is not valid; the learning
// contract fills defaults.
type Options struct {
	Estimator    string  `yaml:"name" json:"name"`
	NormalizeStd bool    `yaml:"normalize_std" json:"normalize_std"` // GRPO: divide by the group std
	StdMode      string  `yaml:"std_mode" json:"std_mode"`
	Epsilon      float64 `yaml:"epsilon" json:"epsilon"` // GRPO: added to the std
	Gamma        float64 `yaml:"gamma" json:"gamma"`     // discount across turns
	Lambda       float64 `yaml:"lambda" json:"lambda"`   // GAE
	ZeroVariance string  `yaml:"zero_variance" json:"zero_variance"`
	// MinGroupSize is the declared partial-group policy: a group whose
	// contributing members are fewer is filtered ("incomplete_group").
	MinGroupSize int `yaml:"min_group_size" json:"min_group_size"`
	// BootstrapReasons lists the truncation reasons from which GAE and
	// reward-to-go bootstrap with the trajectory's BootstrapValue. Every other
	// ending (termination, or a truncation not listed) bootstraps with 0.
	BootstrapReasons []string `yaml:"bootstrap_truncations" json:"bootstrap_truncations"`
}
