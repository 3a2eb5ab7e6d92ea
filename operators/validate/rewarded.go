package validate

import (
	"math"
	"slices"

	"github.com/trajflow/trajflow/schemas"
)

// Range is a closed interval [Min, Max] of raw scores.
type Range struct {
	Min float64 `yaml:"min" json:"min"`
	Max float64 `yaml:"max" json:"max"`
}

// RewardOptions are the contract's expectations on reward components
// (docs/PIPELINE.md §9 "reward ranges and component availability"). The zero value
// checks only availability, metadata, scope, finiteness and the total.
type RewardOptions struct {
	// Required lists component names every rewarded trajectory must carry;
	// a missing one is "reward_unavailable".
	Required []string
	// Ranges declares, per component name, the interval its raw score
	// (before transform and weight) must lie in.
	Ranges map[string]Range
	// Scopes declares, per component name, the scope its terms must have
	// (the contract's rewards[].scope); another is "reward_scope".
	Scopes map[string]string
}

// totalTolerance is the relative tolerance of the RewardTotal check: the
// total must equal the in-order sum of the component values up to rounding
// of a sum taken in another order.
const totalTolerance = 1e-9

// A rewardCheck inspects one property of a rewarded trajectory.
type rewardCheck func(r *schemas.Rewarded, o *RewardOptions) Verdict

var rewardChecks = []rewardCheck{
	checkRewardAvailable,
	checkRewardRequired,
	checkRewardMetadata,
	checkRewardScope,
	checkRewardDuplicate,
	checkRewardFinite,
	checkRewardRange,
	checkRewardTotal,
}

// CheckRewarded classifies the reward part of a rewarded trajectory
// (docs/PIPELINE.md §8, §9). The trajectory itself is assumed to have passed Check
// before the reward stage ran. A component whose evaluator failed (Error
// non-empty) makes the whole record infra-invalid with reason
// "reward_unavailable": the attempt's reward is unknown, not zero, and an
// evaluator failure is never an agent failure. Checks run in a fixed order
// and the first failure is returned. r is not modified.
func CheckRewarded(r *schemas.Rewarded, opts RewardOptions) Verdict {
	if r == nil {
		return reject(ReasonMissingID, "nil rewarded trajectory")
	}
	for _, c := range rewardChecks {
		if v := c(r, &opts); v.Class != Valid {
			return v
		}
	}
	return accepted
}

func checkRewardAvailable(r *schemas.Rewarded, _ *RewardOptions) Verdict {
	for i := range r.Rewards {
		if c := &r.Rewards[i]; c.Error != "" {
			return reject(ReasonRewardUnavailable, "component %d %s@%s: %s", i, c.Name, c.Version, c.Error)
		}
	}
	return accepted
}

func checkRewardRequired(r *schemas.Rewarded, o *RewardOptions) Verdict {
	for _, name := range o.Required {
		if !slices.ContainsFunc(r.Rewards, func(c schemas.RewardComponent) bool { return c.Name == name }) {
			return reject(ReasonRewardUnavailable, "required component %q is missing", name)
		}
	}
	return accepted
}

func checkRewardMetadata(r *schemas.Rewarded, _ *RewardOptions) Verdict {
	for i := range r.Rewards {
		c := &r.Rewards[i]
		switch {
		case c.Name == "":
			return reject(ReasonRewardMetadata, "component %d has no name", i)
		case c.Version == "":
			return reject(ReasonRewardMetadata, "component %d %s has no version", i, c.Name)
		case c.TrajectoryID != r.RecordID:
			return reject(ReasonRewardMetadata, "component %d %s belongs to trajectory %q, not %q", i, c.Name, c.TrajectoryID, r.RecordID)
		}
	}
	return accepted
}

