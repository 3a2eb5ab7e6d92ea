package rollout

import (
	"context"
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// policyAt is a random policy of seed 1 at version v.
func policyAt(t *testing.T, v int64) *model.Policy {
	m, err := model.New(model.Config{Vocab: VocabSize, Window: 12, Embed: 16, Hidden: 64}, 1)
	if err != nil {
		t.Fatal(err)
	}
	return model.NewPolicy(m, v)
}

func newTestStage(t *testing.T, reg *Registry) (*Stage, pipeline.Topics) {
	t.Helper()
	topics, _ := pipeline.TopicsFor("run")
	st, err := NewStage(StageConfig{
		Registry: reg, Settings: DefaultSettings(reg), Limits: fixedLimits(), Topics: topics, RunID: "run",
		Load:    func(schemas.PolicyRelease, []byte) (*model.Policy, error) { return nil, errors.New("unused") },
		Retries: 1, PolicyWait: 200 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	return st, topics
}

func tasksMessage(t *testing.T, topics pipeline.Topics, atts []schemas.TaskAttempt) pipeline.Message {
	t.Helper()
	out, err := stagekit.Encode(schemas.TaskAttempts, topics.Tasks, atts[0].GroupID, atts[0].GroupID, atts)
	if err != nil {
		t.Fatal(err)
	}
	return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Tasks}, Key: out.Key, Value: out.Value, Headers: out.Headers}
}

func censusKinds(t *testing.T, res pipeline.Result, topic string) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, o := range res.Outputs {
		if o.Topic == topic {
			ev, err := schemas.DecodeCensus(o.Value)
			if err != nil {
				t.Fatal(err)
			}
			out[ev.Kind]++
		}
	}
	return out
}

// TestStageRunsGroups: Process waits for the attempts' policy version,
// then emits the group's trajectories (the same as RunEpisodes on that
// version) in one message keyed by group id, with started and completed
// census events; a newer version serves new groups only.
func TestStageRunsGroups(t *testing.T) {
	reg := testRegistry(t)
	st, topics := newTestStage(t, reg)
	atts := Attempts("run", reg.Train()[0], 0, 4, 1, 3, "contract")
	msg := tasksMessage(t, topics, atts)
	ctx := context.Background()

	// No policy yet: Process waits, bounded.
	if _, err := st.Process(ctx, msg); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("without a policy: %v", err)
	}
	// An older version does not serve attempts of version 3.
	st.Switch(policyAt(t, 2))
	if _, err := st.Process(ctx, msg); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("with version 2: %v", err)
	}
	pol := randomPolicy(t, 1) // version 3
	go func() { time.Sleep(20 * time.Millisecond); st.Switch(pol) }()
	res, err := st.Process(ctx, msg)
	if err != nil {
		t.Fatal(err)
	}
	var trajs []schemas.Trajectory
	for _, o := range res.Outputs {
		if o.Topic == topics.Trajectories {
			if string(o.Key) != atts[0].GroupID || trajs != nil {
				t.Fatalf("trajectories message key %q", o.Key)
			}
			if trajs, err = schemas.Trajectories.Decode(nil, o.Value); err != nil {
				t.Fatal(err)
			}
		}
	}
	want, err := reg.RunEpisodes(ctx, pol, atts, DefaultSettings(reg), fixedLimits())
	if err != nil {
		t.Fatal(err)
	}
	if len(trajs) != len(want) {
		t.Fatalf("%d trajectories, want %d", len(trajs), len(want))
	}
	for i := range want {
		if !reflect.DeepEqual(trajs[i].Turns[0].ActionIDs, want[i].Turns[0].ActionIDs) || trajs[i].RecordID != atts[i].AttemptID || trajs[i].Turns[0].PolicyVersion != 3 {
			t.Fatalf("trajectory %d differs from RunEpisodes", i)
		}
	}
	if got := censusKinds(t, res, topics.Census); got[schemas.CensusStarted] != 4 || got[schemas.CensusCompleted] != 4 || len(got) != 2 {
		t.Fatalf("census %v", got)
	}
	// A newer version is taken by later groups.
	st.Switch(policyAt(t, 4))
	if st.Policy().Version() != 4 {
		t.Fatalf("version %d after switch", st.Policy().Version())
	}
	st.Switch(policyAt(t, 3)) // older: ignored
	if st.Policy().Version() != 4 {
		t.Fatal("switched back to an older version")
	}
}

