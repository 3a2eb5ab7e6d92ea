package reward

import (
	"context"
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/operators/validate"
	"github.com/trajflow/trajflow/schemas"
)

// trajectory returns a three-turn trajectory: turn 0 ok (2 action tokens),
// turn 1 invalid (3), turn 2 denied (1).
func trajectory() *schemas.Trajectory {
	return &schemas.Trajectory{
		RecordID: "rec-1", RunID: "run", TaskID: "task", GroupID: "grp", GroupSize: 2, Split: schemas.SplitTrain,
		Status: schemas.StatusCompleted, End: schemas.EndTerminated, EndReason: "answer",
		Turns: []schemas.Turn{
			{Index: 0, PromptIDs: []int32{1, 2}, ActionIDs: []int32{3, 4}, ActionLogprobs: []float32{-1, -1}, Decision: schemas.DecisionOK},
			{Index: 1, PromptIDs: []int32{5}, ActionIDs: []int32{6, 7, 8}, ActionLogprobs: []float32{-1, -1, -1}, Decision: schemas.DecisionInvalid},
			{Index: 2, PromptIDs: []int32{9}, ActionIDs: []int32{10}, ActionLogprobs: []float32{-1}, Decision: schemas.DecisionDenied},
		},
	}
}

// fake is a configurable evaluator that counts its calls.
type fake struct {
	name, version string
	fn            func(ctx context.Context, t *schemas.Trajectory) ([]schemas.RewardComponent, error)
	calls         int
}

func (f *fake) Name() string    { return f.name }
func (f *fake) Version() string { return f.version }
func (f *fake) Evaluate(ctx context.Context, t *schemas.Trajectory) ([]schemas.RewardComponent, error) {
	f.calls++
	return f.fn(ctx, t)
}

func constant(name string, raw float64) *fake {
	return &fake{name: name, version: "1", fn: func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
		return []schemas.RewardComponent{{Raw: raw, Evidence: "const"}}, nil
	}}
}

