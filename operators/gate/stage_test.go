package gate

import (
	"context"
	"testing"

	"github.com/trajflow/trajflow/internal/gate"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// evaluation is an evaluation record of release v: every metric the demo
// contract names, verified success v (interval [lo, hi] over 64) and
// held-out success eval; nil metrics for a release that is not evaluated.
func evaluation(t *testing.T, topics pipeline.Topics, off, v int64, evaluated bool, succ, lo, hi, heldout float64) pipeline.Message {
	t.Helper()
	rec := schemas.EvaluationRecord{RunID: "r", PolicyVersion: v, KL: schemas.Estimate{Value: 0.1, Lo: 0.05, Hi: 0.15, N: 100},
		OptimizerTokens: 1000, StepSeconds: 36, At: 1}
	if evaluated {
		rec.Evaluation = &schemas.GateEvaluation{Version: v, Metrics: map[string]schemas.Estimate{
			"verified_success_rate": {Value: succ, Lo: lo, Hi: hi, N: 64},
			"eval_success_rate":     {Value: heldout, Lo: heldout, Hi: heldout, N: 64},
			"unsafe_action_rate":    {N: 64},
			"p95_turns":             {Value: 3, Lo: 3, Hi: 3, N: 64},
		}}
	}
	b, err := schemas.EncodeEvaluation(rec)
	if err != nil {
		t.Fatal(err)
	}
	return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Evaluations, Offset: off}, Key: []byte("r"), Value: b}
}

func census(t *testing.T, topics pipeline.Topics, part int, off int64, id string, tokens int64) pipeline.Message {
	t.Helper()
	b, err := schemas.EncodeCensus(schemas.CensusEvent{RunID: "r", EventID: id, AttemptID: id, Kind: schemas.CensusCompleted,
		Tokens: tokens, LatencyUS: 3_600_000_000})
	if err != nil {
		t.Fatal(err)
	}
	return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Census, Partition: part, Offset: off}, Key: []byte(id), Value: b}
}

func policy() gate.Policy {
	c := contract.Default()
	c.RunID = "r"
	c.StopRules = []contract.StopRule{{Kind: contract.StopNoValidationGain, N: 2}, {Kind: contract.StopBudgetExhausted}}
	c.Objective.Constraints = map[string]float64{"unsafe_action_rate": 0, "p95_turns": 4}
	c.Objective.RegressionFloors = map[string]contract.Floor{"eval_success_rate": {Value: 0.95, Relative: true}}
	c.Budgets = contract.Budgets{RolloutTokens: 1e9, OptimizerTokens: 1e9, EnvironmentHours: 100, AcceleratorHours: 100}
	return gate.PolicyOf(c)
}

func decisions(t *testing.T, d *pipeline.Driven, topics pipeline.Topics) []schemas.GateDecision {
	t.Helper()
	var out []schemas.GateDecision
	for _, o := range d.On(topics.Decisions) {
		dd, err := schemas.DecodeGateDecision(o.Value)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, dd)
	}
	return out
}

