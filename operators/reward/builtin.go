package reward

import (
	"context"
	"encoding/json"

	"github.com/trajflow/trajflow/schemas"
)

// Names and version of the built-in evaluators. They read only the
// trajectory's own event log, never environment state, so they apply to
// every environment.
const (
	// EvalInvalidAction: Raw is the number of turns whose action the
	// parser rejected or the authorizer denied (docs/PIPELINE.md §8
	// invalid_action_cost; declare it with a negative weight or with
	// TransformNegate). Trajectory scope. Evidence:
	// {"invalid":[turns...],"denied":[turns...]}.
	EvalInvalidAction = "invalid_action"
	// EvalLength: Raw is the total number of action (policy-sampled)
	// tokens. Trajectory scope. Evidence: {"action_tokens":n,"turns":m}.
	EvalLength = "length"
	// EvalTurnCount: Raw is the number of turns. Trajectory scope.
	// Evidence: {"turns":n}.
	EvalTurnCount = "turn_count"

	// BuiltinVersion is the version of every built-in evaluator. It
	// changes whenever a built-in's raw score or evidence changes.
	BuiltinVersion = "1"
)

// Builtins returns the built-in evaluators, in name order.
func Builtins() []Evaluator {
	return []Evaluator{InvalidAction(), Length(), TurnCount()}
}

// InvalidAction returns the invalid_action evaluator.
func InvalidAction() Evaluator {
	return builtin{EvalInvalidAction, func(t *schemas.Trajectory) (float64, any) {
		ev := struct {
			Invalid []int32 `json:"invalid"`
			Denied  []int32 `json:"denied"`
		}{Invalid: []int32{}, Denied: []int32{}}
		for i := range t.Turns {
			switch t.Turns[i].Decision {
			case schemas.DecisionInvalid:
				ev.Invalid = append(ev.Invalid, t.Turns[i].Index)
			case schemas.DecisionDenied:
				ev.Denied = append(ev.Denied, t.Turns[i].Index)
			}
		}
		return float64(len(ev.Invalid) + len(ev.Denied)), ev
	}}
}

// Length returns the length evaluator.
func Length() Evaluator {
	return builtin{EvalLength, func(t *schemas.Trajectory) (float64, any) {
		n := 0
		for i := range t.Turns {
			n += len(t.Turns[i].ActionIDs)
		}
		return float64(n), struct {
			ActionTokens int `json:"action_tokens"`
			Turns        int `json:"turns"`
		}{n, len(t.Turns)}
	}}
}

// TurnCount returns the turn_count evaluator.
func TurnCount() Evaluator {
	return builtin{EvalTurnCount, func(t *schemas.Trajectory) (float64, any) {
		return float64(len(t.Turns)), struct {
			Turns int `json:"turns"`
		}{len(t.Turns)}
	}}
}

// builtin is a trajectory-scoped evaluator computed from the event log.
type builtin struct {
	name string
	fn   func(t *schemas.Trajectory) (raw float64, evidence any)
}

func (b builtin) Name() string    { return b.name }
func (b builtin) Version() string { return BuiltinVersion }

func (b builtin) Evaluate(_ context.Context, t *schemas.Trajectory) ([]schemas.RewardComponent, error) {
	raw, ev := b.fn(t)
	js, err := json.Marshal(ev)
	if err != nil {
		return nil, err
	}
	return []schemas.RewardComponent{{Raw: raw, Scope: schemas.ScopeTrajectory, Turn: -1, Evidence: string(js)}}, nil
}