func registry(t *testing.T, extra ...Evaluator) *Registry {
	t.Helper()
	r, err := NewRegistry(append(Builtins(), extra...)...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-12 }

func TestTransforms(t *testing.T) {
	for _, tc := range []struct {
		c     Component
		raw   float64
		trans float64
		value float64
		label string
	}{
		{Component{Weight: 1}, 0.7, 0.7, 0.7, "identity"},
		{Component{Weight: 2, Transform: "identity"}, -1.5, -1.5, -3, "identity"},
		{Component{Weight: 3, Transform: "clip", ClipMin: -1, ClipMax: 0.5}, 0.25, 0.25, 0.75, "clip[-1,0.5]"},
		{Component{Weight: 3, Transform: "clip", ClipMin: -1, ClipMax: 0.5}, 4, 0.5, 1.5, "clip[-1,0.5]"},
		{Component{Weight: 3, Transform: "clip", ClipMin: -1, ClipMax: 0.5}, -7, -1, -3, "clip[-1,0.5]"},
		{Component{Weight: 1, Transform: "clip", ClipMin: 2, ClipMax: 2}, 0, 2, 2, "clip[2,2]"},
		{Component{Weight: 2, Transform: "tanh"}, 0.5, 0.46211715726000974, 0.9242343145200195, "tanh"},
		{Component{Weight: 1, Transform: "tanh"}, -100, -1, -1, "tanh"},
		{Component{Weight: 0.5, Transform: "negate"}, 4, -4, -2, "negate"},
		{Component{Weight: -0.5, Transform: "negate"}, 4, -4, 2, "negate"},
		{Component{Weight: 0, Transform: "negate"}, 4, -4, 0, "negate"},
	} {
		if got := tc.c.Transformed(tc.raw); !near(got, tc.trans) {
			t.Errorf("%+v: Transformed(%v) = %v, want %v", tc.c, tc.raw, got, tc.trans)
		}
		if got := tc.c.Value(tc.raw); !near(got, tc.value) {
			t.Errorf("%+v: Value(%v) = %v, want %v", tc.c, tc.raw, got, tc.value)
		}
		if got := tc.c.TransformLabel(); got != tc.label {
			t.Errorf("%+v: label %q, want %q", tc.c, got, tc.label)
		}
	}
}

func TestComponentValidate(t *testing.T) {
	ok := Component{Name: "a", Version: "1", Weight: 1}
	for _, tc := range []struct {
		name   string
		mutate func(c *Component)
		want   string // "" = valid
	}{
		{"ok", func(*Component) {}, ""},
		{"ok clip", func(c *Component) { c.Transform, c.ClipMin, c.ClipMax = "clip", -1, 1 }, ""},
		{"ok zero weight", func(c *Component) { c.Weight = 0 }, ""},
		{"no name", func(c *Component) { c.Name = "" }, "empty name"},
		{"no version", func(c *Component) { c.Version = "" }, "no version"},
		{"nan weight", func(c *Component) { c.Weight = math.NaN() }, "weight NaN"},
		{"inf weight", func(c *Component) { c.Weight = math.Inf(-1) }, "weight -Inf"},
		{"unknown transform", func(c *Component) { c.Transform = "log" }, `transform "log"`},
		{"clip inverted", func(c *Component) { c.Transform, c.ClipMin, c.ClipMax = "clip", 1, -1 }, "clip bounds [1, -1]"},
		{"clip inf", func(c *Component) { c.Transform, c.ClipMax = "clip", math.Inf(1) }, "clip bounds"},
	} {
		c := ok
		tc.mutate(&c)
		err := c.Validate()
		if tc.want == "" {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			continue
		}
		if !errors.Is(err, ErrInvalidComponent) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err %v, want ErrInvalidComponent containing %q", tc.name, err, tc.want)
		}
	}
	if err := ValidateComponents([]Component{ok, ok}); !errors.Is(err, ErrInvalidComponent) || !strings.Contains(err.Error(), "twice") {
		t.Errorf("duplicate declaration: %v", err)
	}
}

func TestScoreBuiltinsWeighted(t *testing.T) {
	reg := registry(t, constant("success", 1))
	comps := []Component{
		{Name: "success", Version: "1", Weight: 1},
		{Name: EvalInvalidAction, Version: BuiltinVersion, Weight: 0.5, Transform: TransformNegate},
		{Name: EvalLength, Version: BuiltinVersion, Weight: -0.1, Transform: TransformClip, ClipMin: 0, ClipMax: 4},
		{Name: EvalTurnCount, Version: BuiltinVersion, Weight: 1, Transform: TransformTanh},
	}
	tr := trajectory()
	got, err := Score(context.Background(), tr, comps, reg)
	if err != nil {
		t.Fatal(err)
	}
	// Hand-computed: success 1*1; invalid_action raw 2 (turns 1, 2) -> -2*0.5;
	// length raw 6 -> clip 4 -> *-0.1; turn_count raw 3 -> tanh(3).
	want := []struct {
		name, label, evidence string
		raw, value            float64
	}{
		{"success", "identity", "const", 1, 1},
		{EvalInvalidAction, "negate", `{"invalid":[1],"denied":[2]}`, 2, -1},
		{EvalLength, "clip[0,4]", `{"action_tokens":6,"turns":3}`, 6, -0.4},
		{EvalTurnCount, "tanh", `{"turns":3}`, 3, 0.9950547536867305},
	}
	if len(got.Rewards) != len(want) {
		t.Fatalf("%d components, want %d: %+v", len(got.Rewards), len(want), got.Rewards)
	}
	for i, w := range want {
		c := got.Rewards[i]
		if c.Name != w.name || c.Transform != w.label || c.Evidence != w.evidence || c.Raw != w.raw || !near(c.Value, w.value) {
			t.Errorf("component %d = %+v, want %+v", i, c, w)
		}
		if c.Version != comps[i].Version || c.Weight != comps[i].Weight || c.EvaluatorVersion != comps[i].Version ||
			c.Scope != schemas.ScopeTrajectory || c.Turn != -1 || c.TrajectoryID != "rec-1" || c.Error != "" {
			t.Errorf("component %d metadata: %+v", i, c)
		}
	}
	if wantTotal := 1 - 1 - 0.4 + 0.9950547536867305; !near(got.RewardTotal, wantTotal) {
		t.Errorf("RewardTotal = %v, want %v", got.RewardTotal, wantTotal)
	}
	if got.RecordID != tr.RecordID || len(got.Turns) != 3 {
		t.Errorf("trajectory not carried: %+v", got.Trajectory)
	}
	if v := validate.CheckRewarded(&got, validate.RewardOptions{Required: []string{"success"}}); !v.OK() {
		t.Errorf("Score output rejected by validate: %v", v)
	}
}

