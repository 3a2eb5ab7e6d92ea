package advantage_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

func groupOf(group string, rewards ...float64) []schemas.Rewarded {
	out := make([]schemas.Rewarded, len(rewards))
	for i, v := range rewards {
		r := traj(fmt.Sprintf("%s-%d", group, i), 1)
		r.GroupID, r.GroupSize, r.Member = group, int32(len(rewards)), int32(i)
		r.Rewards = []schemas.RewardComponent{{TrajectoryID: r.RecordID, Name: "success", Version: "1", Scope: schemas.ScopeTrajectory, Turn: -1, Raw: v, Weight: 1, Value: v}}
		r.RewardTotal = v
		out[i] = *r
	}
	return out
}

// TestStageHoldsScoresAndQuarantines: members are held until their group
// completes, then scored and released together; a group whose returns
// overflow float32 is quarantined member by member (infrastructure) and
// its inputs released — the stage goes on rather than stopping.
func TestStageHoldsScoresAndQuarantines(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	st, err := advantage.NewStage(advantage.StageConfig{Topics: topics, Options: advantage.Options{
		Estimator: advantage.GRPO, NormalizeStd: true, StdMode: advantage.StdSample, Epsilon: 1e-6,
		Gamma: 1, Lambda: 1, ZeroVariance: advantage.ZeroVarKeep, MinGroupSize: 2,
	}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	msg := func(off int64, rows ...schemas.Rewarded) pipeline.Message {
		b, err := schemas.RewardedTrajectories.Encode(nil, rows)
		if err != nil {
			t.Fatal(err)
		}
		return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Rewarded, Offset: off}, Key: []byte(rows[0].GroupID), Value: b}
	}
	topicsOf := func(res pipeline.Result) map[string]int {
		n := map[string]int{}
		for _, o := range res.Outputs {
			n[o.Topic]++
		}
		return n
	}
	g := groupOf("g1", 1, 0)
	res, err := st.Process(ctx, msg(0, g[0]))
	if err != nil || !res.Hold || len(res.Outputs) != 0 {
		t.Fatalf("first member: %+v %v", res, err)
	}
	res, err = st.Process(ctx, msg(1, g[1]))
	if err != nil || topicsOf(res)[topics.Scored] != 1 || len(res.Release) != 2 {
		t.Fatalf("group complete: outputs %v releases %v err %v", topicsOf(res), res.Release, err)
	}
	// A redelivered member of the emitted group is not held again.
	res, err = st.Process(ctx, msg(2, g[0]))
	if err != nil || res.Hold || len(res.Outputs) != 0 {
		t.Fatalf("redelivered member: %+v %v", res, err)
	}
	huge := groupOf("g2", math.MaxFloat64/4, -math.MaxFloat64/4)
	res, err = st.Process(ctx, msg(3, huge...))
	if err != nil {
		t.Fatalf("unscorable group stopped the stage: %v", err)
	}
	n := topicsOf(res)
	if n[topics.Quarantine] != 2 || n[topics.Census] != 2 || n[topics.Scored] != 0 || len(res.Release) != 1 {
		t.Fatalf("unscorable group: outputs %v releases %v", n, res.Release)
	}
}

// TestStageKeepsMessageHeldForItsOpenGroup: one message carries a member
// that completes group g1 and the first member of g2; g1's emission must
// not release the message, which g2 still needs.
func TestStageKeepsMessageHeldForItsOpenGroup(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	st, err := advantage.NewStage(advantage.StageConfig{Topics: topics, Options: advantage.Options{
		Estimator: advantage.GRPO, NormalizeStd: true, StdMode: advantage.StdSample, Epsilon: 1e-6,
		Gamma: 1, Lambda: 1, ZeroVariance: advantage.ZeroVarKeep, MinGroupSize: 2,
	}})
	if err != nil {
		t.Fatal(err)
	}
	enc := func(off int64, rows ...schemas.Rewarded) pipeline.Message {
		b, err := schemas.RewardedTrajectories.Encode(nil, rows)
		if err != nil {
			t.Fatal(err)
		}
		return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Rewarded, Offset: off}, Value: b}
	}
	g1, g2 := groupOf("g1", 1, 0), groupOf("g2", 0, 1)
	ctx := context.Background()
	if _, err := st.Process(ctx, enc(0, g1[0])); err != nil {
		t.Fatal(err)
	}
	res, err := st.Process(ctx, enc(1, g1[1], g2[0]))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res.Release {
		if r.Offset == 1 {
			t.Fatalf("message 1 released while g2 still holds it: %v", res.Release)
		}
	}
	if !res.Hold || len(res.Release) != 1 {
		t.Fatalf("hold=%v release=%v, want held and only message 0 released", res.Hold, res.Release)
	}
	res, err = st.Process(ctx, enc(2, g2[1]))
	if err != nil || len(res.Release) != 2 {
		t.Fatalf("g2 complete: release=%v err=%v, want messages 1 and 2", res.Release, err)
	}
}

// TestStageRefusesConflictingDuplicate: a member delivered again with the
// same record id and other content goes to quarantine
// (conflicting_duplicate) and the first delivery stands; an identical
// redelivery is absorbed.
func TestStageRefusesConflictingDuplicate(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	st, err := advantage.NewStage(advantage.StageConfig{Topics: topics, Options: advantage.Options{
		Estimator: advantage.GRPO, NormalizeStd: true, StdMode: advantage.StdSample, Epsilon: 1e-6,
		Gamma: 1, Lambda: 1, ZeroVariance: advantage.ZeroVarKeep, MinGroupSize: 3,
	}})
	if err != nil {
		t.Fatal(err)
	}
	msg := func(off int64, rows ...schemas.Rewarded) pipeline.Message {
		b, err := schemas.RewardedTrajectories.Encode(nil, rows)
		if err != nil {
			t.Fatal(err)
		}
		return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Rewarded, Offset: off}, Key: []byte(rows[0].GroupID), Value: b}
	}
	g := groupOf("g1", 1, 0, 1)
	conflict := g[0]
	conflict.RewardTotal = 7
	conflict.Rewards = []schemas.RewardComponent{{TrajectoryID: conflict.RecordID, Name: "success", Version: "1", Scope: schemas.ScopeTrajectory, Turn: -1, Raw: 7, Weight: 1, Value: 7}}
	d, err := pipeline.Drive(context.Background(), st, []pipeline.Message{msg(0, g[0]), msg(1, g[0]), msg(2, conflict), msg(3, g[1], g[2])},
		pipeline.DriveConfig{QuarantineTopic: topics.Quarantine})
	if err != nil {
		t.Fatal(err)
	}
	q := d.On(topics.Quarantine)
	if len(q) != 1 {
		t.Fatalf("%d quarantine records, want the conflicting one", len(q))
	}
	for _, h := range q[0].Headers {
		if h.Key == schemas.HeaderReason && string(h.Value) != "conflicting_duplicate" {
			t.Fatalf("reason %s", h.Value)
		}
	}
	sc := d.On(topics.Scored)
	if len(sc) != 1 {
		t.Fatalf("%d scored groups, want 1", len(sc))
	}
	rows, err := schemas.ScoredTrajectories.Decode(nil, sc[0].Value)
	if err != nil || len(rows) != 3 || rows[0].RewardTotal != 1 {
		t.Fatalf("scored %d rows, first reward %v (%v): the first delivery must stand", len(rows), rows[0].RewardTotal, err)
	}
}
