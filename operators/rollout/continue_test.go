package rollout_test

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// continuedGroup runs one group of 16 attempts through the rollout stage
// with partial-rollout continuation: version 0 samples the first turn; the
// release of version 1 lands right after it (the latency model's wait
// after a generation is the update boundary), so every episode still
// alive continues with version 1. It returns the trajectories and both
// policies.
func continuedGroup(t *testing.T) ([]schemas.Trajectory, *model.Model, *model.Model, *rollout.Registry) {
	t.Helper()
	reg, err := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	if err != nil {
		t.Fatal(err)
	}
	m0, err := model.New(model.DefaultConfig(), 11)
	if err != nil {
		t.Fatal(err)
	}
	// The newer policy: the same model, moved.
	m1 := m0.Clone()
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range m1.Params {
		m1.Params[i] += float32(rng.NormFloat64() * 0.05)
	}
	p0, p1 := model.NewPolicy(m0, 0), model.NewPolicy(m1, 1)
	topics, _ := pipeline.TopicsFor("run")
	var st *rollout.Stage
	var once sync.Once
	st, err = rollout.NewStage(rollout.StageConfig{
		Registry: reg, Settings: rollout.DefaultSettings(reg), Limits: rollout.DefaultLimits(), Topics: topics, RunID: "run",
		Load: gpu.PolicyFromRelease, Continue: true,
		Latency: rollout.LatencyModel{TokenMedian: time.Millisecond, Seed: 1, Sleep: func(context.Context, time.Duration) error {
			once.Do(func() { st.Switch(p1) }) // the update boundary, after the first turn's generation
			return nil
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	st.Switch(p0)
	atts := rollout.Attempts("run", reg.Train()[3], 0, 16, 1, 0, "contract")
	out, err := stagekit.Encode(schemas.TaskAttempts, topics.Tasks, atts[0].GroupID, atts[0].GroupID, atts)
	if err != nil {
		t.Fatal(err)
	}
	d, err := pipeline.Drive(context.Background(), st, pipeline.AsMessages([]pipeline.Output{out}), pipeline.DriveConfig{QuarantineTopic: topics.Quarantine})
	if err != nil {
		t.Fatal(err)
	}
	msgs := d.On(topics.Trajectories)
	if len(msgs) != 1 {
		t.Fatalf("%d trajectories messages", len(msgs))
	}
	trajs, err := schemas.Trajectories.Decode(nil, msgs[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	return trajs, m0, m1, reg
}

// packAt scores the group (GRPO, zero-variance groups kept) and packs it
// for trainer version v under the multi-policy rule.
func packAt(t *testing.T, reg *rollout.Registry, trajs []schemas.Trajectory, v int64, rule string) (schemas.PackedBatch, pack.Closed, []pack.Result) {
	t.Helper()
	rwd, err := reward.NewRegistry(rollout.NewValidator(reg))
	if err != nil {
		t.Fatal(err)
	}
	comps := []reward.Component{{Name: rollout.EvalSuccess, Version: rollout.ValidatorVersion, Weight: 1}}
	var members []schemas.Rewarded
	for i := range trajs {
		r, err := reward.Score(context.Background(), &trajs[i], comps, rwd)
		if err != nil {
			t.Fatal(err)
		}
		members = append(members, r)
	}
	scored, err := advantage.ScoreGroup(advantage.Options{Estimator: advantage.GRPO, NormalizeStd: true, StdMode: advantage.StdPopulation,
		Epsilon: 1e-6, Gamma: 1, ZeroVariance: advantage.ZeroVarKeep, MinGroupSize: 1}, members)
	if err != nil {
		t.Fatal(err)
	}
	w, err := pack.NewWindow(pack.Options{TokenBudget: 256, BatchTokens: 1 << 30, Overflow: pack.OverflowReject, MaxLag: 1,
		StalePolicy: pack.StaleDrop, MultiPolicy: rule}, v)
	if err != nil {
		t.Fatal(err)
	}
	var res []pack.Result
	for _, s := range scored {
		r, err := w.Add(s)
		if err != nil {
			t.Fatal(err)
		}
		res = append(res, r)
	}
	b, closed := w.Close(0, "run", "contract", v)
	return b, closed, res
}

// TestPartialRolloutContinuation: an episode in flight at the update
// boundary continues with the newer policy, every turn keeping the
// version that sampled it (turn 0 version 0, later turns version 1). Under
// packing.multi_policy per_segment each segment trains with its own
// version's behavior log-probs: the packed old log-probs of version-0
// tokens are version 0's, of version-1 tokens version 1's, and the
// trainer at version 1 finds the per-segment ratio exactly 1 on the
// version-1 segment (lag 0) and not 1 on the version-0 segment (lag 1).
// new_segments trains only the version-1 turns (earlier turns context);
// discard filters every mixed trajectory as mixed_policy.
func TestPartialRolloutContinuation(t *testing.T) {
	trajs, m0, m1, reg := continuedGroup(t)
	mixed := 0
	for _, tr := range trajs {
		for k, turn := range tr.Turns {
			if want := int64(min(k, 1)); turn.PolicyVersion != want {
				t.Fatalf("%s turn %d sampled by version %d, want %d", tr.RecordID, k, turn.PolicyVersion, want)
			}
		}
		if len(tr.Turns) > 1 {
			mixed++
		}
	}
	if mixed == 0 {
		t.Fatal("no episode lived past the boundary")
	}

	batch, _, _ := packAt(t, reg, trajs, 1, pack.MultiPolicySegments)
	beh := rollout.DefaultSettings(reg).Behavior
	per := map[int32]int{}
	for _, row := range batch.Rows {
		lp0, err := m0.LogprobsForTraining(beh, row.InputIDs, row.PositionIDs, row.SegmentIDs)
		if err != nil {
			t.Fatal(err)
		}
		lp1, err := m1.LogprobsForTraining(beh, row.InputIDs, row.PositionIDs, row.SegmentIDs)
		if err != nil {
			t.Fatal(err)
		}
		for i, m := range row.ActionMask {
			if m == 0 {
				continue
			}
			want := map[int32][]float32{0: lp0, 1: lp1}[row.PolicyVersions[i]]
			if want == nil || row.OldLogprobs[i] != want[i] {
				t.Fatalf("token %d of version %d: old log-prob %v, its version's %v", i, row.PolicyVersions[i], row.OldLogprobs[i], want)
			}
			per[row.PolicyVersions[i]]++
		}
	}
	if per[0] == 0 || per[1] == 0 {
		t.Fatalf("trained tokens by version %v: want both", per)
	}
	tr, err := gpu.NewTrainer(m1, beh, 1)
	if err != nil {
		t.Fatal(err)
	}
	met, _, err := tr.Update(batch, gpu.DefaultObjective(), gpu.DefaultAdam(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(met.Lag) != 2 || met.Lag[0].Lag != 0 || met.Lag[1].Lag != 1 {
		t.Fatalf("lag strata %+v, want lags 0 and 1", met.Lag)
	}
	if l := met.Lag[0]; l.RatioMin != 1 || l.RatioMax != 1 || l.Tokens != int64(per[1]) {
		t.Fatalf("the version-1 segment (the trainer's): ratio [%v, %v] over %d tokens, want exactly 1 over %d", l.RatioMin, l.RatioMax, l.Tokens, per[1])
	}
	if l := met.Lag[1]; l.RatioMin == 1 && l.RatioMax == 1 || l.Tokens != int64(per[0]) {
		t.Fatalf("the version-0 segment: ratio [%v, %v] over %d tokens, want its own ratio (not 1) over %d", l.RatioMin, l.RatioMax, l.Tokens, per[0])
	}

	// new_segments: only the newest version's turns of a mixed trajectory
	// train; its earlier turns are context. Single-turn trajectories (one
	// version) train as they are.
	turns := map[string]int{}
	for _, tr := range trajs {
		turns[tr.RecordID] = len(tr.Turns)
	}
	newest, _, _ := packAt(t, reg, trajs, 1, pack.MultiPolicyNewest)
	byVersion := map[int32]int{}
	for _, row := range newest.Rows {
		for i, m := range row.ActionMask {
			if m == 0 {
				continue
			}
			byVersion[row.PolicyVersions[i]]++
			if id := row.SegTrajectoryIDs[row.SegmentIDs[i]]; turns[id] > 1 && row.PolicyVersions[i] != 1 {
				t.Fatalf("new_segments trained a version-%d token of mixed trajectory %s", row.PolicyVersions[i], id)
			}
		}
	}
	if byVersion[1] != per[1] || byVersion[0] >= per[0] {
		t.Fatalf("new_segments trained %v tokens by version, per_segment %v", byVersion, per)
	}
	// discard: every mixed trajectory filtered, counted by reason.
	_, _, res := packAt(t, reg, trajs, 1, pack.MultiPolicyDiscard)
	discarded := 0
	for _, r := range res {
		if r.Outcome == pack.Filtered && r.Filter == pack.FilterMixedPolicy {
			discarded++
		}
	}
	if discarded != mixed {
		t.Fatalf("discard filtered %d mixed_policy trajectories, want %d", discarded, mixed)
	}
}