func TestScoreEvaluatorFailure(t *testing.T) {
	boom := errors.New("verifier sandbox crashed")
	for _, tc := range []struct {
		name string
		fn   func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error)
		want string
	}{
		{"error", func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) { return nil, boom }, "sandbox crashed"},
		{"panic", func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) { panic("nil map") }, "panicked: nil map"},
		{"no terms", func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) { return nil, nil }, "no terms"},
		{"nan raw", func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
			return []schemas.RewardComponent{{Raw: math.NaN()}}, nil
		}, "raw NaN"},
		{"wrong name", func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
			return []schemas.RewardComponent{{Name: "other", Raw: 1}}, nil
		}, `name "other"`},
		{"bad scope", func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
			return []schemas.RewardComponent{{Scope: "episode", Raw: 1}}, nil
		}, `scope "episode"`},
		{"turn outside", func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
			return []schemas.RewardComponent{{Scope: schemas.ScopeTurn, Turn: 3, Raw: 1}}, nil
		}, "turn 3 of 3"},
		{"span outside", func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
			return []schemas.RewardComponent{{Scope: schemas.ScopeSpan, Turn: 0, SpanStart: 1, SpanEnd: 3, Raw: 1}}, nil
		}, "span [1,3) of turn 0 with 2 action tokens"},
		{"duplicate place", func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
			return []schemas.RewardComponent{{Scope: schemas.ScopeTurn, Turn: 1, Raw: 1}, {Scope: schemas.ScopeTurn, Turn: 1, Raw: 2}}, nil
		}, "scored twice"},
		{"negative uncertainty", func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
			return []schemas.RewardComponent{{Raw: 1, Uncertainty: -0.1}}, nil
		}, "uncertainty"},
		{"value overflow", func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
			return []schemas.RewardComponent{{Raw: math.MaxFloat64}}, nil
		}, "value +Inf"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			judge := &fake{name: "judge", version: "j2", fn: tc.fn}
			reg := registry(t, judge)
			comps := []Component{
				{Name: EvalTurnCount, Version: BuiltinVersion, Weight: 0.5},
				{Name: "judge", Version: "j2", Weight: 10},
				{Name: EvalLength, Version: BuiltinVersion, Weight: 0.25},
			}
			got, err := Score(context.Background(), trajectory(), comps, reg)
			if err != nil {
				t.Fatalf("evaluator failure returned as stage error: %v", err)
			}
			if len(got.Rewards) != 3 {
				t.Fatalf("%d components: %+v", len(got.Rewards), got.Rewards)
			}
			c := got.Rewards[1]
			if c.Name != "judge" || c.Version != "j2" || c.EvaluatorVersion != "j2" || c.Weight != 10 ||
				c.Value != 0 || c.Raw != 0 || c.Scope != schemas.ScopeTrajectory || c.Turn != -1 || c.TrajectoryID != "rec-1" {
				t.Errorf("failure component %+v", c)
			}
			if !strings.Contains(c.Error, tc.want) {
				t.Errorf("Error %q does not contain %q", c.Error, tc.want)
			}
			// Total over available components only: 0.5*3 + 0.25*6.
			if got.RewardTotal != 3 {
				t.Errorf("RewardTotal = %v, want 3", got.RewardTotal)
			}
			v := validate.CheckRewarded(&got, validate.RewardOptions{})
			if v.Reason != validate.ReasonRewardUnavailable || !v.Infra() {
				t.Errorf("validate verdict %v, want infra-invalid reward_unavailable", v)
			}
		})
	}
}

