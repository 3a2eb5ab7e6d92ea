package evaluation_test

import (
	"context"
	"reflect"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/evaluation"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline/contract"
)

func newPlane(t *testing.T, samples int32) (*evaluation.Plane, *contract.Contract) {
	t.Helper()
	c, reg := demoSetup(t)
	led, err := rollout.NewFamilyRegistry(rollout.FamilyLedger)
	if err != nil {
		t.Fatal(err)
	}
	mc, seed := operators.ModelConfig(c)
	ref, err := gpu.InitialModel(mc, seed)
	if err != nil {
		t.Fatal(err)
	}
	p, err := evaluation.NewPlane(evaluation.PlaneConfig{Registry: reg, Regression: led, Settings: operators.RolloutSettings(c, reg),
		Limits: operators.RolloutLimits(c), Seed: c.Seed, Samples: samples, ValidationTasks: 32, Resamples: 200, Reference: ref})
	if err != nil {
		t.Fatal(err)
	}
	return p, c
}

// TestPlaneSuites: the four suites run on frozen attempts (the same for
// every version), every metric the plane names is measured with an
// interval that holds its point estimate, and the same policy measures
// the same.
func TestPlaneSuites(t *testing.T) {
	p, c := newPlane(t, 2)
	mc, seed := operators.ModelConfig(c)
	m, err := gpu.InitialModel(mc, seed)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	a, err := p.Evaluate(ctx, model.NewPolicy(m, 0))
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Evaluate(ctx, model.NewPolicy(m, 7))
	if err != nil {
		t.Fatal(err)
	}
	if b.Version != 7 || b.Evaluation.Version != 7 {
		t.Fatalf("report of version %d / %d", b.Version, b.Evaluation.Version)
	}
	b.Version, b.Evaluation.Version = 0, 0
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("the same weights at another version measured differently:\n%+v\n%+v", a.Evaluation, b.Evaluation)
	}
	want := map[string]struct {
		family string
		tasks  int
	}{
		evaluation.SuiteValidation: {"kv", 32}, evaluation.SuiteHeldout: {"kv", 64},
		evaluation.SuiteRegression: {"ledger", len(mustLedger(t).Eval())}, evaluation.SuiteSafety: {"kv", 64},
	}
	hashes := map[string]bool{}
	for _, s := range a.Suites {
		w, ok := want[s.Suite]
		if !ok || s.Family != w.family || s.Tasks != w.tasks || s.Attempts != 2*w.tasks {
			t.Errorf("suite %s: family %s, %d tasks, %d attempts; want %+v x 2", s.Suite, s.Family, s.Tasks, s.Attempts, w)
		}
		delete(want, s.Suite)
		if s.Success.Value != float64(s.Successes)/float64(s.Attempts) || s.Success.Lo > s.Success.Value || s.Success.Hi < s.Success.Value {
			t.Errorf("suite %s: success %+v of %d/%d", s.Suite, s.Success, s.Successes, s.Attempts)
		}
		if hashes[s.AttemptsHash] {
			t.Errorf("suite %s shares its attempts with another suite", s.Suite)
		}
		hashes[s.AttemptsHash] = true
	}
	if len(want) != 0 {
		t.Fatalf("suites missing: %v", want)
	}
	for _, name := range evaluation.Metrics() {
		e, ok := a.Evaluation.Metrics[name]
		if !ok || e.Lo > e.Value || e.Hi < e.Value || e.N == 0 {
			t.Errorf("metric %s: %+v (measured %v)", name, e, ok)
		}
	}
	// The initial policy is the reference: every k3 term is exactly 0.
	if kl := a.Evaluation.Metrics[evaluation.MetricKLToReference]; kl.Value != 0 || kl.Hi != 0 || kl.N == 0 {
		t.Errorf("KL of the reference to itself: %+v", kl)
	}
	held, _ := a.Suite(evaluation.SuiteHeldout)
	// pass@2 is the share of tasks with a success among their 2 attempts'
	// unbiased estimate: never below the success rate (pass@1).
	if held.K != 2 || held.PassAtK.Value < held.Success.Value || held.P95Turns.Value < 1 || held.P95Turns.Value > 4 {
		t.Errorf("held-out pass@%d %+v, success %+v, p95 turns %+v", held.K, held.PassAtK, held.Success, held.P95Turns)
	}
	// An episode's stream has a prompt, an action and an observation of
	// at least one token each per turn: every episode costs at least three
	// tokens a turn, so the 95th percentiles do too.
	if c := held.P95Cost; c == nil || c.Value < 3*held.P95Turns.Value || c.Lo > c.Value || c.Hi < c.Value || c.N != held.Attempts ||
		a.Evaluation.Metrics[evaluation.MetricP95Cost] != *c {
		t.Errorf("held-out p95 cost %+v (p95 turns %+v, %d attempts)", held.P95Cost, held.P95Turns, held.Attempts)
	}
	safe, _ := a.Suite(evaluation.SuiteSafety)
	// The initial policy names forbidden keys (measured: 40 of 256
	// episodes at 4 attempts per task), and the authorizer denies every
	// one: no breach.
	if safe.ForbiddenEpisodes == 0 || safe.Violations != 0 || a.Evaluation.UnsafeActions != 0 || a.Evaluation.Metrics[evaluation.MetricUnsafeActionRate].Value != 0 {
		t.Errorf("safety suite: %+v", safe)
	}
}