// TestGateStage: the baseline, a release that is not evaluated, a
// promotion (its interval's lower bound 0.30 clears the initial 0.10), a
// regression floor broken (held-out 0.05 < 0.95 x 0.20) rolling back to
// the promoted release, and the second evaluation without a gain
// stopping the run; the restored release after the stop is ignored. The
// census counts toward the budgets (two completed episodes: 30 rollout
// tokens, 2 environment hours) and is held until the next decision.
func TestGateStage(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	st, err := NewStage(StageConfig{Policy: policy(), Topics: topics, RunID: "r"})
	if err != nil {
		t.Fatal(err)
	}
	msgs := []pipeline.Message{
		evaluation(t, topics, 0, 0, true, 0.10, 0.05, 0.2, 0.20),
		census(t, topics, 0, 0, "a1", 10),
		census(t, topics, 1, 0, "a2", 20),
		census(t, topics, 1, 1, "a2", 20), // a copy: counted once
		evaluation(t, topics, 1, 1, false, 0, 0, 0, 0),
		evaluation(t, topics, 2, 2, true, 0.40, 0.30, 0.5, 0.25),
		evaluation(t, topics, 2, 2, true, 0.40, 0.30, 0.5, 0.25), // redelivered: ruled on already
		evaluation(t, topics, 3, 3, true, 0.50, 0.45, 0.6, 0.05),
		evaluation(t, topics, 4, 4, true, 0.41, 0.35, 0.5, 0.25),
		evaluation(t, topics, 5, 5, false, 0, 0, 0, 0),
		census(t, topics, 0, 1, "a3", 5), // after the stop: not held for a decision that never comes
	}
	d, err := pipeline.Drive(context.Background(), st, msgs, pipeline.DriveConfig{Env: pipeline.EnvConfig{Scanner: pipeline.MemScanner{}}})
	if err != nil {
		t.Fatal(err)
	}
	got := decisions(t, d, topics)
	want := []struct {
		v      int64
		action string
	}{{0, gate.Continue}, {1, gate.Continue}, {2, gate.Promote}, {3, gate.Rollback}, {4, gate.Stop}}
	if len(got) != len(want) {
		t.Fatalf("%d decisions %+v, want %d", len(got), got, len(want))
	}
	for i, w := range want {
		if got[i].PolicyVersion != w.v || got[i].Action != w.action || got[i].Resume == nil {
			t.Fatalf("decision %d: release %d %s (%s), want release %d %s with its state", i, got[i].PolicyVersion, got[i].Action, got[i].Reason, w.v, w.action)
		}
	}
	if got[3].RollbackTo != 2 || got[4].StopRule != "no_validation_gain_for_2_evals" || got[4].Promoted != 2 {
		t.Fatalf("rollback to %d, stop %q promoted %d: want rollback to 2, stop by no_validation_gain_for_2_evals with release 2 promoted",
			got[3].RollbackTo, got[4].StopRule, got[4].Promoted)
	}
	u := got[1].Resume.Usage
	if u.RolloutTokens != 30 || u.EnvironmentHours != 2 || u.OptimizerTokens != 1000 || u.AcceleratorHours != 0.01 {
		t.Fatalf("usage after release 1 %+v: want 30 rollout tokens, 2 environment hours, 1000 optimizer tokens, 0.01 accelerator hours", u)
	}
	if len(d.Held) != 0 || len(d.Released) != 2 {
		t.Fatalf("held %v, released %v: want the 2 counted census events released with the decision on release 1", d.Held, d.Released)
	}

	// A restarted gate resumes from its last decision on the decisions
	// topic: release 4's stop. Nothing more is decided.
	scan := pipeline.MemScanner{topics.Decisions: d.Messages(topics.Decisions)}
	st2, _ := NewStage(StageConfig{Policy: policy(), Topics: topics, RunID: "r"})
	d2, err := pipeline.Drive(context.Background(), st2, msgs[5:10], pipeline.DriveConfig{Env: pipeline.EnvConfig{Scanner: scan}})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(d2.On(topics.Decisions)); n != 0 || !st2.st.Stopped || st2.last != 4 {
		t.Fatalf("restarted gate: %d decisions, stopped %v at %d; want none, stopped at release 4", n, st2.st.Stopped, st2.last)
	}

	// Resumed after release 2's promotion, it rules on release 3 as the
	// first life did.
	scan = pipeline.MemScanner{topics.Decisions: d.Messages(topics.Decisions)[:3]}
	st3, _ := NewStage(StageConfig{Policy: policy(), Topics: topics, RunID: "r"})
	d3, err := pipeline.Drive(context.Background(), st3, msgs[6:8], pipeline.DriveConfig{Env: pipeline.EnvConfig{Scanner: scan}})
	if err != nil {
		t.Fatal(err)
	}
	if g := decisions(t, d3, topics); len(g) != 1 || g[0].PolicyVersion != 3 || g[0].Action != gate.Rollback || g[0].Reason != got[3].Reason {
		t.Fatalf("resumed gate decided %+v, want release 3 rolled back as %q", g, got[3].Reason)
	}
}