func checkRewardScope(r *schemas.Rewarded, o *RewardOptions) Verdict {
	for i := range r.Rewards {
		c := &r.Rewards[i]
		if want, ok := o.Scopes[c.Name]; ok && c.Scope != want {
			return reject(ReasonRewardScope, "component %d %s: scope %q, the contract declares %q", i, c.Name, c.Scope, want)
		}
		switch c.Scope {
		case schemas.ScopeTrajectory:
			if c.Turn != -1 {
				return reject(ReasonRewardScope, "component %d %s: trajectory scope with turn %d (want -1)", i, c.Name, c.Turn)
			}
		case schemas.ScopeTurn, schemas.ScopeSpan:
			if c.Turn < 0 || int(c.Turn) >= len(r.Turns) {
				return reject(ReasonRewardScope, "component %d %s: turn %d of %d", i, c.Name, c.Turn, len(r.Turns))
			}
			if c.Scope == schemas.ScopeSpan {
				n := int32(len(r.Turns[c.Turn].ActionIDs))
				if c.SpanStart < 0 || c.SpanStart >= c.SpanEnd || c.SpanEnd > n {
					return reject(ReasonRewardScope, "component %d %s: span [%d,%d) of turn %d with %d action tokens", i, c.Name, c.SpanStart, c.SpanEnd, c.Turn, n)
				}
			}
		default:
			return reject(ReasonRewardScope, "component %d %s: scope %q", i, c.Name, c.Scope)
		}
	}
	return accepted
}

func checkRewardDuplicate(r *schemas.Rewarded, _ *RewardOptions) Verdict {
	type place struct {
		name, scope          string
		turn, start, spanEnd int32
	}
	seen := make(map[place]int, len(r.Rewards))
	for i := range r.Rewards {
		c := &r.Rewards[i]
		p := place{c.Name, c.Scope, c.Turn, c.SpanStart, c.SpanEnd}
		if c.Scope == schemas.ScopeTrajectory {
			p.start, p.spanEnd = 0, 0
		}
		if j, ok := seen[p]; ok {
			return reject(ReasonDuplicateReward, "components %d and %d: %s %s turn %d", j, i, c.Name, c.Scope, c.Turn)
		}
		seen[p] = i
	}
	return accepted
}

func checkRewardFinite(r *schemas.Rewarded, _ *RewardOptions) Verdict {
	for i := range r.Rewards {
		c := &r.Rewards[i]
		for _, f := range [...]struct {
			name string
			v    float64
		}{{"raw", c.Raw}, {"weight", c.Weight}, {"value", c.Value}, {"uncertainty", c.Uncertainty}} {
			if !isFinite(f.v) {
				return reject(ReasonNonFiniteReward, "component %d %s: %s is %v", i, c.Name, f.name, f.v)
			}
		}
	}
	if !isFinite(r.RewardTotal) {
		return reject(ReasonNonFiniteReward, "reward total is %v", r.RewardTotal)
	}
	return accepted
}

func checkRewardRange(r *schemas.Rewarded, o *RewardOptions) Verdict {
	if len(o.Ranges) == 0 {
		return accepted
	}
	for i := range r.Rewards {
		c := &r.Rewards[i]
		rg, ok := o.Ranges[c.Name]
		if ok && (c.Raw < rg.Min || c.Raw > rg.Max) {
			return reject(ReasonRewardOutOfRange, "component %d %s: raw %v outside [%v, %v]", i, c.Name, c.Raw, rg.Min, rg.Max)
		}
	}
	return accepted
}

func checkRewardTotal(r *schemas.Rewarded, _ *RewardOptions) Verdict {
	sum, mag := 0.0, 0.0
	for i := range r.Rewards {
		if r.Rewards[i].Error == "" {
			sum += r.Rewards[i].Value
			mag += math.Abs(r.Rewards[i].Value)
		}
	}
	if math.Abs(r.RewardTotal-sum) > totalTolerance*math.Max(1, mag) {
		return reject(ReasonRewardTotalMismatch, "reward total %v, components sum to %v", r.RewardTotal, sum)
	}
	return accepted
}
