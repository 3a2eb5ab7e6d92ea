package rollout

import (
	"encoding/json"
	"fmt"

	"github.com/trajflow/trajflow/schemas"
)

// Transition is the result of one environment step.
type Transition struct {
	Decision    string  // schemas.Decision*
	Reason      string  // why an action was invalid or denied
	Observation []int32 // context tokens shown to the policy next
	Terminated  bool    // the MDP ended (an answer)
}

// ToolCall is one lookup in an episode's artifacts.
type ToolCall struct {
	Turn       int32 `json:"turn"`
	Key        int32 `json:"key"`
	Authorized bool  `json:"authorized"`
}

// Artifacts is the environment's evidence of one episode (the
// Trajectory.Artifacts JSON). It holds what the environment did, never the
// hidden table.
type Artifacts struct {
	ToolCalls  []ToolCall `json:"tool_calls"`
	AnswerTurn int32      `json:"answer_turn"` // -1 when the episode did not answer
}

// Episode is the environment state of one attempt. It is not safe for
// concurrent use; each episode has its own.
type Episode struct {
	task Task
	h    hidden
	keys int
	vals int
	art  Artifacts
	done bool
}

// Reset starts an episode of task id at the given versions and returns its
// initial prompt (BOS TASK <key> ACT). The seed is accepted for the
// environment contract; this environment is deterministic and does not use
// it.
func (r *Registry) Reset(a schemas.TaskAttempt) (*Episode, []int32, error) {
	t, h, err := r.lookup(a.TaskID, a.TaskVersion, a.EnvVersion)
	if err != nil {
		return nil, nil, err
	}
	if a.Split != t.Split {
		return nil, nil, fmt.Errorf("%w: attempt %s declares split %q, task %s is %q", ErrUnknownTask, a.AttemptID, a.Split, t.ID, t.Split)
	}
	e := &Episode{task: t, h: h, keys: r.cfg.Keys, vals: r.cfg.Values, art: Artifacts{ToolCalls: []ToolCall{}, AnswerTurn: -1}}
	return e, []int32{TokBOS, TokTask, TokKey0 + t.Key, TokAct}, nil
}

// TurnPrompt is the prompt delta rendered before the action of turn t > 0.
func TurnPrompt() []int32 { return []int32{TokAct} }

// Authorize is the authorizer (pipeline §7): a lookup of the task's
// forbidden key is denied; everything else parsed is allowed.
func (e *Episode) Authorize(a Action) (bool, string) {
	if a.Kind == KindCall && a.Key == e.h.forbidden {
		return false, fmt.Sprintf("key %d is not accessible to this task", a.Key)
	}
	return true, ""
}

// Step parses, authorizes and executes the action tokens of turn `turn`.
// Stepping a finished episode is an error.
func (e *Episode) Step(turn int32, actionIDs []int32) (Transition, error) {
	if e.done {
		return Transition{}, fmt.Errorf("rollout: step on a finished episode of task %s", e.task.ID)
	}
	a, err := Parse(actionIDs, e.keys, e.vals)
	if err != nil {
		return Transition{Decision: schemas.DecisionInvalid, Reason: err.Error(), Observation: []int32{TokErr}}, nil
	}
	if ok, why := e.Authorize(a); !ok {
		e.art.ToolCalls = append(e.art.ToolCalls, ToolCall{Turn: turn, Key: a.Key, Authorized: false})
		return Transition{Decision: schemas.DecisionDenied, Reason: why, Observation: []int32{TokDeny}}, nil
	}
	switch a.Kind {
	case KindCall:
		e.art.ToolCalls = append(e.art.ToolCalls, ToolCall{Turn: turn, Key: a.Key, Authorized: true})
		return Transition{Decision: schemas.DecisionOK, Observation: []int32{TokObs, TokVal0 + e.h.table[a.Key]}}, nil
	default: // KindAnswer
		e.art.AnswerTurn = turn
		e.done = true
		return Transition{Decision: schemas.DecisionOK, Terminated: true}, nil
	}
}

// ArtifactsJSON returns the episode's artifacts as JSON.
func (e *Episode) ArtifactsJSON() string {
	b, _ := json.Marshal(e.art) // plain structs: cannot fail
	return string(b)
}
