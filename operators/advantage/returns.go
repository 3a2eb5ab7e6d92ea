package advantage

import (
	"fmt"
	"math"

	"github.com/trajflow/trajflow/schemas"
)

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// TurnRewards maps the reward components of r to one reward per turn
// (docs/PIPELINE.md §10: "map reward events to decision steps"):
//   - a ScopeTrajectory component is added to the last turn;
//   - a ScopeTurn component is added to turn Turn;
//   - a ScopeSpan component is an additive reward of turn Turn (docs/PIPELINE.md §10,
//     multi-turn decomposition: span rewards are treated as additive rewards,
//     not as direct advantages, value targets or weights).
//
// Components are summed in slice order, so the result is bit-for-bit the same
// on every run. It returns an error, and no rewards, when:
//   - a component has a non-empty Error (wraps ErrUnavailable and names the
//     component): an unavailable component is never read as 0;
//   - the trajectory has no turns, a turn's Index is not its position, a
//     component's turn is out of range, a span lies outside its turn's
//     action tokens, a scope is unknown, a Value is not finite, or a
//     component names another trajectory (wraps ErrInvalid).
func TurnRewards(r *schemas.Rewarded) ([]float64, error) {
	n := len(r.Turns)
	if n == 0 {
		return nil, fmt.Errorf("%w: trajectory %s has no turns", ErrInvalid, r.RecordID)
	}
	for i := range r.Turns {
		if r.Turns[i].Index != int32(i) {
			return nil, fmt.Errorf("%w: trajectory %s: turn at position %d has index %d", ErrInvalid, r.RecordID, i, r.Turns[i].Index)
		}
	}
	out := make([]float64, n)
	for i := range r.Rewards {
		c := &r.Rewards[i]
		if c.Error != "" {
			return nil, fmt.Errorf("%w: trajectory %s: component %s (version %s): %s", ErrUnavailable, r.RecordID, c.Name, c.Version, c.Error)
		}
		if c.TrajectoryID != "" && c.TrajectoryID != r.RecordID {
			return nil, fmt.Errorf("%w: trajectory %s: component %s belongs to trajectory %s", ErrInvalid, r.RecordID, c.Name, c.TrajectoryID)
		}
		if !finite(c.Value) {
			return nil, fmt.Errorf("%w: trajectory %s: component %s has non-finite value %v", ErrInvalid, r.RecordID, c.Name, c.Value)
		}
		switch c.Scope {
		case schemas.ScopeTrajectory:
			out[n-1] += c.Value
		case schemas.ScopeTurn, schemas.ScopeSpan:
			if c.Turn < 0 || int(c.Turn) >= n {
				return nil, fmt.Errorf("%w: trajectory %s: component %s (%s scope) names turn %d of %d", ErrInvalid, r.RecordID, c.Name, c.Scope, c.Turn, n)
			}
			if c.Scope == schemas.ScopeSpan {
				a := len(r.Turns[c.Turn].ActionIDs)
				if c.SpanStart < 0 || c.SpanStart > c.SpanEnd || int(c.SpanEnd) > a {
					return nil, fmt.Errorf("%w: trajectory %s: component %s span [%d,%d) outside the %d action tokens of turn %d", ErrInvalid, r.RecordID, c.Name, c.SpanStart, c.SpanEnd, a, c.Turn)
				}
			}
			out[c.Turn] += c.Value
		default:
			return nil, fmt.Errorf("%w: trajectory %s: component %s has unknown scope %q", ErrInvalid, r.RecordID, c.Name, c.Scope)
		}
	}
	return out, nil
}

// Bootstrap returns the value V_T that follows the last turn of t under o
// (docs/PIPELINE.md §10: "bootstrap only for configured nonterminal truncations"):
// t.BootstrapValue when t was truncated (End == EndTruncated) for a reason
// listed in o.BootstrapReasons, otherwise 0 — for a termination and for a
// truncation whose reason is not declared. A declared truncation whose
// BootstrapValue is not finite (NaN: no critic ran) wraps ErrNoCritic; an End
// that is neither EndTerminated nor EndTruncated wraps ErrInvalid.
func Bootstrap(o Options, t *schemas.Trajectory) (float64, error) {
	switch t.End {
	case schemas.EndTerminated:
		return 0, nil
	case schemas.EndTruncated:
		if !o.bootstraps(t.EndReason) {
			return 0, nil
		}
		v := float64(t.BootstrapValue)
		if !finite(v) {
			return 0, fmt.Errorf("%w: trajectory %s truncated (%s) with bootstrap value %v", ErrNoCritic, t.RecordID, t.EndReason, v)
		}
		return v, nil
	}
	return 0, fmt.Errorf("%w: trajectory %s has end %q: want %q or %q", ErrInvalid, t.RecordID, t.End, schemas.EndTerminated, schemas.EndTruncated)
}

