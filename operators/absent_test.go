package operators_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// TestRefusedMembersCloseTheirGroup runs validate, reward and advantage
// in-process (no broker) over a group of 8 whose member 3 carries a NaN
// log-prob: validate quarantines it and declares it absent, reward carries
// the declaration on, and advantage closes the group of the 7 others when
// they arrive, without waiting for the partial-group timeout (no Tick
// runs). The same rows without the declaration stay held.
func TestRefusedMembersCloseTheirGroup(t *testing.T) {
	c := testkit.LoadContract(t, "../testdata/contracts/conformance.yaml")
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		t.Fatal(err)
	}
	s := (&testkit.Run{Contract: c, Topics: topics}).Synth(60, 200)
	s.FailedShare, s.InvalidShare, s.InfraShare, s.CorruptShare, s.UniformShare = 0, 0, 0, 0, 0
	deps := operators.Deps{Contract: c, Topics: topics, VocabSize: s.Vocab}
	stage := func(name string) pipeline.Stage {
		st, err := operators.New(name, deps)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	validate, reward, adv := stage("validate"), stage("reward"), stage("advantage")
	ctx := context.Background()
	only := func(res pipeline.Result, topic string) pipeline.Output {
		t.Helper()
		var found []pipeline.Output
		for _, o := range res.Outputs {
			if o.Topic == topic {
				found = append(found, o)
			}
		}
		if len(found) != 1 {
			t.Fatalf("%d outputs to %s, want 1 (all: %d)", len(found), topic, len(res.Outputs))
		}
		return found[0]
	}
	var offset int64
	next := func(o pipeline.Output) pipeline.Message {
		offset++
		return pipeline.Message{Ref: pipeline.Ref{Topic: o.Topic, Offset: offset}, Key: o.Key, Value: o.Value, Headers: o.Headers}
	}

	for _, declared := range []bool{true, false} {
		rows := s.Group(map[bool]int64{true: 1, false: 2}[declared])
		gid := rows[0].GroupID
		rows[3].Turns[0].ActionLogprobs[0] = float32(math.NaN())
		v, err := schemas.Trajectories.Encode(nil, rows)
		if err != nil {
			t.Fatal(err)
		}
		res, err := validate.Process(ctx, next(pipeline.Output{Topic: topics.Trajectories, Key: []byte(gid), Value: v}))
		if err != nil {
			t.Fatal(err)
		}
		only(res, topics.Quarantine)
		valid := only(res, topics.Valid)
		if got, want := string((&pipeline.Message{Headers: valid.Headers}).Header(schemas.HeaderAbsent)), fmt.Sprintf(`{%q:[3]}`, gid); got != want {
			t.Fatalf("validate declared %q, want %q", got, want)
		}
		if !declared {
			valid.Headers = valid.Headers[:len(valid.Headers)-1]
		}
		res, err = reward.Process(ctx, next(valid))
		if err != nil {
			t.Fatal(err)
		}
		rewarded := only(res, topics.Rewarded)
		a, err := stagekit.AbsentOf(&pipeline.Message{Headers: rewarded.Headers})
		if err != nil || (len(a) == 1) != declared || (declared && len(a[gid]) != 1) {
			t.Fatalf("reward passed on %v (%v), declared %v", a, err, declared)
		}
		in := next(rewarded)
		res, err = adv.Process(ctx, in)
		if err != nil {
			t.Fatal(err)
		}
		if !declared {
			if len(res.Outputs) != 0 || !res.Hold || len(res.Release) != 0 {
				t.Fatalf("undeclared partial group: outputs %d hold %v release %v, want held", len(res.Outputs), res.Hold, res.Release)
			}
			continue
		}
		scored := only(res, topics.Scored)
		got, err := schemas.ScoredTrajectories.Decode(nil, scored.Value)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 7 {
			t.Fatalf("scored %d members, want the 7 present", len(got))
		}
		for _, r := range got {
			if r.Member == 3 {
				t.Fatal("the refused member was scored")
			}
		}
		if len(res.Release) != 1 || res.Release[0] != in.Ref {
			t.Fatalf("released %v, want %v", res.Release, in.Ref)
		}
	}
}