func TestScoreTurnAndSpanTerms(t *testing.T) {
	proc := &fake{name: "process", version: "p1", fn: func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
		return []schemas.RewardComponent{
			{Scope: schemas.ScopeTurn, Turn: 2, Raw: 0.5, Evidence: "t2"},
			{Scope: schemas.ScopeTurn, Turn: 0, Raw: -0.5, Evidence: "t0", EvaluatorVersion: "judge-ckpt-9", Uncertainty: 0.2},
			{Scope: schemas.ScopeSpan, Turn: 1, SpanStart: 1, SpanEnd: 3, Raw: 2, Evidence: "s1"},
		}, nil
	}}
	got, err := Score(context.Background(), trajectory(), []Component{{Name: "process", Version: "p1", Weight: 2, Transform: TransformClip, ClipMin: -1, ClipMax: 1}}, registry(t, proc))
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		scope             string
		turn, start, end  int32
		value, unc        float64
		evidence, evalVer string
	}{
		{schemas.ScopeTurn, 2, 0, 0, 1, 0, "t2", "p1"},
		{schemas.ScopeTurn, 0, 0, 0, -1, 0.2, "t0", "judge-ckpt-9"},
		{schemas.ScopeSpan, 1, 1, 3, 2, 0, "s1", "p1"},
	}
	if len(got.Rewards) != len(want) {
		t.Fatalf("%d components", len(got.Rewards))
	}
	for i, w := range want {
		c := got.Rewards[i]
		if c.Scope != w.scope || c.Turn != w.turn || c.SpanStart != w.start || c.SpanEnd != w.end || c.Value != w.value ||
			c.Uncertainty != w.unc || c.Evidence != w.evidence || c.EvaluatorVersion != w.evalVer || c.Name != "process" {
			t.Errorf("component %d = %+v, want %+v", i, c, w)
		}
	}
	if got.RewardTotal != 2 {
		t.Errorf("RewardTotal = %v, want 2", got.RewardTotal)
	}
	if v := validate.CheckRewarded(&got, validate.RewardOptions{}); !v.OK() {
		t.Errorf("validate: %v", v)
	}
}

func TestScoreConfigurationErrors(t *testing.T) {
	for _, tc := range []struct {
		name  string
		comps []Component
		want  error
	}{
		{"version mismatch", []Component{{Name: EvalLength, Version: BuiltinVersion, Weight: 1}, {Name: "judge", Version: "j1", Weight: 1}}, ErrVersionMismatch},
		{"builtin version mismatch", []Component{{Name: EvalLength, Version: "2", Weight: 1}}, ErrVersionMismatch},
		{"unknown evaluator", []Component{{Name: EvalLength, Version: BuiltinVersion, Weight: 1}, {Name: "success", Version: "1", Weight: 1}}, ErrUnknownEvaluator},
		{"bad transform", []Component{{Name: EvalLength, Version: BuiltinVersion, Weight: 1, Transform: "sqrt"}}, ErrInvalidComponent},
		{"duplicate", []Component{{Name: EvalLength, Version: BuiltinVersion, Weight: 1}, {Name: EvalLength, Version: BuiltinVersion, Weight: 2}}, ErrInvalidComponent},
	} {
		t.Run(tc.name, func(t *testing.T) {
			judge := &fake{name: "judge", version: "j2", fn: func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
				return []schemas.RewardComponent{{Raw: 1}}, nil
			}}
			_, err := Score(context.Background(), trajectory(), tc.comps, registry(t, judge))
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			if judge.calls != 0 {
				t.Errorf("an evaluator ran despite a configuration error")
			}
		})
	}
	if _, err := Score(context.Background(), nil, nil, NewBuiltinRegistry()); err == nil {
		t.Error("nil trajectory accepted")
	}
	if _, err := Score(context.Background(), trajectory(), nil, nil); err == nil {
		t.Error("nil registry accepted")
	}
}