// RewardToGo returns the discounted reward-to-go of every turn:
// G_t = r_t + gamma * G_{t+1}, with G_T = bootstrap (pass 0 for a
// termination). The result has len(rewards) entries and is computed back to
// front in a fixed order.
func RewardToGo(rewards []float64, gamma, bootstrap float64) []float64 {
	out := make([]float64, len(rewards))
	g := bootstrap
	for t := len(rewards) - 1; t >= 0; t-- {
		g = rewards[t] + gamma*g
		out[t] = g
	}
	return out
}

// unitRoundoff is u = 2^-53, the largest relative error of one rounded
// float64 operation (round to nearest).
const unitRoundoff = 0x1p-53

// ReturnBound bounds the rounding error of r's return R = G_0 as
// TurnRewards and RewardToGo compute it with bootstrap value boot, so that
// returns which differ by less than their bounds are not told apart
// (Stats: zero variance). Reward values are rounded reals (0.1 is not a
// float64), and so is gamma; each of the K reward components contributes
// its own representation error and one addition, each of the T turns the
// representation of gamma, one multiplication and one addition: m = 2K + 3T
// rounding errors, each at most u times the magnitude of a partial result.
// Every partial result is at most M = sum of |value| over the components
// plus |boot| (gamma <= 1 only shrinks terms), so, with Higham's
// gamma_m = m u / (1 - m u) (Accuracy and Stability of Numerical
// Algorithms, §3.1):
//
//	|fl(R) - R| <= gamma_m * M
//
// Summing magnitudes rather than taking |R| keeps the bound honest under
// cancellation (0.1 + 0.2 - 0.3 is 5.6e-17, not 0). The bound is relative
// to the rewards' scale: for 100 turns with one reward each it is about
// 5.6e-14 M, far below any difference a reward function means, so no real
// spread of returns is ever read as zero variance.
func ReturnBound(r *schemas.Rewarded, boot float64) float64 {
	m := float64(2*len(r.Rewards) + 3*len(r.Turns))
	mag := math.Abs(boot)
	for i := range r.Rewards {
		mag += math.Abs(r.Rewards[i].Value)
	}
	return m * unitRoundoff / (1 - m*unitRoundoff) * mag
}

// GAEAdvantages computes generalized advantage estimates over one trajectory's turns:
//
//	delta_t = r_t + gamma * V_{t+1} - V_t,  with V_T = bootstrap
//	A_t     = delta_t + gamma * lambda * A_{t+1},  with A_T = 0
//
// and returns the advantages and the value targets returns_t = A_t + V_t
// (the lambda-returns a critic regresses on). Pass bootstrap 0 for a
// termination or an undeclared truncation (see Bootstrap). It panics when
// len(values) != len(rewards); callers check lengths and finiteness first.
func GAEAdvantages(rewards, values []float64, bootstrap, gamma, lambda float64) (adv, returns []float64) {
	if len(values) != len(rewards) {
		panic(fmt.Sprintf("advantage: GAEAdvantages with %d rewards and %d values", len(rewards), len(values)))
	}
	n := len(rewards)
	adv = make([]float64, n)
	returns = make([]float64, n)
	gl := gamma * lambda
	next := bootstrap
	a := 0.0
	for t := n - 1; t >= 0; t-- {
		delta := rewards[t] + gamma*next - values[t]
		a = delta + gl*a
		adv[t] = a
		returns[t] = a + values[t]
		next = values[t]
	}
	return adv, returns
}

// turnValues returns the critic values of t's turns as float64, or an error
// wrapping ErrNoCritic naming the first non-finite one.
func turnValues(t *schemas.Trajectory) ([]float64, error) {
	v := make([]float64, len(t.Turns))
	for i := range t.Turns {
		x := float64(t.Turns[i].Value)
		if !finite(x) {
			return nil, fmt.Errorf("%w: trajectory %s turn %d has value %v (GAE needs a critic)", ErrNoCritic, t.RecordID, i, x)
		}
		v[i] = x
	}
	return v, nil
}
