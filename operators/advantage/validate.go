package advantage

import (
	"errors"
	"fmt"
	"math"
)

// Estimator versions recorded in every scored record (Scored.EstimatorVersion).
// A version changes whenever the numbers an estimator produces for the same
// input and options would change.
const (
	VersionGRPO = "grpo/1"
	VersionRLOO = "rloo/1"
	VersionGAE  = "gae/1"
)

// Filter reasons written to GroupStats.Filtered.
const (
	FilterZeroVariance = "zero_variance"    // ZeroVarDrop and all contributing returns equal
	FilterIncomplete   = "incomplete_group" // fewer than Options.MinGroupSize members contributed
)

// Errors. Every error returned by this package wraps exactly one of them, so
// the stage can route a group (quarantine, incident, retry) by errors.Is.
var (
	// ErrOptions: the declared Options are not usable.
	ErrOptions = errors.New("advantage: invalid options")
	// ErrInvalid: a record or group is malformed (mixed groups, duplicate
	// members, unknown scope, out-of-range turn, non-finite reward, ...).
	ErrInvalid = errors.New("advantage: invalid input")
	// ErrUnavailable: a reward component carries an Error. It is unavailable,
	// not zero (docs/PIPELINE.md §8, §9 "component availability"); the validate and
	// reward stages decide what happens to the trajectory.
	ErrUnavailable = errors.New("advantage: reward component unavailable")
	// ErrNoCritic: GAE or a declared bootstrap needs a value prediction and
	// the record has NaN or another non-finite value.
	ErrNoCritic = errors.New("advantage: value prediction missing")
	// ErrInfra: an infrastructure-invalid member (StatusInfra) was passed.
	// Such attempts are retried upstream and never contribute to a group
	// (docs/PIPELINE.md §9).
	ErrInfra = errors.New("advantage: infrastructure-invalid member")
)

// Version returns the estimator version string for an estimator name, or ""
// for an unknown name.
func Version(estimator string) string {
	switch estimator {
	case GRPO:
		return VersionGRPO
	case RLOO:
		return VersionRLOO
	case GAE:
		return VersionGAE
	}
	return ""
}

// Validate reports the first unusable field of o, naming it. Rules:
//   - Estimator (name) is GRPO, RLOO or GAE.
//   - StdMode (std_mode) is StdSample or StdPopulation; it may be empty only
//     for RLOO and GAE, whose GroupStats.Std then uses the population
//     convention.
//   - Epsilon is finite and >= 0.
//   - Gamma and Lambda are in [0, 1].
//   - ZeroVariance is ZeroVarKeep, ZeroVarDrop or ZeroVarPenalizeFailed,
//     the last only for GRPO and RLOO (it needs a group-relative baseline).
//   - MinGroupSize >= 1, and >= 2 for RLOO (a leave-one-out baseline needs
//     another member).
//   - BootstrapReasons (bootstrap_truncations) holds distinct, non-empty
//     reasons.
func (o Options) Validate() error {
	switch o.Estimator {
	case GRPO, RLOO, GAE:
	default:
		return fmt.Errorf("%w: Estimator (name) %q: want %q, %q or %q", ErrOptions, o.Estimator, GRPO, RLOO, GAE)
	}
	switch o.StdMode {
	case StdSample, StdPopulation:
	case "":
		if o.Estimator == GRPO {
			return fmt.Errorf("%w: StdMode (std_mode) is required for %s: want %q or %q", ErrOptions, GRPO, StdSample, StdPopulation)
		}
	default:
		return fmt.Errorf("%w: StdMode (std_mode) %q: want %q or %q", ErrOptions, o.StdMode, StdSample, StdPopulation)
	}
	if math.IsNaN(o.Epsilon) || math.IsInf(o.Epsilon, 0) || o.Epsilon < 0 {
		return fmt.Errorf("%w: Epsilon (epsilon) %v: want a finite value >= 0", ErrOptions, o.Epsilon)
	}
	if !(o.Gamma >= 0 && o.Gamma <= 1) {
		return fmt.Errorf("%w: Gamma (gamma) %v: want a value in [0, 1]", ErrOptions, o.Gamma)
	}
	if !(o.Lambda >= 0 && o.Lambda <= 1) {
		return fmt.Errorf("%w: Lambda (lambda) %v: want a value in [0, 1]", ErrOptions, o.Lambda)
	}
	switch o.ZeroVariance {
	case ZeroVarKeep, ZeroVarDrop:
	case ZeroVarPenalizeFailed:
		if o.Estimator == GAE {
			return fmt.Errorf("%w: ZeroVariance (zero_variance) %q needs a group-relative estimator (%q or %q), not %q", ErrOptions, o.ZeroVariance, GRPO, RLOO, GAE)
		}
	default:
		return fmt.Errorf("%w: ZeroVariance (zero_variance) %q: want %q, %q or %q", ErrOptions, o.ZeroVariance, ZeroVarKeep, ZeroVarDrop, ZeroVarPenalizeFailed)
	}
	if o.MinGroupSize < 1 {
		return fmt.Errorf("%w: MinGroupSize (min_group_size) %d: want >= 1", ErrOptions, o.MinGroupSize)
	}
	if o.Estimator == RLOO && o.MinGroupSize < 2 {
		return fmt.Errorf("%w: MinGroupSize (min_group_size) %d: %s needs >= 2", ErrOptions, o.MinGroupSize, RLOO)
	}
	for i, r := range o.BootstrapReasons {
		if r == "" {
			return fmt.Errorf("%w: BootstrapReasons (bootstrap_truncations)[%d] is empty", ErrOptions, i)
		}
		for _, p := range o.BootstrapReasons[:i] {
			if p == r {
				return fmt.Errorf("%w: BootstrapReasons (bootstrap_truncations) lists %q twice", ErrOptions, r)
			}
		}
	}
	return nil
}

// statsStdMode is the std convention of GroupStats.Std under o.
func (o Options) statsStdMode() string {
	if o.StdMode == "" {
		return StdPopulation
	}
	return o.StdMode
}

// bootstraps reports whether reason is a declared bootstrappable truncation.
func (o Options) bootstraps(reason string) bool {
	for _, r := range o.BootstrapReasons {
		if r == reason {
			return true
		}
	}
	return false
}