// TestGateStageRefuses: a first evaluation that is not release 0's
// baseline stops the operator; an undecodable record and one of another
// run go to quarantine.
func TestGateStageRefuses(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	st, _ := NewStage(StageConfig{Policy: policy(), Topics: topics, RunID: "r"})
	_, err := pipeline.Drive(context.Background(), st, []pipeline.Message{evaluation(t, topics, 0, 3, true, 0.1, 0.1, 0.1, 0.1)},
		pipeline.DriveConfig{Env: pipeline.EnvConfig{Scanner: pipeline.MemScanner{}}})
	if err == nil {
		t.Fatal("a first evaluation of release 3 was accepted as the baseline")
	}
	other, _ := schemas.EncodeEvaluation(schemas.EvaluationRecord{RunID: "x", PolicyVersion: 0})
	st, _ = NewStage(StageConfig{Policy: policy(), Topics: topics, RunID: "r"})
	d, err := pipeline.Drive(context.Background(), st, []pipeline.Message{
		{Ref: pipeline.Ref{Topic: topics.Evaluations}, Value: []byte("{not json")},
		{Ref: pipeline.Ref{Topic: topics.Evaluations, Offset: 1}, Value: other},
	}, pipeline.DriveConfig{QuarantineTopic: topics.Quarantine, Env: pipeline.EnvConfig{Scanner: pipeline.MemScanner{}}})
	if err != nil || d.Quarantined != 2 {
		t.Fatalf("quarantined %d (%v), want both records", d.Quarantined, err)
	}
}

// TestGateStageFinal: the final evaluation of the release last ruled on
// by its KL (release 2) is ruled on once more, on the evaluation alone
// (its KL and update counted by the first ruling): a promotion, marked
// Final, under an id of its own. A redelivered final record, and a final
// record of an older release, are ignored; a restarted gate resumes after
// the final ruling and decides nothing more.
func TestGateStageFinal(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	st, err := NewStage(StageConfig{Policy: policy(), Topics: topics, RunID: "r"})
	if err != nil {
		t.Fatal(err)
	}
	final := func(off, v int64) pipeline.Message {
		m := evaluation(t, topics, off, v, true, 0.40, 0.30, 0.5, 0.25)
		rec, _ := schemas.DecodeEvaluation(m.Value)
		rec.Final = true
		m.Value, _ = schemas.EncodeEvaluation(rec)
		return m
	}
	msgs := []pipeline.Message{
		evaluation(t, topics, 0, 0, true, 0.10, 0.05, 0.2, 0.20),
		evaluation(t, topics, 1, 1, false, 0, 0, 0, 0),
		evaluation(t, topics, 2, 2, false, 0, 0, 0, 0),
		final(3, 1), // older than the last ruling
		final(4, 2),
		final(5, 2), // redelivered
	}
	d, err := pipeline.Drive(context.Background(), st, msgs, pipeline.DriveConfig{Env: pipeline.EnvConfig{Scanner: pipeline.MemScanner{}}})
	if err != nil {
		t.Fatal(err)
	}
	got := decisions(t, d, topics)
	if len(got) != 4 {
		t.Fatalf("%d decisions %+v, want 4", len(got), got)
	}
	f := got[3]
	if f.PolicyVersion != 2 || !f.Final || f.Action != gate.Promote || f.Promoted != 2 || !f.Evaluated || got[2].Final {
		t.Fatalf("final ruling %+v (the ruling before it final %v): want release 2 promoted, final", f, got[2].Final)
	}
	if u := f.Resume.Usage; u.OptimizerTokens != 2000 {
		t.Fatalf("usage after the final ruling %+v: want the two updates' 2000 optimizer tokens, counted once", u)
	}
	outs := d.On(topics.Decisions)
	if string(outs[3].Headers[2].Value) == string(outs[2].Headers[2].Value) {
		t.Fatalf("the final ruling has the id of the ruling before it")
	}
	scan := pipeline.MemScanner{topics.Decisions: d.Messages(topics.Decisions)}
	st2, _ := NewStage(StageConfig{Policy: policy(), Topics: topics, RunID: "r"})
	d2, err := pipeline.Drive(context.Background(), st2, msgs[4:], pipeline.DriveConfig{Env: pipeline.EnvConfig{Scanner: scan}})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(d2.On(topics.Decisions)); n != 0 || !st2.final {
		t.Fatalf("restarted gate: %d decisions, final %v; want none, resumed after the final ruling", n, st2.final)
	}
}
