package contract

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Stop rule kinds (docs/PIPELINE.md §2, §17).
const (
	// StopSafetyViolation stops the run at the first hard safety violation.
	StopSafetyViolation = "safety_violation"
	// StopNoValidationGain stops the run when the primary metric has not
	// improved for N consecutive evaluations. Text form:
	// "no_validation_gain_for_<N>_evals".
	StopNoValidationGain = "no_validation_gain"
	// StopKLAboveLimit stops the run when the KL to the reference exceeded
	// objective.kl_limit for N consecutive updates. Text form:
	// "kl_above_limit_for_<N>_updates".
	StopKLAboveLimit = "kl_above_limit"
	// StopBudgetExhausted stops the run when any budget is spent.
	StopBudgetExhausted = "budget_exhausted"
)

// maxStopN bounds the N of a counted stop rule.
const maxStopN = 1_000_000

// StopRule is one parsed stop rule. N is the count of a counted rule
// (StopNoValidationGain, StopKLAboveLimit) and 0 for the others.
type StopRule struct {
	Kind string
	N    int
}

// ParseStopRule parses the text form of a stop rule: "safety_violation",
// "budget_exhausted", "no_validation_gain_for_<N>_evals" or
// "kl_above_limit_for_<N>_updates", with N a decimal integer in [1, 1e6].
func ParseStopRule(s string) (StopRule, error) {
	switch s {
	case StopSafetyViolation, StopBudgetExhausted:
		return StopRule{Kind: s}, nil
	}
	for _, f := range []struct{ kind, unit string }{
		{StopNoValidationGain, "evals"},
		{StopKLAboveLimit, "updates"},
	} {
		rest, ok := strings.CutPrefix(s, f.kind+"_for_")
		if !ok {
			continue
		}
		num, ok := strings.CutSuffix(rest, "_"+f.unit)
		if !ok {
			return StopRule{}, fmt.Errorf("stop rule %q: want %s_for_<N>_%s", s, f.kind, f.unit)
		}
		n, err := strconv.Atoi(num)
		if err != nil || n < 1 || n > maxStopN || num != strconv.Itoa(n) {
			return StopRule{}, fmt.Errorf("stop rule %q: N must be a decimal integer in [1, %d]", s, maxStopN)
		}
		return StopRule{Kind: f.kind, N: n}, nil
	}
	return StopRule{}, fmt.Errorf("unknown stop rule %q: want %s, %s, %s_for_<N>_evals or %s_for_<N>_updates",
		s, StopSafetyViolation, StopBudgetExhausted, StopNoValidationGain, StopKLAboveLimit)
}

// String is the text form ParseStopRule reads.
func (r StopRule) String() string {
	switch r.Kind {
	case StopNoValidationGain:
		return fmt.Sprintf("%s_for_%d_evals", r.Kind, r.N)
	case StopKLAboveLimit:
		return fmt.Sprintf("%s_for_%d_updates", r.Kind, r.N)
	}
	return r.Kind
}

// MarshalYAML writes the text form.
func (r StopRule) MarshalYAML() (any, error) { return r.String(), nil }

// relativeSuffix marks a relative regression floor.
const relativeSuffix = "_of_initial"

// ParseFloor parses the string form of a floor: "<x>_of_initial" (relative)
// or a plain number (absolute). x must be finite, and > 0 when relative.
func ParseFloor(s string) (Floor, error) {
	num, rel := strings.CutSuffix(s, relativeSuffix)
	v, err := strconv.ParseFloat(num, 64)
	if err != nil {
		return Floor{}, fmt.Errorf("floor %q: want a number or <x>%s", s, relativeSuffix)
	}
	if !finite(v) { // "NaN", "Inf": strconv reads them, no contract number is one
		return Floor{}, fmt.Errorf("floor %q: must be finite", s)
	}
	return Floor{Value: v, Relative: rel}, nil
}

// String is the text form: "<x>_of_initial" or the number.
func (f Floor) String() string {
	s := strconv.FormatFloat(f.Value, 'g', -1, 64)
	if f.Relative {
		return s + relativeSuffix
	}
	return s
}

// MarshalYAML writes an absolute floor as a number and a relative one as
// "<x>_of_initial".
func (f Floor) MarshalYAML() (any, error) {
	if f.Relative {
		return f.String(), nil
	}
	return f.Value, nil
}

// Value returns the value of a reward component with raw score raw:
// Weight * transform(raw) (docs/PIPELINE.md §8, schemas.RewardComponent). The
// component must be valid (Resolve); an unknown transform yields NaN.
func (r Reward) Value(raw float64) float64 {
	var t float64
	switch r.Transform {
	case TransformIdentity:
		t = raw
	case TransformClip:
		t = math.Min(math.Max(raw, r.ClipMin), r.ClipMax)
	case TransformTanh:
		t = math.Tanh(raw)
	case TransformNegate:
		t = -raw
	default:
		return math.NaN()
	}
	return r.Weight * t
}