func TestScoreContextCanceled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	// The evaluator fails because the stage is shutting down: that is not an
	// evaluator failure to record.
	slow := &fake{name: "slow", version: "1", fn: func(ctx context.Context, _ *schemas.Trajectory) ([]schemas.RewardComponent, error) {
		cancel()
		return nil, ctx.Err()
	}}
	after := constant("after", 1)
	comps := []Component{{Name: "slow", Version: "1", Weight: 1}, {Name: "after", Version: "1", Weight: 1}}
	_, err := Score(ctx, trajectory(), comps, registry(t, slow, after))
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if after.calls != 0 {
		t.Error("evaluation continued after cancellation")
	}
	// Already canceled: nothing runs.
	_, err = Score(ctx, trajectory(), comps[1:], registry(t, after))
	if !errors.Is(err, context.Canceled) || after.calls != 0 {
		t.Fatalf("err = %v, calls %d", err, after.calls)
	}
}

func TestScoreDeterministicOrder(t *testing.T) {
	reg := registry(t, constant("a", 1), constant("b", 2), constant("c", 3))
	comps := []Component{
		{Name: "c", Version: "1", Weight: 1},
		{Name: EvalTurnCount, Version: BuiltinVersion, Weight: 1},
		{Name: "a", Version: "1", Weight: 1},
		{Name: EvalInvalidAction, Version: BuiltinVersion, Weight: -1},
		{Name: "b", Version: "1", Weight: 1},
	}
	first, err := Score(context.Background(), trajectory(), comps, reg)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range first.Rewards {
		names = append(names, c.Name)
	}
	if want := []string{"c", EvalTurnCount, "a", EvalInvalidAction, "b"}; !reflect.DeepEqual(names, want) {
		t.Fatalf("order %v, want declaration order %v", names, want)
	}
	for range 5 {
		again, err := Score(context.Background(), trajectory(), comps, reg)
		if err != nil || !reflect.DeepEqual(again, first) {
			t.Fatalf("non-deterministic output: %v\n%+v\n%+v", err, again, first)
		}
	}
	// Reversed declaration gives the reversed components.
	rev := []Component{comps[4], comps[3], comps[2], comps[1], comps[0]}
	back, err := Score(context.Background(), trajectory(), rev, reg)
	if err != nil {
		t.Fatal(err)
	}
	for i := range back.Rewards {
		if !reflect.DeepEqual(back.Rewards[i], first.Rewards[len(first.Rewards)-1-i]) {
			t.Fatalf("component %d differs after reordering the declaration", i)
		}
	}
}

func TestScoreDoesNotMutate(t *testing.T) {
	shared := []schemas.RewardComponent{{Raw: 1}}
	cached := &fake{name: "cached", version: "1", fn: func(context.Context, *schemas.Trajectory) ([]schemas.RewardComponent, error) {
		return shared, nil
	}}
	tr := trajectory()
	before := *tr
	got, err := Score(context.Background(), tr, []Component{{Name: "cached", Version: "1", Weight: 3}}, registry(t, cached))
	if err != nil {
		t.Fatal(err)
	}
	if got.Rewards[0].Value != 3 {
		t.Fatalf("value %v", got.Rewards[0].Value)
	}
	if shared[0].Name != "" || shared[0].Value != 0 || shared[0].Scope != "" {
		t.Errorf("evaluator's slice modified: %+v", shared[0])
	}
	if !reflect.DeepEqual(*tr, before) {
		t.Error("trajectory modified")
	}
}

