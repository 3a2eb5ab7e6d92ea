package eval_test

import (
	"context"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/evaluation"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/eval"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// fixture is the evaluation plane of run "r" (the default contract, one
// attempt per task), its topics, a release store and the initial model.
func fixture(t *testing.T) (*evaluation.Plane, pipeline.Topics, *pipeline.DirReleases, *model.Model) {
	t.Helper()
	c := contract.Default()
	c.RunID = "r"
	reg, err := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	if err != nil {
		t.Fatal(err)
	}
	plane, err := operators.EvaluationPlane(c, reg, 1)
	if err != nil {
		t.Fatal(err)
	}
	topics, _ := pipeline.TopicsFor("r")
	files, err := pipeline.NewDirReleases(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	mc, seed := operators.ModelConfig(c)
	m, err := gpu.InitialModel(mc, seed)
	if err != nil {
		t.Fatal(err)
	}
	return plane, topics, files, m
}

// TestEvalStage (every suite on every 2nd release, 3 epochs): release 0
// runs every suite; release 1 only the KL, with its update's cost (100
// tokens x 3 epochs); release 2 every suite; release 3 the KL; release 4,
// a rollback's (its update names release 0), only the KL although 4 is a
// multiple of 2. A release replayed from the compacted topic, and one not
// ready, give nothing; a release whose checkpoint does not hash to its
// manifest stops the operator (an infrastructure error: redelivered, never
// skipped).
func TestEvalStage(t *testing.T) {
	plane, topics, files, m := fixture(t)
	var msgs []pipeline.Message
	publish := func(v int64, rolledBackTo *int64) schemas.PolicyRelease {
		rel, err := gpu.ReleaseModel(files, m, v, v, gpu.ReleaseMeta{})
		if err != nil {
			t.Fatal(err)
		}
		if v > 0 {
			u, _ := schemas.EncodeUpdate(schemas.UpdateRecord{Version: v, Metrics: schemas.UpdateMetrics{ObjectiveStats: schemas.ObjectiveStats{Tokens: 100 * v}}, StepSeconds: 2, RolledBackTo: rolledBackTo})
			if _, err := files.Write(gpu.UpdateName(v), u); err != nil {
				t.Fatal(err)
			}
		}
		return rel
	}
	add := func(rel schemas.PolicyRelease) {
		b, err := schemas.EncodeRelease(rel)
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, pipeline.Message{Ref: pipeline.Ref{Topic: topics.Policy, Offset: int64(len(msgs))}, Key: []byte("r"), Value: b})
	}
	zero := int64(0)
	r0, r1 := publish(0, nil), publish(1, nil)
	add(r0)
	add(r1)
	add(r0) // replayed
	notReady := publish(2, nil)
	notReady.Ready = false
	add(notReady)
	add(publish(2, nil))
	add(publish(3, nil))
	add(publish(4, &zero))
	st, err := eval.NewStage(eval.StageConfig{Plane: plane, Topics: topics, RunID: "r", Every: 2, Epochs: 3})
	if err != nil {
		t.Fatal(err)
	}
	d, err := pipeline.Drive(context.Background(), st, msgs, pipeline.DriveConfig{Env: pipeline.EnvConfig{Releases: files}})
	if err != nil {
		t.Fatal(err)
	}
	outs := d.On(topics.Evaluations)
	want := []struct {
		v         int64
		evaluated bool
		tokens    int64
	}{{0, true, 0}, {1, false, 300}, {2, true, 600}, {3, false, 900}, {4, false, 1200}}
	if len(outs) != len(want) {
		t.Fatalf("%d evaluation records, want %d", len(outs), len(want))
	}
	for i, w := range want {
		rec, err := schemas.DecodeEvaluation(outs[i].Value)
		if err != nil {
			t.Fatal(err)
		}
		if rec.PolicyVersion != w.v || (rec.Evaluation != nil) != w.evaluated || (len(rec.Suites) == 4) != w.evaluated || rec.OptimizerTokens != w.tokens {
			t.Fatalf("record %d: release %d evaluated %v (%d suites), %d optimizer tokens; want release %d evaluated %v, %d tokens",
				i, rec.PolicyVersion, rec.Evaluation != nil, len(rec.Suites), rec.OptimizerTokens, w.v, w.evaluated, w.tokens)
		}
		if w.v > 0 && (rec.KL.N == 0 || rec.StepSeconds != 2) {
			t.Fatalf("release %d: KL %+v, step %v s: want a measured KL and the update's 2 s", w.v, rec.KL, rec.StepSeconds)
		}
		if w.v == 4 && (rec.RolledBackTo == nil || *rec.RolledBackTo != 0) {
			t.Fatalf("release 4: rolled back to %v, want release 0", rec.RolledBackTo)
		}
	}

	bad := publish(5, nil)
	bad.CheckpointHash = "sha256:00"
	b, _ := schemas.EncodeRelease(bad)
	st, _ = eval.NewStage(eval.StageConfig{Plane: plane, Topics: topics, RunID: "r", Every: 2, Epochs: 3})
	_, err = pipeline.Drive(context.Background(), st, []pipeline.Message{{Ref: pipeline.Ref{Topic: topics.Policy}, Value: b}},
		pipeline.DriveConfig{Env: pipeline.EnvConfig{Releases: files}})
	if err == nil {
		t.Fatal("a release whose checkpoint does not match its hash was measured")
	}
}

// TestEvalFinal: once told the run is trained (RunTrained), the stage's
// next Tick evaluates its last release with every suite in a record
// marked Final, after that release's KL record; never before RunTrained,
// never twice, and not at all when the last release had every suite (its
// ruling is the final one). A restarted stage reads back what it measured
// and writes the final record once.
func TestEvalFinal(t *testing.T) {
	plane, topics, files, m := fixture(t)
	var msgs []pipeline.Message
	for v := int64(0); v <= 3; v++ {
		rel, err := gpu.ReleaseModel(files, m, v, v, gpu.ReleaseMeta{})
		if err != nil {
			t.Fatal(err)
		}
		if v > 0 {
			u, _ := schemas.EncodeUpdate(schemas.UpdateRecord{Version: v})
			if _, err := files.Write(gpu.UpdateName(v), u); err != nil {
				t.Fatal(err)
			}
		}
		b, _ := schemas.EncodeRelease(rel)
		msgs = append(msgs, pipeline.Message{Ref: pipeline.Ref{Topic: topics.Policy, Offset: v}, Key: []byte("r"), Value: b})
	}
	decode := func(outs []pipeline.Output) []schemas.EvaluationRecord {
		var recs []schemas.EvaluationRecord
		for _, o := range outs {
			rec, err := schemas.DecodeEvaluation(o.Value)
			if err != nil {
				t.Fatal(err)
			}
			recs = append(recs, rec)
		}
		return recs
	}
	tick := time.Unix(1700000000, 0)
	for _, tc := range []struct {
		name      string
		every     int64
		trained   bool
		wantFinal bool
	}{
		{"last release not an evaluation release", 2, true, true},
		{"not told the run is trained", 2, false, false},
		{"last release evaluated anyway", 3, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := eval.NewStage(eval.StageConfig{Plane: plane, Topics: topics, RunID: "r", Every: tc.every, Epochs: 1})
			if err != nil {
				t.Fatal(err)
			}
			if tc.trained {
				st.RunTrained()
			}
			d, err := pipeline.Drive(context.Background(), st, msgs, pipeline.DriveConfig{Env: pipeline.EnvConfig{Releases: files}, TickAt: tick})
			if err != nil {
				t.Fatal(err)
			}
			recs := decode(d.On(topics.Evaluations))
			if got, want := len(recs), 4+map[bool]int{true: 1}[tc.wantFinal]; got != want {
				t.Fatalf("%d records, want %d", got, want)
			}
			last := recs[len(recs)-1]
			if tc.wantFinal != last.Final {
				t.Fatalf("last record: release %d final %v, want final %v", last.PolicyVersion, last.Final, tc.wantFinal)
			}
			if tc.wantFinal && (last.PolicyVersion != 3 || last.Evaluation == nil || len(last.Suites) != 4 || last.KL.N == 0 || recs[3].Evaluation != nil) {
				t.Fatalf("final record of release %d: evaluation %v, %d suites, KL %+v; the KL record before it evaluated %v",
					last.PolicyVersion, last.Evaluation != nil, len(last.Suites), last.KL, recs[3].Evaluation != nil)
			}
			if r, err := st.Tick(context.Background(), tick); err != nil || len(r.Outputs) != 0 {
				t.Fatalf("a second tick: %d outputs, %v", len(r.Outputs), err)
			}
			// Restarted after its records were written: the stage reads
			// them back, measures nothing again, and writes the final
			// record only if none was written.
			again, _ := eval.NewStage(eval.StageConfig{Plane: plane, Topics: topics, RunID: "r", Every: tc.every, Epochs: 1})
			again.RunTrained()
			env := pipeline.EnvConfig{Releases: files, Scanner: pipeline.MemScanner{
				topics.Evaluations: d.Messages(topics.Evaluations), topics.Policy: msgs}}
			d2, err := pipeline.Drive(context.Background(), again, msgs, pipeline.DriveConfig{Env: env, TickAt: tick})
			if err != nil {
				t.Fatal(err)
			}
			if got := decode(d2.On(topics.Evaluations)); tc.trained && len(got) != 0 || !tc.trained && (len(got) != 1 || !got[0].Final) {
				t.Fatalf("restarted: %d records (%+v)", len(got), got)
			}
		})
	}
}
