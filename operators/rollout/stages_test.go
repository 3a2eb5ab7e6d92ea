package rollout_test

import (
	"context"
	"testing"

	"github.com/trajflow/trajflow/internal/faketok"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/operators/validate"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// TestEveryFamilyThroughTheStages: the dispatch planner, the validate
// checks and the reward registry take every family's records unchanged:
// the planner plans only train ids (the eval ids are on the denylist),
// every trajectory a teacher produces is valid under the contract's
// options, and the family's validator scores it 1.
func TestEveryFamilyThroughTheStages(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		artifact string
		pol      rollout.Policy
		vocab    int32
		episode  int
	}{
		{rollout.ArtifactKV, rollout.Teacher{}, rollout.VocabSize, 64},
		{rollout.ArtifactLedger, rollout.LedgerTeacher{}, rollout.VocabSize, 64},
		{rollout.ArtifactText, textTeacher{}, int32(faketok.VocabSize), 4096},
	} {
		reg, err := rollout.RegistryForArtifact(tc.artifact)
		if err != nil {
			t.Fatal(err)
		}
		c := contract.Default()
		c.Artifacts.Environment = tc.artifact
		c.Sampler.MaxTokensPerEpisode = tc.episode
		c.Sampler.MaxTokensPerAction = rollout.DefaultSettings(reg).MaxTokens
		val := rollout.NewValidator(reg)
		c.Rewards[0].Name = val.Name()
		if err := c.Resolve(); err != nil {
			t.Fatal(err)
		}
		d := operators.Deps{Contract: c, Tasks: reg, Evaluators: []reward.Evaluator{val}, EvalDenylist: reg.IsEval, VocabSize: tc.vocab}
		p, err := operators.Planner(d)
		if err != nil {
			t.Fatal(err)
		}
		var atts []schemas.TaskAttempt
		for _, g := range p.Plan(0) {
			atts = append(atts, p.Attempts(g, 0, 0)...)
		}
		for _, a := range atts {
			if a.Split != schemas.SplitTrain || reg.IsEval(a.TaskID) {
				t.Fatalf("%s: planned %s (%s)", tc.artifact, a.TaskID, a.Split)
			}
		}
		lim := operators.RolloutLimits(c)
		trajs, err := rollout.Agent{Env: reg, Policy: tc.pol, Tokenizer: &faketok.Tokenizer{}, Settings: rollout.DefaultSettings(reg), Limits: lim}.Run(ctx, atts)
		if err != nil {
			t.Fatal(err)
		}
		rr, err := operators.RewardRegistry(d)
		if err != nil {
			t.Fatal(err)
		}
		for i := range trajs {
			if v := validate.Check(&trajs[i], operators.ValidateOptions(d)); v.Class != validate.Valid {
				t.Fatalf("%s: %s: %+v", tc.artifact, trajs[i].TaskID, v)
			}
			r, err := reward.Score(ctx, &trajs[i], operators.RewardComponents(c), rr)
			if err != nil || r.RewardTotal != 1 {
				t.Fatalf("%s: %s: reward %v %v", tc.artifact, trajs[i].TaskID, r.RewardTotal, err)
			}
		}
		t.Logf("%s: %d attempts planned, valid and rewarded", tc.artifact, len(trajs))
	}
}