// TestStageRefusals: hidden-eval attempts are refused with an incident;
// attempts that fail to run are retried with a new attempt number, counted
// as infrastructure failures, then quarantined.
func TestStageRefusals(t *testing.T) {
	reg := testRegistry(t)
	st, topics := newTestStage(t, reg)
	st.Switch(randomPolicy(t, 1))
	ctx := context.Background()

	eval := Attempts("run", reg.Eval()[0], 0, 2, 1, 0, "contract")
	_, err := st.Process(ctx, tasksMessage(t, topics, eval))
	ref, ok := pipeline.AsRefusal(err)
	if !ok || ref.Reason != "eval_task_id" || len(ref.Also) != 1 || ref.Also[0].Topic != topics.Incidents {
		t.Fatalf("eval attempt: %v", err)
	}

	bad := Attempts("run", reg.Train()[1], 0, 2, 1, 0, "contract")
	for i := range bad {
		bad[i].EnvVersion = "other-env" // the environment cannot reset it
	}
	_, err = st.Process(ctx, tasksMessage(t, topics, bad))
	ref, ok = pipeline.AsRefusal(err)
	if !ok || ref.Reason != "infra_exhausted" {
		t.Fatalf("failing group: %v", err)
	}
	ids := map[string]bool{}
	failed := 0
	for _, o := range ref.Also {
		ev, err := schemas.DecodeCensus(o.Value)
		if err != nil {
			t.Fatal(err)
		}
		if ev.Kind == schemas.CensusFailed {
			failed++
			if !ev.Infra {
				t.Fatal("failure not marked infrastructure")
			}
		}
		ids[ev.AttemptID] = true
	}
	retry := schemas.AttemptID("run", bad[0].TaskID, bad[0].GroupID, 0, 1)
	if failed != 4 || !ids[bad[0].AttemptID] || !ids[retry] {
		t.Fatalf("%d failures, ids %v", failed, ids)
	}
}

// BenchmarkStageGroup runs one demo-sized group (16 attempts) per
// iteration through the stage: episodes, trajectory encoding and census.
func BenchmarkStageGroup(b *testing.B) {
	reg := testRegistry(b)
	topics, _ := pipeline.TopicsFor("run")
	st, err := NewStage(StageConfig{
		Registry: reg, Settings: DefaultSettings(reg), Limits: DefaultLimits(), Topics: topics, RunID: "run",
		Load: func(schemas.PolicyRelease, []byte) (*model.Policy, error) { return nil, errors.New("unused") },
	})
	if err != nil {
		b.Fatal(err)
	}
	st.Switch(randomPolicy(b, 1))
	var msgs []pipeline.Message
	for i, task := range reg.Train()[:16] {
		atts := Attempts("run", task, int64(i), 16, 1, 3, "contract")
		out, err := stagekit.Encode(schemas.TaskAttempts, topics.Tasks, atts[0].GroupID, atts[0].GroupID, atts)
		if err != nil {
			b.Fatal(err)
		}
		msgs = append(msgs, pipeline.Message{Ref: pipeline.Ref{Topic: topics.Tasks}, Key: out.Key, Value: out.Value})
	}
	var tokens int64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		res, err := st.Process(context.Background(), msgs[i%len(msgs)])
		if err != nil {
			b.Fatal(err)
		}
		for _, o := range res.Outputs {
			if o.Topic == topics.Census {
				if ev, err := schemas.DecodeCensus(o.Value); err == nil && ev.Kind == schemas.CensusCompleted {
					tokens += ev.Tokens
				}
			}
		}
	}
	b.ReportMetric(float64(tokens)/b.Elapsed().Seconds(), "tokens/s")
	b.ReportMetric(float64(b.N*16)/b.Elapsed().Seconds(), "episodes/s")
}