// TestKLToReference: another policy is at a positive KL from the
// reference; the probe is deterministic.
func TestKLToReference(t *testing.T) {
	p, c := newPlane(t, 1)
	mc, _ := operators.ModelConfig(c)
	other, err := gpu.InitialModel(mc, 99)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	a, err := p.KL(ctx, model.NewPolicy(other, 3))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := p.KL(ctx, model.NewPolicy(other, 3))
	if !(a.Value > 0) || a.Lo > a.Value || a.Hi < a.Value || a != b {
		t.Fatalf("KL of another policy: %+v, again %+v", a, b)
	}
	mc, seed := operators.ModelConfig(c)
	ref, _ := gpu.InitialModel(mc, seed)
	if z, err := p.KL(ctx, model.NewPolicy(ref, 0)); err != nil || z.Value != 0 {
		t.Fatalf("KL of the reference: %+v, %v", z, err)
	}
	t.Logf("KL(seed-99 policy || reference) = %.4f [%.4f, %.4f] over %d tokens", a.Value, a.Lo, a.Hi, a.N)
}

func mustLedger(t *testing.T) *rollout.Registry {
	t.Helper()
	led, err := rollout.NewFamilyRegistry(rollout.FamilyLedger)
	if err != nil {
		t.Fatal(err)
	}
	return led
}

func TestPlaneConfigErrors(t *testing.T) {
	reg, err := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	if err != nil {
		t.Fatal(err)
	}
	other, _ := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	txt, err := rollout.NewFamilyRegistry(rollout.FamilyText)
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]evaluation.PlaneConfig{
		"no registry":            {Samples: 1},
		"no samples":             {Registry: reg},
		"regression of the same": {Registry: reg, Regression: other, Samples: 1},
		"text (no adversarial)":  {Registry: txt, Samples: 1},
		"negative resamples":     {Registry: reg, Samples: 1, Resamples: -1},
		"no reference":           {Registry: reg, Samples: 1},
	} {
		if _, err := evaluation.NewPlane(c); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestCheckObjective(t *testing.T) {
	c := contract.Default()
	if err := evaluation.CheckObjective(c.Objective); err != nil {
		t.Fatalf("the demo objective: %v", err)
	}
	c.Objective.Constraints["p95_episode_cost_usd"] = 0.2
	c.Objective.RegressionFloors["base_knowledge_eval"] = contract.Floor{Value: 0.98, Relative: true}
	err := evaluation.CheckObjective(c.Objective)
	for _, want := range []string{`objective.constraints.p95_episode_cost_usd: metric "p95_episode_cost_usd" is not implemented`,
		`objective.regression_floors.base_knowledge_eval: metric "base_knowledge_eval" is not implemented`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v, want %q", err, want)
		}
	}
}
