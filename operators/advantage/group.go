package advantage

import (
	"cmp"
	"fmt"
	"math"
	"slices"

	"github.com/trajflow/trajflow/schemas"
)

// Stats returns the statistics of the trajectory returns of one group, in
// the given order (the sum runs in slice order): Size = len(returns), Mean,
// Std under stdMode (StdSample divides by n-1 and is 0 for a single return;
// StdPopulation divides by n), Min, Max and ZeroVar. Expected, Filtered and
// Incomplete are left for the caller.
//
// ZeroVar says the returns may all be the same real number: bounds, when
// not nil, holds for each return a bound on its rounding error (ReturnBound)
// and ZeroVar holds when the intervals returns[i] ± bounds[i] share a point
// (max(R_i - e_i) <= min(R_i + e_i)); with nil bounds it is min == max,
// exactly. A zero-variance group records Std 0: its spread is rounding,
// never a signal to standardize.
func Stats(returns, bounds []float64, stdMode string) schemas.GroupStats {
	n := len(returns)
	s := schemas.GroupStats{Size: int32(n)}
	if n == 0 {
		return s
	}
	s.Min, s.Max = returns[0], returns[0]
	lo, hi := math.Inf(-1), math.Inf(1) // the intersection of the intervals
	sum := 0.0
	for i, r := range returns {
		sum += r
		s.Min = math.Min(s.Min, r)
		s.Max = math.Max(s.Max, r)
		e := 0.0
		if bounds != nil {
			e = bounds[i]
		}
		lo = math.Max(lo, r-e)
		hi = math.Min(hi, r+e)
	}
	s.Mean = sum / float64(n)
	s.ZeroVar = s.Min == s.Max || lo <= hi
	ss := 0.0
	for _, r := range returns {
		d := r - s.Mean
		ss += d * d
	}
	switch {
	case s.ZeroVar:
		s.Std = 0
	case stdMode == StdSample:
		if n > 1 {
			s.Std = math.Sqrt(ss / float64(n-1))
		}
	default:
		s.Std = math.Sqrt(ss / float64(n))
	}
	return s
}

// GRPOAdvantages returns group-standardized advantages (docs/PIPELINE.md §10):
// A_i = R_i - mean, divided by (std + epsilon) when normalizeStd, with std
// under stdMode as in Stats. When the returns are equal (Stats' ZeroVar,
// with the rounding bounds given, nil for exact equality) every advantage
// is exactly 0 (no division by a zero or rounding-sized std, no residue of
// the mean).
func GRPOAdvantages(returns, bounds []float64, normalizeStd bool, stdMode string, epsilon float64) []float64 {
	s := Stats(returns, bounds, stdMode)
	adv := make([]float64, len(returns))
	if s.ZeroVar {
		return adv
	}
	for i, r := range returns {
		a := r - s.Mean
		if normalizeStd {
			a /= s.Std + epsilon
		}
		adv[i] = a
	}
	return adv
}

// RLOOAdvantages returns leave-one-out advantages (docs/PIPELINE.md §10):
// A_i = R_i - mean_{j != i} R_j, each baseline summed in slice order. A
// single return has no baseline and gets 0; equal returns (Stats' ZeroVar
// with the rounding bounds given) get exactly 0.
func RLOOAdvantages(returns, bounds []float64) []float64 {
	n := len(returns)
	adv := make([]float64, n)
	if n < 2 {
		return adv
	}
	for i, r := range returns {
		sum := 0.0
		for j, x := range returns {
			if j != i {
				sum += x
			}
		}
		adv[i] = r - sum/float64(n-1)
	}
	if Stats(returns, bounds, StdPopulation).ZeroVar {
		clear(adv)
	}
	return adv
}

// FailedAdvantages returns the advantages of a group that failed whole under
// ZeroVarPenalizeFailed (docs/PIPELINE.md §10): the estimator's advantages
// (GRPO as declared in opts, or RLOO) for the returns given, computed as if
// one more member had returned max(returns) + 1, that member left out. Each
// member is pushed away from what it did as far as it would have been had
// one more attempt succeeded: for n members and epsilon 0, -1/sqrt(n) for
// GRPO with the population std, -1/sqrt(n+1) with the sample std, -1/(n+1)
// without normalization, and -1/n for RLOO. It panics on an estimator
// other than GRPO or RLOO (Options.Validate refuses that combination).
func FailedAdvantages(opts Options, returns, bounds []float64) []float64 {
	n := len(returns)
	r := append(slices.Clone(returns), slices.Max(returns)+1)
	var b []float64 // the extra return is exact
	if bounds != nil {
		b = append(slices.Clone(bounds), 0)
	}
	switch opts.Estimator {
	case GRPO:
		return GRPOAdvantages(r, b, opts.NormalizeStd, opts.StdMode, opts.Epsilon)[:n]
	case RLOO:
		return RLOOAdvantages(r, b)[:n]
	}
	panic("advantage: FailedAdvantages with estimator " + opts.Estimator)
}

