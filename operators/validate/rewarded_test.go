package validate

import (
	"math"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/schemas"
)

// validRewarded returns a rewarded trajectory with a trajectory-scoped, a
// turn-scoped and a span-scoped component that passes CheckRewarded under
// testRewardOptions.
func validRewarded() *schemas.Rewarded {
	t := validTrajectory()
	r := &schemas.Rewarded{Trajectory: *t}
	r.Rewards = []schemas.RewardComponent{
		{TrajectoryID: t.RecordID, Name: "success", Version: "1", Raw: 1, Weight: 1, Transform: "identity", Value: 1,
			Scope: schemas.ScopeTrajectory, Turn: -1, EvaluatorVersion: "1"},
		{TrajectoryID: t.RecordID, Name: "invalid_action", Version: "1", Raw: 1, Weight: 0.5, Transform: "negate", Value: -0.5,
			Scope: schemas.ScopeTurn, Turn: 1, EvaluatorVersion: "1"},
		{TrajectoryID: t.RecordID, Name: "process", Version: "2", Raw: 0.25, Weight: 1, Transform: "identity", Value: 0.25,
			Scope: schemas.ScopeSpan, Turn: 1, SpanStart: 1, SpanEnd: 3, EvaluatorVersion: "judge-7", Uncertainty: 0.1},
	}
	r.RewardTotal = 0.75
	return r
}

func testRewardOptions() RewardOptions {
	return RewardOptions{
		Required: []string{"success"},
		Ranges:   map[string]Range{"success": {Min: 0, Max: 1}, "process": {Min: -1, Max: 1}},
	}
}

type rewardCase struct {
	name   string
	mutate func(r *schemas.Rewarded, o *RewardOptions)
	reason string
	detail string
}

var rewardCases = []rewardCase{
	{"valid", func(*schemas.Rewarded, *RewardOptions) {}, "", ""},
	{"valid zero options", func(_ *schemas.Rewarded, o *RewardOptions) { *o = RewardOptions{} }, "", ""},
	{"valid failure reward", func(r *schemas.Rewarded, _ *RewardOptions) {
		// A failed task is a valid training episode (docs/PIPELINE.md §9).
		r.Rewards[0].Raw, r.Rewards[0].Value, r.RewardTotal = 0, 0, -0.25
	}, "", ""},
	{"valid same name other turn", func(r *schemas.Rewarded, _ *RewardOptions) {
		c := r.Rewards[1]
		c.Turn = 2
		r.Rewards = append(r.Rewards, c)
		r.RewardTotal -= 0.5
	}, "", ""},
	{"valid total rounding", func(r *schemas.Rewarded, _ *RewardOptions) { r.RewardTotal += 1e-12 }, "", ""},

	{"evaluator error", func(r *schemas.Rewarded, _ *RewardOptions) {
		r.Rewards[2].Error, r.Rewards[2].Value = "judge timeout", 0
		r.RewardTotal = 0.5
	}, ReasonRewardUnavailable, "component 2 process@2: judge timeout"},
	{"required missing", func(r *schemas.Rewarded, _ *RewardOptions) {
		r.Rewards = r.Rewards[1:]
		r.RewardTotal = -0.25
	}, ReasonRewardUnavailable, `required component "success"`},
	{"no name", func(r *schemas.Rewarded, o *RewardOptions) { r.Rewards[1].Name = "" }, ReasonRewardMetadata, "component 1 has no name"},
	{"no version", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[2].Version = "" }, ReasonRewardMetadata, "process has no version"},
	{"other trajectory", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[0].TrajectoryID = "x" }, ReasonRewardMetadata, `trajectory "x"`},
	{"unknown scope", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[0].Scope = "episode" }, ReasonRewardScope, `scope "episode"`},
	{"scope other than declared", func(r *schemas.Rewarded, o *RewardOptions) {
		o.Scopes = map[string]string{r.Rewards[0].Name: schemas.ScopeTurn}
	}, ReasonRewardScope, `the contract declares "turn"`},
	{"declared scope kept", func(r *schemas.Rewarded, o *RewardOptions) {
		o.Scopes = map[string]string{r.Rewards[0].Name: r.Rewards[0].Scope}
	}, "", ""},
	{"trajectory scope with turn", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[0].Turn = 0 }, ReasonRewardScope, "want -1"},
	{"turn out of range", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[1].Turn = 3 }, ReasonRewardScope, "turn 3 of 3"},
	{"turn negative", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[1].Turn = -1 }, ReasonRewardScope, "turn -1"},
	{"span past action", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[2].SpanEnd = 4 }, ReasonRewardScope, "span [1,4) of turn 1 with 3 action tokens"},
	{"span empty", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[2].SpanStart = 3 }, ReasonRewardScope, "span [3,3)"},
	{"duplicate component", func(r *schemas.Rewarded, _ *RewardOptions) {
		r.Rewards = append(r.Rewards, r.Rewards[0])
		r.RewardTotal += 1
	}, ReasonDuplicateReward, "components 0 and 3"},
	{"raw nan", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[2].Raw = math.NaN() }, ReasonNonFiniteReward, "raw is NaN"},
	{"weight inf", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[1].Weight = math.Inf(1) }, ReasonNonFiniteReward, "weight is +Inf"},
	{"value nan", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[0].Value = math.NaN() }, ReasonNonFiniteReward, "value is NaN"},
	{"uncertainty inf", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[2].Uncertainty = math.Inf(1) }, ReasonNonFiniteReward, "uncertainty"},
	{"total nan", func(r *schemas.Rewarded, _ *RewardOptions) { r.RewardTotal = math.NaN() }, ReasonNonFiniteReward, "reward total"},
	{"raw above range", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[0].Raw = 2 }, ReasonRewardOutOfRange, "raw 2 outside [0, 1]"},
	{"raw below range", func(r *schemas.Rewarded, _ *RewardOptions) { r.Rewards[2].Raw = -1.5 }, ReasonRewardOutOfRange, "process"},
	{"total mismatch", func(r *schemas.Rewarded, _ *RewardOptions) { r.RewardTotal = 1.75 }, ReasonRewardTotalMismatch, "reward total 1.75, components sum to 0.75"},
}

func TestCheckRewarded(t *testing.T) {
	for _, tc := range rewardCases {
		t.Run(tc.name, func(t *testing.T) {
			r, o := validRewarded(), testRewardOptions()
			tc.mutate(r, &o)
			got := CheckRewarded(r, o)
			if got.Reason != tc.reason {
				t.Fatalf("CheckRewarded = %v, want reason %q", got, tc.reason)
			}
			if got.Class != ClassOf(tc.reason) {
				t.Fatalf("class %q, want %q", got.Class, ClassOf(tc.reason))
			}
			if !strings.Contains(got.Detail, tc.detail) {
				t.Fatalf("detail %q does not contain %q", got.Detail, tc.detail)
			}
		})
	}
}
