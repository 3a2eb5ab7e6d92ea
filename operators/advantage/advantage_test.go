package advantage_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/schemas"
)

func traj(id string, turns int) *schemas.Rewarded {
	r := &schemas.Rewarded{Trajectory: schemas.Trajectory{
		RecordID: id, GroupID: "g", GroupSize: 1, Status: schemas.StatusCompleted, End: schemas.EndTerminated,
	}}
	for i := range turns {
		r.Turns = append(r.Turns, schemas.Turn{Index: int32(i), ActionIDs: make([]int32, 5), Value: float32(math.NaN())})
	}
	return r
}

func comp(name, scope string, turn int32, v float64) schemas.RewardComponent {
	return schemas.RewardComponent{TrajectoryID: "t", Name: name, Version: "1", Scope: scope, Turn: turn, Value: v, Weight: 1, Raw: v}
}

func TestTurnRewards(t *testing.T) {
	span := func(turn, start, end int32, v float64) schemas.RewardComponent {
		c := comp("span", schemas.ScopeSpan, turn, v)
		c.SpanStart, c.SpanEnd = start, end
		return c
	}
	withErr := comp("judge", schemas.ScopeTrajectory, -1, 0)
	withErr.Error = "judge timed out"
	other := comp("success", schemas.ScopeTrajectory, -1, 1)
	other.TrajectoryID = "someone-else"
	tests := []struct {
		name    string
		turns   int
		comps   []schemas.RewardComponent
		want    []float64
		wantErr error
		errHas  string
	}{
		{name: "no components", turns: 3, want: []float64{0, 0, 0}},
		{name: "trajectory on last turn", turns: 3, comps: []schemas.RewardComponent{comp("success", schemas.ScopeTrajectory, -1, 1)}, want: []float64{0, 0, 1}},
		{name: "trajectory ignores its turn field", turns: 2, comps: []schemas.RewardComponent{comp("success", schemas.ScopeTrajectory, 0, 1)}, want: []float64{0, 1}},
		{name: "turn scope", turns: 3, comps: []schemas.RewardComponent{comp("tool_cost", schemas.ScopeTurn, 1, -0.5)}, want: []float64{0, -0.5, 0}},
		{name: "span scope adds to its turn", turns: 2, comps: []schemas.RewardComponent{span(0, 1, 3, 0.25), span(0, 0, 5, 0.5)}, want: []float64{0.75, 0}},
		{name: "components sum", turns: 2, comps: []schemas.RewardComponent{
			comp("success", schemas.ScopeTrajectory, -1, 1), comp("latency_cost", schemas.ScopeTrajectory, -1, -0.25),
			comp("invalid_action_cost", schemas.ScopeTurn, 1, -0.5), comp("progress", schemas.ScopeTurn, 0, 0.125),
		}, want: []float64{0.125, 0.25}},
		{name: "single turn", turns: 1, comps: []schemas.RewardComponent{comp("success", schemas.ScopeTrajectory, -1, 1), comp("c", schemas.ScopeTurn, 0, 2)}, want: []float64{3}},
		{name: "unavailable component", turns: 2, comps: []schemas.RewardComponent{comp("success", schemas.ScopeTrajectory, -1, 1), withErr}, wantErr: advantage.ErrUnavailable, errHas: "judge"},
		{name: "turn index too large", turns: 2, comps: []schemas.RewardComponent{comp("c", schemas.ScopeTurn, 2, 1)}, wantErr: advantage.ErrInvalid, errHas: "turn 2 of 2"},
		{name: "negative turn index", turns: 2, comps: []schemas.RewardComponent{comp("c", schemas.ScopeTurn, -1, 1)}, wantErr: advantage.ErrInvalid, errHas: "turn -1"},
		{name: "span turn out of range", turns: 1, comps: []schemas.RewardComponent{span(3, 0, 1, 1)}, wantErr: advantage.ErrInvalid, errHas: "turn 3"},
		{name: "span beyond action tokens", turns: 1, comps: []schemas.RewardComponent{span(0, 2, 6, 1)}, wantErr: advantage.ErrInvalid, errHas: "span"},
		{name: "span reversed", turns: 1, comps: []schemas.RewardComponent{span(0, 3, 2, 1)}, wantErr: advantage.ErrInvalid, errHas: "span"},
		{name: "unknown scope", turns: 1, comps: []schemas.RewardComponent{comp("c", "episode", 0, 1)}, wantErr: advantage.ErrInvalid, errHas: "scope"},
		{name: "NaN value", turns: 1, comps: []schemas.RewardComponent{comp("c", schemas.ScopeTurn, 0, math.NaN())}, wantErr: advantage.ErrInvalid, errHas: "non-finite"},
		{name: "infinite value", turns: 1, comps: []schemas.RewardComponent{comp("c", schemas.ScopeTrajectory, -1, math.Inf(-1))}, wantErr: advantage.ErrInvalid, errHas: "non-finite"},
		{name: "component of another trajectory", turns: 1, comps: []schemas.RewardComponent{other}, wantErr: advantage.ErrInvalid, errHas: "someone-else"},
		{name: "no turns", turns: 0, comps: []schemas.RewardComponent{comp("success", schemas.ScopeTrajectory, -1, 1)}, wantErr: advantage.ErrInvalid, errHas: "no turns"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := traj("t", tc.turns)
			r.Rewards = tc.comps
			got, err := advantage.TurnRewards(r)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), tc.errHas) {
					t.Fatalf("err = %v, want %v mentioning %q", err, tc.wantErr, tc.errHas)
				}
				if got != nil {
					t.Fatalf("got rewards %v with an error", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestTurnRewardsTurnIndexMismatch(t *testing.T) {
	r := traj("t", 3)
	r.Turns[1].Index = 2
	if _, err := advantage.TurnRewards(r); !errors.Is(err, advantage.ErrInvalid) {
		t.Fatalf("err = %v, want ErrInvalid", err)
	}
}

func TestRewardToGo(t *testing.T) {
	tests := []struct {
		name             string
		r                []float64
		gamma, bootstrap float64
		want             []float64
	}{
		{"empty", nil, 0.5, 3, []float64{}},
		{"gamma 1 sums", []float64{1, 2, 3}, 1, 0, []float64{6, 5, 3}},
		{"gamma 0.5", []float64{1, 0, 0, 1}, 0.5, 0, []float64{1.125, 0.25, 0.5, 1}},
		{"bootstrap", []float64{0, 1}, 0.5, 4, []float64{1.5, 3}},
		{"gamma 0 is the reward", []float64{1, 2}, 0, 9, []float64{1, 2}},
	}
	for _, tc := range tests {
		if got := advantage.RewardToGo(tc.r, tc.gamma, tc.bootstrap); !slices.Equal(got, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestGAEAdvantages(t *testing.T) {
	r := []float64{0.5, -1, 2, 0.25}
	v := []float64{0.3, 0.1, -0.7, 1.5}
	const gamma, boot = 0.9, 0.8
	// lambda = 1: A_t = G_t - V_t (Monte Carlo advantage), targets = G_t.
	adv, ret := advantage.GAEAdvantages(r, v, boot, gamma, 1)
	g := advantage.RewardToGo(r, gamma, boot)
	for i := range r {
		if math.Abs(adv[i]-(g[i]-v[i])) > 1e-12 || math.Abs(ret[i]-g[i]) > 1e-12 {
			t.Errorf("lambda=1 turn %d: adv %v ret %v, want %v %v", i, adv[i], ret[i], g[i]-v[i], g[i])
		}
	}
	// lambda = 0: A_t = delta_t (one-step TD residual).
	adv, ret = advantage.GAEAdvantages(r, v, boot, gamma, 0)
	for i := range r {
		next := boot
		if i+1 < len(v) {
			next = v[i+1]
		}
		delta := r[i] + gamma*next - v[i]
		if math.Abs(adv[i]-delta) > 1e-12 || math.Abs(ret[i]-(delta+v[i])) > 1e-12 {
			t.Errorf("lambda=0 turn %d: adv %v, want %v", i, adv[i], delta)
		}
	}
	defer func() {
		if recover() == nil {
			t.Error("GAEAdvantages with mismatched lengths did not panic")
		}
	}()
	advantage.GAEAdvantages(r, v[:2], 0, 1, 1)
}

func TestGroupEstimators(t *testing.T) {
	rs := []float64{3, -1, 0.5, 7, 2}
	loo := advantage.RLOOAdvantages(rs, nil)
	grpo := advantage.GRPOAdvantages(rs, nil, false, advantage.StdPopulation, 0)
	n := float64(len(rs))
	sum := 0.0
	for i := range rs {
		sum += loo[i]
		// RLOO = n/(n-1) * (R - mean) = n/(n-1) * GRPO-without-std.
		if math.Abs(loo[i]-n/(n-1)*grpo[i]) > 1e-12 {
			t.Errorf("member %d: RLOO %v, GRPO %v", i, loo[i], grpo[i])
		}
	}
	if math.Abs(sum) > 1e-12 {
		t.Errorf("RLOO advantages sum to %v", sum)
	}
	// Normalized GRPO has population std 1 when epsilon is 0.
	norm := advantage.GRPOAdvantages(rs, nil, true, advantage.StdPopulation, 0)
	if s := advantage.Stats(norm, nil, advantage.StdPopulation); math.Abs(s.Std-1) > 1e-12 || math.Abs(s.Mean) > 1e-12 {
		t.Errorf("normalized GRPO stats %+v", s)
	}
	if s := advantage.Stats(advantage.GRPOAdvantages(rs, nil, true, advantage.StdSample, 0), nil, advantage.StdSample); math.Abs(s.Std-1) > 1e-12 {
		t.Errorf("sample-normalized GRPO sample std %v", s.Std)
	}
	// Degenerate groups.
	if got := advantage.RLOOAdvantages([]float64{5}, nil); !slices.Equal(got, []float64{0}) {
		t.Errorf("RLOO single member: %v", got)
	}
	eq := []float64{0.1, 0.1, 0.1}
	if got := advantage.GRPOAdvantages(eq, nil, true, advantage.StdSample, 0); !slices.Equal(got, []float64{0, 0, 0}) {
		t.Errorf("GRPO equal returns: %v", got)
	}
	if got := advantage.RLOOAdvantages(eq, nil); !slices.Equal(got, []float64{0, 0, 0}) {
		t.Errorf("RLOO equal returns: %v", got)
	}
	if s := advantage.Stats([]float64{4}, nil, advantage.StdSample); s.Std != 0 || !s.ZeroVar || s.Mean != 4 {
		t.Errorf("single-return stats %+v", s)
	}
}

// ReturnBound by hand, the interval rule of Stats, and a real spread far
// below any reward scale that must still count: zero variance absorbs
// rounding only.
func TestZeroVarianceWithinRounding(t *testing.T) {
	u := 0x1p-53
	r := traj("t", 2)
	r.Rewards = []schemas.RewardComponent{comp("step", schemas.ScopeTurn, 0, 0.1), comp("step", schemas.ScopeTurn, 1, 0.2)}
	// K = 2 components, T = 2 turns: m = 2K + 3T = 10; M = 0.1 + 0.2 + |boot|.
	for _, tt := range []struct{ boot, want float64 }{
		{0, 10 * u / (1 - 10*u) * (0.1 + 0.2)},
		{-1.5, 10 * u / (1 - 10*u) * (0.1 + 0.2 + 1.5)},
	} {
		if got := advantage.ReturnBound(r, tt.boot); math.Abs(got-tt.want) > 1e-12*tt.want {
			t.Errorf("ReturnBound with bootstrap %v = %v, want %v", tt.boot, got, tt.want)
		}
	}
	e := 0.25    // exact in binary: the touching case is exact
	tenth := 0.1 // a variable: 0.1 + 0.2 of constants is exact
	for _, tt := range []struct {
		name     string
		returns  []float64
		bounds   []float64
		zeroVar  bool
		min, max float64
	}{
		{"exact without bounds", []float64{0.1, 0.1}, nil, true, 0.1, 0.1},
		{"rounding residue without bounds", []float64{tenth + 0.2, 0.3}, nil, false, 0.3, tenth + 0.2},
		{"intervals touch", []float64{1, 1 + 2*e}, []float64{e, e}, true, 1, 1 + 2*e},
		// Neighbours overlap pairwise along a chain, the ends do not:
		// [1-e, 1+e] and [1+3e, 1+5e] share no point.
		{"chain of overlaps", []float64{1, 1 + 2*e, 1 + 4*e}, []float64{e, e, e}, false, 1, 1 + 4*e},
		{"one wide bound", []float64{1, 1 + 4*e, 1 + 2*e}, []float64{4 * e, 0, 2 * e}, true, 1, 1 + 4*e},
	} {
		s := advantage.Stats(tt.returns, tt.bounds, advantage.StdPopulation)
		if s.ZeroVar != tt.zeroVar || s.Min != tt.min || s.Max != tt.max || (s.ZeroVar && s.Std != 0) {
			t.Errorf("%s: stats %+v, want zero_var %v min %v max %v", tt.name, s, tt.zeroVar, tt.min, tt.max)
		}
	}
	// Returns 0.3 and 0.3 + 1e-12: bounds of 1.7e-16 each, a spread of
	// 1e-12 is a (tiny) signal: standardized to -1 and +1 (population std
	// 5e-13, epsilon 0).
	opts := advantage.Options{Estimator: advantage.GRPO, NormalizeStd: true, StdMode: advantage.StdPopulation,
		Gamma: 1, ZeroVariance: advantage.ZeroVarDrop, MinGroupSize: 2}
	var members []schemas.Rewarded
	for k, v := range []float64{0.3, 0.3 + 1e-12} {
		m := traj(fmt.Sprintf("m%d", k), 1)
		m.GroupSize, m.Member = 2, int32(k)
		m.Rewards = []schemas.RewardComponent{comp("success", schemas.ScopeTrajectory, -1, v)}
		m.Rewards[0].TrajectoryID = m.RecordID
		members = append(members, *m)
	}
	out, err := advantage.ScoreGroup(opts, members)
	if err != nil {
		t.Fatal(err)
	}
	if out[0].Group.ZeroVar || out[0].Group.Filtered != "" {
		t.Fatalf("a spread of 1e-12 read as zero variance: %+v", out[0].Group)
	}
	if a0, a1 := out[0].TurnAdvantages[0], out[1].TurnAdvantages[0]; math.Abs(float64(a0)+1) > 1e-3 || math.Abs(float64(a1)-1) > 1e-3 {
		t.Errorf("advantages %v, %v, want -1, +1", a0, a1)
	}
}

// ScoreGroup names the group once, whichever layer found the problem: a
// caller must not add "group g: " again.
func TestScoreGroupErrorMessages(t *testing.T) {
	member := func(id string, k int32) schemas.Rewarded {
		r := traj(id, 1)
		r.GroupSize, r.Member = 2, k
		r.Rewards = []schemas.RewardComponent{comp("success", schemas.ScopeTrajectory, -1, 1)}
		r.Rewards[0].TrajectoryID = id
		return *r
	}
	grpo := advantage.Options{Estimator: advantage.GRPO, NormalizeStd: true, StdMode: advantage.StdSample,
		Epsilon: 1e-6, Gamma: 1, ZeroVariance: advantage.ZeroVarKeep, MinGroupSize: 1}
	gae := grpo
	gae.Estimator, gae.Lambda = advantage.GAE, 0.95
	for _, tc := range []struct {
		name    string
		opts    advantage.Options
		members func() []schemas.Rewarded
		want    string
	}{
		{"unavailable reward", grpo, func() []schemas.Rewarded {
			a, b := member("a", 0), member("b", 1)
			b.Rewards[0].Name, b.Rewards[0].Error = "judge", "judge timed out"
			return []schemas.Rewarded{a, b}
		}, "group g: advantage: reward component unavailable: trajectory b: component judge (version 1): judge timed out"},
		{"no critic", gae, func() []schemas.Rewarded { return []schemas.Rewarded{member("a", 0), member("b", 1)} },
			"group g: advantage: value prediction missing: trajectory a turn 0 has value NaN (GAE needs a critic)"},
		{"member twice", grpo, func() []schemas.Rewarded { return []schemas.Rewarded{member("a", 0), member("b", 0)} },
			"advantage: invalid input: group g: member 0 appears twice (a, b)"},
	} {
		_, err := advantage.ScoreGroup(tc.opts, tc.members())
		if err == nil || err.Error() != tc.want {
			t.Errorf("%s:\n got  %v\n want %s", tc.name, err, tc.want)
		}
	}
}

func TestOptionsValidate(t *testing.T) {
	good := advantage.Options{Estimator: advantage.GRPO, NormalizeStd: true, StdMode: advantage.StdSample, Epsilon: 1e-6,
		Gamma: 1, Lambda: 0.95, ZeroVariance: advantage.ZeroVarKeep, MinGroupSize: 2, BootstrapReasons: []string{"max_turns"}}
	tests := []struct {
		name  string
		edit  func(*advantage.Options)
		field string // "" means valid
	}{
		{"valid", func(*advantage.Options) {}, ""},
		{"rloo without std mode", func(o *advantage.Options) { o.Estimator = advantage.RLOO; o.StdMode = "" }, ""},
		{"gae", func(o *advantage.Options) { o.Estimator = advantage.GAE; o.MinGroupSize = 1 }, ""},
		{"zero value", func(o *advantage.Options) { *o = advantage.Options{} }, "Estimator"},
		{"unknown estimator", func(o *advantage.Options) { o.Estimator = "ppo" }, "Estimator"},
		{"grpo without std mode", func(o *advantage.Options) { o.StdMode = "" }, "StdMode"},
		{"bad std mode", func(o *advantage.Options) { o.StdMode = "unbiased" }, "StdMode"},
		{"negative epsilon", func(o *advantage.Options) { o.Epsilon = -1 }, "Epsilon"},
		{"NaN epsilon", func(o *advantage.Options) { o.Epsilon = math.NaN() }, "Epsilon"},
		{"gamma above 1", func(o *advantage.Options) { o.Gamma = 1.01 }, "Gamma"},
		{"NaN gamma", func(o *advantage.Options) { o.Gamma = math.NaN() }, "Gamma"},
		{"negative lambda", func(o *advantage.Options) { o.Lambda = -0.1 }, "Lambda"},
		{"no zero variance policy", func(o *advantage.Options) { o.ZeroVariance = "" }, "ZeroVariance"},
		{"penalize failed with grpo", func(o *advantage.Options) { o.ZeroVariance = advantage.ZeroVarPenalizeFailed }, ""},
		{"penalize failed with rloo", func(o *advantage.Options) {
			o.Estimator, o.ZeroVariance = advantage.RLOO, advantage.ZeroVarPenalizeFailed
		}, ""},
		{"penalize failed with gae", func(o *advantage.Options) {
			o.Estimator, o.MinGroupSize, o.ZeroVariance = advantage.GAE, 1, advantage.ZeroVarPenalizeFailed
		}, "ZeroVariance"},
		{"min group size 0", func(o *advantage.Options) { o.MinGroupSize = 0 }, "MinGroupSize"},
		{"rloo min group size 1", func(o *advantage.Options) { o.Estimator = advantage.RLOO; o.MinGroupSize = 1 }, "MinGroupSize"},
		{"empty bootstrap reason", func(o *advantage.Options) { o.BootstrapReasons = []string{""} }, "BootstrapReasons"},
		{"duplicate bootstrap reason", func(o *advantage.Options) { o.BootstrapReasons = []string{"a", "a"} }, "BootstrapReasons"},
	}
	for _, tc := range tests {
		o := good
		tc.edit(&o)
		err := o.Validate()
		if tc.field == "" {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			continue
		}
		if !errors.Is(err, advantage.ErrOptions) || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: err = %v, want ErrOptions naming %s", tc.name, err, tc.field)
		}
	}
}

func TestBootstrap(t *testing.T) {
	o := advantage.Options{BootstrapReasons: []string{"max_turns", "token_budget"}}
	tests := []struct {
		end, reason string
		value       float32
		want        float64
		wantErr     error
	}{
		{schemas.EndTerminated, "answer", 3, 0, nil},
		{schemas.EndTerminated, "max_turns", 3, 0, nil},
		{schemas.EndTruncated, "max_turns", 3, 3, nil},
		{schemas.EndTruncated, "token_budget", -1.5, -1.5, nil},
		{schemas.EndTruncated, "timeout", 3, 0, nil},
		{schemas.EndTruncated, "max_turns", float32(math.NaN()), 0, advantage.ErrNoCritic},
		{schemas.EndTruncated, "timeout", float32(math.NaN()), 0, nil},
		{"", "", 0, 0, advantage.ErrInvalid},
	}
	for _, tc := range tests {
		tr := &schemas.Trajectory{RecordID: "t", End: tc.end, EndReason: tc.reason, BootstrapValue: tc.value}
		got, err := advantage.Bootstrap(o, tr)
		if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) || got != tc.want {
			t.Errorf("%s/%s/%v: got %v, %v; want %v, %v", tc.end, tc.reason, tc.value, got, err, tc.want, tc.wantErr)
		}
	}
}

// randomGroup builds a group of n members with random turn counts, rewards
// and critic values, all from the seeded generator.
func randomGroup(rng *rand.Rand, groupID string, n int, turnsMax int) []schemas.Rewarded {
	out := make([]schemas.Rewarded, n)
	for m := range n {
		turns := 1 + rng.IntN(turnsMax)
		r := schemas.Rewarded{Trajectory: schemas.Trajectory{
			RecordID: fmt.Sprintf("%s-m%d", groupID, m), GroupID: groupID, GroupSize: int32(n), Member: int32(m),
			Status: schemas.StatusCompleted, End: schemas.EndTerminated, EndReason: "answer",
		}}
		if rng.IntN(3) == 0 {
			r.End, r.EndReason, r.BootstrapValue = schemas.EndTruncated, "max_turns", float32(rng.NormFloat64())
		}
		for i := range turns {
			r.Turns = append(r.Turns, schemas.Turn{Index: int32(i), ActionIDs: make([]int32, 3), Value: float32(rng.NormFloat64())})
			if rng.IntN(2) == 0 {
				r.Rewards = append(r.Rewards, schemas.RewardComponent{TrajectoryID: r.RecordID, Name: "tool_cost", Scope: schemas.ScopeTurn, Turn: int32(i), Value: -0.01 * float64(rng.IntN(5))})
			}
		}
		r.Rewards = append(r.Rewards, schemas.RewardComponent{TrajectoryID: r.RecordID, Name: "success", Scope: schemas.ScopeTrajectory, Turn: -1, Value: float64(rng.IntN(2))})
		out[m] = r
	}
	return out
}

func allEstimators() map[string]advantage.Options {
	return map[string]advantage.Options{
		"grpo": {Estimator: advantage.GRPO, NormalizeStd: true, StdMode: advantage.StdSample, Epsilon: 1e-6, Gamma: 0.99, ZeroVariance: advantage.ZeroVarKeep, MinGroupSize: 2, BootstrapReasons: []string{"max_turns"}},
		"rloo": {Estimator: advantage.RLOO, Gamma: 1, ZeroVariance: advantage.ZeroVarDrop, MinGroupSize: 2},
		"gae":  {Estimator: advantage.GAE, Gamma: 0.99, Lambda: 0.95, ZeroVariance: advantage.ZeroVarKeep, MinGroupSize: 1, BootstrapReasons: []string{"max_turns"}},
	}
}

// TestScoreGroupOrderIndependent: every permutation of the input gives
// identical output, sorted by member.
func TestScoreGroupOrderIndependent(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	for name, opts := range allEstimators() {
		for trial := range 20 {
			members := randomGroup(rng, fmt.Sprintf("g%d", trial), 2+rng.IntN(7), 6)
			want, err := advantage.ScoreGroup(opts, members)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			for i, s := range want {
				if s.Member != int32(i) || len(s.TurnAdvantages) != len(s.Turns) || len(s.TurnValueTargets) != len(s.Turns) {
					t.Fatalf("%s: output %d is member %d with %d advantages for %d turns", name, i, s.Member, len(s.TurnAdvantages), len(s.Turns))
				}
			}
			for range 5 {
				shuffled := slices.Clone(members)
				rng.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
				got, err := advantage.ScoreGroup(opts, shuffled)
				if err != nil {
					t.Fatal(err)
				}
				if !reflect.DeepEqual(got, want) {
					t.Fatalf("%s trial %d: output depends on member order", name, trial)
				}
			}
		}
	}
}

func TestScoreGroupErrors(t *testing.T) {
	opts := allEstimators()["grpo"]
	gae := allEstimators()["gae"]
	base := func() []schemas.Rewarded { return randomGroup(rand.New(rand.NewPCG(1, 2)), "g", 4, 3) }
	tests := []struct {
		name    string
		opts    advantage.Options
		edit    func([]schemas.Rewarded) []schemas.Rewarded
		wantErr error
	}{
		{"bad options", advantage.Options{}, nil, advantage.ErrOptions},
		{"empty", opts, func([]schemas.Rewarded) []schemas.Rewarded { return nil }, advantage.ErrInvalid},
		{"infra member", opts, func(m []schemas.Rewarded) []schemas.Rewarded { m[2].Status = schemas.StatusInfra; return m }, advantage.ErrInfra},
		{"unknown status", opts, func(m []schemas.Rewarded) []schemas.Rewarded { m[2].Status = "lost"; return m }, advantage.ErrInvalid},
		{"mixed groups", opts, func(m []schemas.Rewarded) []schemas.Rewarded { m[1].GroupID = "h"; return m }, advantage.ErrInvalid},
		{"mixed group sizes", opts, func(m []schemas.Rewarded) []schemas.Rewarded { m[3].GroupSize = 5; return m }, advantage.ErrInvalid},
		{"member out of range", opts, func(m []schemas.Rewarded) []schemas.Rewarded { m[3].Member = 4; return m }, advantage.ErrInvalid},
		{"duplicate member", opts, func(m []schemas.Rewarded) []schemas.Rewarded { m[3].Member = 1; return m }, advantage.ErrInvalid},
		{"duplicate record", opts, func(m []schemas.Rewarded) []schemas.Rewarded { m[3].RecordID = m[0].RecordID; return m }, advantage.ErrInvalid},
		{"unknown end", opts, func(m []schemas.Rewarded) []schemas.Rewarded { m[0].End = ""; return m }, advantage.ErrInvalid},
		{"unavailable reward", opts, func(m []schemas.Rewarded) []schemas.Rewarded { m[1].Rewards[0].Error = "validator crashed"; return m }, advantage.ErrUnavailable},
		{"gae without critic", gae, func(m []schemas.Rewarded) []schemas.Rewarded { m[2].Turns[0].Value = float32(math.NaN()); return m }, advantage.ErrNoCritic},
		{"declared bootstrap without critic", opts, func(m []schemas.Rewarded) []schemas.Rewarded {
			m[0].End, m[0].EndReason, m[0].BootstrapValue = schemas.EndTruncated, "max_turns", float32(math.NaN())
			return m
		}, advantage.ErrNoCritic},
		{"overflows float32", opts, func(m []schemas.Rewarded) []schemas.Rewarded { m[1].Rewards[0].Value = 1e300; return m }, advantage.ErrInvalid},
	}
	for _, tc := range tests {
		m := base()
		if tc.edit != nil {
			m = tc.edit(m)
		}
		got, err := advantage.ScoreGroup(tc.opts, m)
		if !errors.Is(err, tc.wantErr) || got != nil {
			t.Errorf("%s: got %d records, err %v; want %v", tc.name, len(got), err, tc.wantErr)
		}
	}
	// Without a critic GRPO and RLOO still work: NaN values are never read.
	m := base()
	for i := range m {
		for j := range m[i].Turns {
			m[i].Turns[j].Value = float32(math.NaN())
		}
	}
	if _, err := advantage.ScoreGroup(opts, m); err != nil {
		t.Errorf("GRPO with NaN critic values: %v", err)
	}
}

func TestScoreGroupBroadcastAndStats(t *testing.T) {
	opts := allEstimators()["grpo"]
	members := randomGroup(rand.New(rand.NewPCG(3, 4)), "g", 6, 5)
	members[0].Rewards = append(members[0].Rewards, schemas.RewardComponent{TrajectoryID: members[0].RecordID, Name: "bonus", Scope: schemas.ScopeTrajectory, Turn: -1, Value: 5})
	out, err := advantage.ScoreGroup(opts, members)
	if err != nil {
		t.Fatal(err)
	}
	var rets []float64
	for _, s := range out {
		rets = append(rets, float64(s.TurnReturns[0]))
		for _, a := range s.TurnAdvantages {
			if a != s.TurnAdvantages[0] {
				t.Errorf("member %d: advantages %v not broadcast", s.Member, s.TurnAdvantages)
			}
		}
		if !slices.Equal(s.TurnValueTargets, s.TurnReturns) {
			t.Errorf("member %d: GRPO value targets %v, returns %v", s.Member, s.TurnValueTargets, s.TurnReturns)
		}
	}
	// Stats are of the un-normalized returns (recorded before normalization).
	st := out[0].Group
	mean := 0.0
	for _, r := range rets {
		mean += r
	}
	mean /= float64(len(rets))
	if math.Abs(st.Mean-mean) > 1e-5 {
		t.Errorf("group mean %v, want %v", st.Mean, mean)
	}
	if math.Abs(st.Max-slices.Max(rets)) > 1e-5 || math.Abs(st.Min-slices.Min(rets)) > 1e-5 || st.Size != 6 || st.Expected != 6 || st.Incomplete {
		t.Errorf("group stats %+v for returns %v", st, rets)
	}
}

// TestFailedAdvantages checks the closed forms FailedAdvantages documents,
// by hand: n failed members (return 0) and one more at return 1.
func TestFailedAdvantages(t *testing.T) {
	grpo := func(normalize bool, std string) advantage.Options {
		return advantage.Options{Estimator: advantage.GRPO, NormalizeStd: normalize, StdMode: std}
	}
	tests := []struct {
		name string
		opts advantage.Options
		n    int
		want float64
	}{
		// [0 0 0 0 1]: mean 0.2, population std 0.4 -> -0.2/0.4.
		{"grpo population", grpo(true, advantage.StdPopulation), 4, -0.5},
		// [0 0 0 1]: mean 0.25, sample std sqrt(0.75/3) = 0.5 -> -0.25/0.5.
		{"grpo sample", grpo(true, advantage.StdSample), 3, -0.5},
		// [0 0 0 0 1]: 0 - mean 0.2.
		{"grpo unnormalized", grpo(false, advantage.StdSample), 4, -0.2},
		// [0 0 0 0 0 0 0 0 0 1], population: mean 0.1, std 0.3 -> -1/3 = -1/sqrt(9).
		{"grpo population nine", grpo(true, advantage.StdPopulation), 9, -1.0 / 3},
		// Each member's others: [0 0 1], mean 1/3.
		{"rloo", advantage.Options{Estimator: advantage.RLOO}, 3, -1.0 / 3},
	}
	for _, tc := range tests {
		got := advantage.FailedAdvantages(tc.opts, make([]float64, tc.n), nil)
		if len(got) != tc.n {
			t.Fatalf("%s: %d advantages, want %d", tc.name, len(got), tc.n)
		}
		for i, a := range got {
			if math.Abs(a-tc.want) > 1e-15 {
				t.Errorf("%s: advantage %d = %v, want %v", tc.name, i, a, tc.want)
			}
		}
	}
}
