package evaluation_test

import (
	"context"
	"reflect"
	"testing"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/evaluation"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// demoSetup is the resolved demo contract and the demo's task registry.
func demoSetup(t *testing.T) (*contract.Contract, *rollout.Registry) {
	t.Helper()
	c := contract.Default()
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	reg, err := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	if err != nil {
		t.Fatal(err)
	}
	return c, reg
}

func newEvaluator(t *testing.T, samples int32) (*evaluation.Evaluator, *contract.Contract) {
	t.Helper()
	c, reg := demoSetup(t)
	ev, err := evaluation.New(evaluation.Config{Registry: reg, Settings: operators.RolloutSettings(c, reg),
		Limits: operators.RolloutLimits(c), Seed: c.Seed, Samples: samples})
	if err != nil {
		t.Fatal(err)
	}
	return ev, c
}

// TestFixedAttempts: every version is evaluated on the same attempt ids
// and environment seeds, and the same policy scores the same.
func TestFixedAttempts(t *testing.T) {
	ev, c := newEvaluator(t, 2)
	a, b := ev.Attempts(0), ev.Attempts(7)
	if len(a) != ev.Tasks()*2 || len(a) == 0 {
		t.Fatalf("%d attempts for %d tasks x 2", len(a), ev.Tasks())
	}
	for i := range a {
		if a[i].AttemptID != b[i].AttemptID || a[i].Seed != b[i].Seed || a[i].RunID != evaluation.RunID {
			t.Fatalf("attempt %d differs between versions: %+v vs %+v", i, a[i], b[i])
		}
		b[i].PolicyVersion = a[i].PolicyVersion
	}
	if !reflect.DeepEqual(a, b) {
		t.Fatal("attempts differ beyond the policy version")
	}
	mc, seed := operators.ModelConfig(c)
	m, err := gpu.InitialModel(mc, seed)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	s1, err := ev.Success(ctx, model.NewPolicy(m, 0))
	if err != nil {
		t.Fatal(err)
	}
	s2, err := ev.Success(ctx, model.NewPolicy(m, 0))
	if err != nil {
		t.Fatal(err)
	}
	if s1 != s2 || s1 < 0 || s1 > 1 {
		t.Fatalf("the same policy scored %v and %v", s1, s2)
	}
}

func TestConfigErrors(t *testing.T) {
	if _, err := evaluation.New(evaluation.Config{Samples: 1}); err == nil {
		t.Error("no registry accepted")
	}
	reg, err := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := evaluation.New(evaluation.Config{Registry: reg}); err == nil {
		t.Error("zero samples accepted")
	}
}