// ScoreGroup is the advantage stage's pure function for one group: members
// are the rewarded trajectories of one group_id that contribute returns (a
// complete group, or what a partial-group timeout closed). It returns one
// Scored per member, sorted by (Member, RecordID), so the output never
// depends on input order. Every Scored embeds its input Rewarded; the slices
// inside it are shared, not copied.
//
// For each member, in float64 and fixed order:
//   - TurnRewards (see TurnRewards) and TurnReturns, the reward-to-go with
//     discount Gamma and the value from Bootstrap;
//   - the trajectory return R = TurnReturns[0];
//   - GRPO and RLOO: the trajectory advantage from the group's returns
//     (GRPOAdvantages, RLOOAdvantages), broadcast to every turn;
//     TurnValueTargets = TurnReturns (Monte Carlo targets, no critic ran);
//   - GAE: per trajectory over its turns, with Turn.Value as V_t (a
//     non-finite value wraps ErrNoCritic); TurnValueTargets = A + V.
//
// Group statistics over the returns R are recorded before any filtering or
// normalization (docs/PIPELINE.md §10): Size = members passed, Expected =
// GroupSize, Std under StdMode (population when StdMode is empty),
// Incomplete = Size < Expected. Then, in this order:
//   - Size < MinGroupSize: Filtered = FilterIncomplete (declared
//     partial-group policy, docs/PIPELINE.md §9);
//   - all returns equal up to their rounding error (Stats' ZeroVar with
//     ReturnBound of each member): GRPO and RLOO advantages are exactly 0; with
//     ZeroVarDrop every member gets Filtered = FilterZeroVariance (for any
//     estimator), with ZeroVarKeep the group is admitted; with
//     ZeroVarPenalizeFailed a group whose returns are all <= 0 is admitted
//     with FailedAdvantages broadcast to every turn, any other is filtered
//     as with ZeroVarDrop.
//
// A filtered group is still returned in full so the census can count it and
// its denominator (docs/PIPELINE.md §9); downstream stages must not train on it.
//
// Errors (no partial output): invalid Options (ErrOptions); no members, mixed
// GroupID or GroupSize, a Member outside [0, GroupSize), a repeated Member
// or RecordID, an unknown Status or End (ErrInvalid); a StatusInfra member
// (ErrInfra); and any error of TurnRewards, Bootstrap or the critic values.
func ScoreGroup(opts Options, members []schemas.Rewarded) ([]schemas.Scored, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	if len(members) == 0 {
		return nil, fmt.Errorf("%w: empty group", ErrInvalid)
	}
	idx := make([]int, len(members))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int {
		ma, mb := &members[a], &members[b]
		if c := cmp.Compare(ma.Member, mb.Member); c != 0 {
			return c
		}
		return cmp.Compare(ma.RecordID, mb.RecordID)
	})
	first := &members[idx[0]]
	gid, size := first.GroupID, first.GroupSize
	if size < 1 {
		return nil, fmt.Errorf("%w: group %s has group size %d", ErrInvalid, gid, size)
	}
	seen := make(map[string]struct{}, len(members))
	for k, i := range idx {
		m := &members[i]
		if m.GroupID != gid {
			return nil, fmt.Errorf("%w: group %s contains trajectory %s of group %s", ErrInvalid, gid, m.RecordID, m.GroupID)
		}
		if m.GroupSize != size {
			return nil, fmt.Errorf("%w: group %s: trajectory %s declares group size %d, another %d", ErrInvalid, gid, m.RecordID, m.GroupSize, size)
		}
		if m.Member < 0 || m.Member >= size {
			return nil, fmt.Errorf("%w: group %s: trajectory %s is member %d of %d", ErrInvalid, gid, m.RecordID, m.Member, size)
		}
		if k > 0 && members[idx[k-1]].Member == m.Member {
			return nil, fmt.Errorf("%w: group %s: member %d appears twice (%s, %s)", ErrInvalid, gid, m.Member, members[idx[k-1]].RecordID, m.RecordID)
		}
		if _, dup := seen[m.RecordID]; dup {
			return nil, fmt.Errorf("%w: group %s: record %s appears twice", ErrInvalid, gid, m.RecordID)
		}
		seen[m.RecordID] = struct{}{}
		switch m.Status {
		case schemas.StatusCompleted, schemas.StatusFailed, schemas.StatusTimedOut:
		case schemas.StatusInfra:
			return nil, fmt.Errorf("%w: group %s: trajectory %s", ErrInfra, gid, m.RecordID)
		default:
			return nil, fmt.Errorf("%w: group %s: trajectory %s has unknown status %q", ErrInvalid, gid, m.RecordID, m.Status)
		}
	}

	n := len(members)
	rewards := make([][]float64, n)
	rtg := make([][]float64, n)
	ret := make([]float64, n)
	bound := make([]float64, n)
	for k, i := range idx {
		m := &members[i]
		r, err := TurnRewards(m)
		if err != nil {
			return nil, fmt.Errorf("group %s: %w", gid, err)
		}
		boot, err := Bootstrap(opts, &m.Trajectory)
		if err != nil {
			return nil, fmt.Errorf("group %s: %w", gid, err)
		}
		rewards[k] = r
		rtg[k] = RewardToGo(r, opts.Gamma, boot)
		ret[k] = rtg[k][0]
		bound[k] = ReturnBound(m, boot)
	}

	stats := Stats(ret, bound, opts.statsStdMode())
	stats.Expected = size
	stats.Incomplete = stats.Size < size

	complete := int(stats.Size) >= opts.MinGroupSize
	// Under ZeroVarPenalizeFailed a complete group that failed whole is
	// trained with FailedAdvantages; any other zero-variance group is
	// filtered, as under ZeroVarDrop.
	penalize := opts.ZeroVariance == ZeroVarPenalizeFailed && stats.ZeroVar && complete && stats.Max <= 0

	adv := make([][]float64, n)
	targets := make([][]float64, n)
	switch opts.Estimator {
	case GRPO, RLOO:
		var a []float64
		switch {
		case penalize:
			a = FailedAdvantages(opts, ret, bound)
		case opts.Estimator == GRPO:
			a = GRPOAdvantages(ret, bound, opts.NormalizeStd, opts.StdMode, opts.Epsilon)
		default:
			a = RLOOAdvantages(ret, bound)
		}
		for k := range n {
			adv[k] = make([]float64, len(rewards[k]))
			for t := range adv[k] {
				adv[k][t] = a[k]
			}
			targets[k] = rtg[k]
		}
	case GAE:
		for k, i := range idx {
			m := &members[i]
			v, err := turnValues(&m.Trajectory)
			if err != nil {
				return nil, fmt.Errorf("group %s: %w", gid, err)
			}
			boot, _ := Bootstrap(opts, &m.Trajectory) // checked above
			adv[k], targets[k] = GAEAdvantages(rewards[k], v, boot, opts.Gamma, opts.Lambda)
		}
	}

	switch {
	case !complete:
		stats.Filtered = FilterIncomplete
	case stats.ZeroVar && opts.ZeroVariance != ZeroVarKeep && !penalize:
		stats.Filtered = FilterZeroVariance
	}

	out := make([]schemas.Scored, n)
	version := Version(opts.Estimator)
	total := 0
	for k := range n {
		total += 4 * len(rewards[k])
	}
	slab := make([]float32, total) // one allocation for the group's output columns
	for k, i := range idx {
		s := schemas.Scored{
			Rewarded:         members[i],
			TurnRewards:      to32(&slab, rewards[k]),
			TurnReturns:      to32(&slab, rtg[k]),
			TurnAdvantages:   to32(&slab, adv[k]),
			TurnValueTargets: to32(&slab, targets[k]),
			Group:            stats,
			Estimator:        opts.Estimator,
			EstimatorVersion: version,
		}
		for _, xs := range [][]float32{s.TurnRewards, s.TurnReturns, s.TurnAdvantages, s.TurnValueTargets} {
			for t, x := range xs {
				if !finite(float64(x)) {
					return nil, fmt.Errorf("%w: group %s: trajectory %s turn %d: result %v does not fit float32", ErrInvalid, gid, members[i].RecordID, t, x)
				}
			}
		}
		out[k] = s
	}
	return out, nil
}

// to32 rounds xs to float32 (round to nearest) into the front of *slab and
// advances it. The result's capacity is its length, so appending to one
// column never overwrites the next.
func to32(slab *[]float32, xs []float64) []float32 {
	n := len(xs)
	out := (*slab)[:n:n]
	*slab = (*slab)[n:]
	for i, x := range xs {
		out[i] = float32(x)
	}
	return out
}