func TestRegistry(t *testing.T) {
	var r Registry // the zero value is usable
	if _, ok := r.Lookup(EvalLength); ok {
		t.Fatal("empty registry found an evaluator")
	}
	if err := r.Register(Length()); err != nil {
		t.Fatal(err)
	}
	if e, ok := r.Lookup(EvalLength); !ok || e.Name() != EvalLength || e.Version() != BuiltinVersion {
		t.Fatalf("Lookup = %v, %v", e, ok)
	}
	for _, tc := range []struct {
		name string
		e    Evaluator
	}{
		{"duplicate", &fake{name: EvalLength, version: "9"}},
		{"nil", nil},
		{"no name", &fake{version: "1"}},
		{"no version", &fake{name: "x"}},
	} {
		if err := r.Register(tc.e); !errors.Is(err, ErrRegister) {
			t.Errorf("%s: err = %v, want ErrRegister", tc.name, err)
		}
	}
	if e, _ := r.Lookup(EvalLength); e.Version() != BuiltinVersion {
		t.Error("duplicate registration replaced the original")
	}
	if got, want := NewBuiltinRegistry().Names(), []string{EvalInvalidAction, EvalLength, EvalTurnCount}; !reflect.DeepEqual(got, want) {
		t.Errorf("builtin names %v, want %v", got, want)
	}
	if _, err := NewRegistry(Length(), Length()); !errors.Is(err, ErrRegister) {
		t.Errorf("NewRegistry with duplicates: %v", err)
	}
}

func TestBuiltins(t *testing.T) {
	empty := &schemas.Trajectory{RecordID: "r"}
	allOK := trajectory()
	for i := range allOK.Turns {
		allOK.Turns[i].Decision = schemas.DecisionOK
	}
	for _, tc := range []struct {
		e        Evaluator
		t        *schemas.Trajectory
		raw      float64
		evidence string
	}{
		{InvalidAction(), trajectory(), 2, `{"invalid":[1],"denied":[2]}`},
		{InvalidAction(), allOK, 0, `{"invalid":[],"denied":[]}`},
		{InvalidAction(), empty, 0, `{"invalid":[],"denied":[]}`},
		{Length(), trajectory(), 6, `{"action_tokens":6,"turns":3}`},
		{Length(), empty, 0, `{"action_tokens":0,"turns":0}`},
		{TurnCount(), trajectory(), 3, `{"turns":3}`},
		{TurnCount(), empty, 0, `{"turns":0}`},
	} {
		out, err := tc.e.Evaluate(context.Background(), tc.t)
		if err != nil || len(out) != 1 {
			t.Fatalf("%s: %v, %d terms", tc.e.Name(), err, len(out))
		}
		if out[0].Raw != tc.raw || out[0].Evidence != tc.evidence || out[0].Scope != schemas.ScopeTrajectory || out[0].Turn != -1 {
			t.Errorf("%s = %+v, want raw %v evidence %s", tc.e.Name(), out[0], tc.raw, tc.evidence)
		}
	}
}

func BenchmarkScoreBuiltins(b *testing.B) {
	tr := trajectory()
	for i := 3; i < 32; i++ {
		tr.Turns = append(tr.Turns, schemas.Turn{Index: int32(i), ActionIDs: make([]int32, 256), Decision: schemas.DecisionOK})
	}
	reg := NewBuiltinRegistry()
	comps := []Component{
		{Name: EvalInvalidAction, Version: BuiltinVersion, Weight: -0.1},
		{Name: EvalLength, Version: BuiltinVersion, Weight: -1e-4, Transform: TransformClip, ClipMin: 0, ClipMax: 4096},
		{Name: EvalTurnCount, Version: BuiltinVersion, Weight: 0},
	}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Score(ctx, tr, comps, reg); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "trajectories/s")
}
