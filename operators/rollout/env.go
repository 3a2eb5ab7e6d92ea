package rollout

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/trajflow/trajflow/schemas"
)

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

// kvEpisode is the environment state of one kv attempt. It is not safe for
// concurrent use; each episode has its own.
type kvEpisode struct {
	task Task
	h    hidden
	keys int
	vals int
	art  Artifacts
	done bool
}

// Reset implements Environment: it starts an episode of the attempt's
// task at the versions the attempt declares and returns its initial
// observation (kv: the prompt BOS TASK <key> ACT). The seed is accepted
// for the environment contract; the built-in families are deterministic
// and do not use it.
func (r *Registry) Reset(ctx context.Context, a schemas.TaskAttempt) (Episode, Observation, error) {
	if err := ctx.Err(); err != nil {
		return nil, Observation{}, err
	}
	t, err := r.attemptTask(a)
	if err != nil {
		return nil, Observation{}, err
	}
	ep, obs := r.fam.reset(t)
	return ep, obs, nil
}

// Resume continues an episode of attempt a from the world state its
// Stateful.State returned (an environment service restarting from its
// persisted transitions).
func (r *Registry) Resume(a schemas.TaskAttempt, state []byte) (Episode, error) {
	t, err := r.attemptTask(a)
	if err != nil {
		return nil, err
	}
	return r.fam.resume(t, state)
}

func (kvFamily) spec() Spec {
	return Spec{Family: FamilyKV, Observations: ObsTokens, ParserVersion: ParserVersion, TokenizerHash: TokenizerHash,
		TurnPrompt: TurnPrompt(), MaxObservation: maxObservation}
}

func (f kvFamily) reset(t Task) (Episode, Observation) {
	cfg := f.r.cfg
	e := &kvEpisode{task: t, h: f.r.hidden[t.ID], keys: cfg.Keys, vals: cfg.Values, art: Artifacts{ToolCalls: []ToolCall{}, AnswerTurn: -1}}
	return e, Observation{IDs: []int32{TokBOS, TokTask, TokKey0 + t.Key, TokAct}}
}

// kvState is the persisted world state of a kv episode.
type kvState struct {
	Artifacts Artifacts `json:"artifacts"`
	Done      bool      `json:"done"`
}

func (f kvFamily) resume(t Task, state []byte) (Episode, error) {
	ep, _ := f.reset(t)
	e := ep.(*kvEpisode)
	var st kvState
	if err := json.Unmarshal(state, &st); err != nil {
		return nil, fmt.Errorf("rollout: resume kv episode of %s: %w", t.ID, err)
	}
	if st.Artifacts.ToolCalls == nil {
		st.Artifacts.ToolCalls = []ToolCall{}
	}
	e.art, e.done = st.Artifacts, st.Done
	return e, nil
}

// State implements Stateful.
func (e *kvEpisode) State() ([]byte, error) {
	return json.Marshal(kvState{Artifacts: e.art, Done: e.done})
}

// Spec implements Episode.
func (e *kvEpisode) Spec() Spec { return kvFamily{}.spec() }

// TurnPrompt is the prompt delta rendered before the action of turn t > 0
// (kv and ledger families).
func TurnPrompt() []int32 { return []int32{TokAct} }

// Authorize is the authorizer (docs/PIPELINE.md §7): a lookup of the task's
// forbidden key is denied; everything else parsed is allowed.
func (e *kvEpisode) Authorize(a Action) (bool, string) {
	if a.Kind == KindCall && a.Key == e.h.forbidden {
		return false, fmt.Sprintf("key %d is not accessible to this task", a.Key)
	}
	return true, ""
}

// Step implements Episode: it parses, authorizes and executes the action
// tokens of turn `turn`. Stepping a finished episode is an error.
func (e *kvEpisode) Step(_ context.Context, turn int32, act EnvAction) (Transition, error) {
	if e.done {
		return Transition{}, fmt.Errorf("rollout: step on a finished episode of task %s", e.task.ID)
	}
	a, err := Parse(act.IDs, e.keys, e.vals)
	if err != nil {
		return Transition{Decision: schemas.DecisionInvalid, Reason: err.Error(), Observation: Observation{IDs: []int32{TokErr}}}, nil
	}
	if ok, why := e.Authorize(a); !ok {
		e.art.ToolCalls = append(e.art.ToolCalls, ToolCall{Turn: turn, Key: a.Key, Authorized: false})
		return Transition{Decision: schemas.DecisionDenied, Reason: why, Observation: Observation{IDs: []int32{TokDeny}}}, nil
	}
	switch a.Kind {
	case KindCall:
		e.art.ToolCalls = append(e.art.ToolCalls, ToolCall{Turn: turn, Key: a.Key, Authorized: true})
		return Transition{Decision: schemas.DecisionOK, Observation: Observation{IDs: []int32{TokObs, TokVal0 + e.h.table[a.Key]}}}, nil
	default: // KindAnswer
		e.art.AnswerTurn = turn
		e.done = true
		return Transition{Decision: schemas.DecisionOK, Terminated: true}, nil
	}
}

// Close implements Episode.
func (e *kvEpisode) Close(context.Context, string) (Final, error) {
	e.done = true
	return Final{Artifacts: e.ArtifactsJSON(), Steps: len(e.art.ToolCalls) + btoi(e.art.AnswerTurn >= 0)}, nil
}

// ArtifactsJSON returns the episode's artifacts as JSON.
func (e *kvEpisode) ArtifactsJSON() string {
	b, _ := json.Marshal(e.art) // plain structs: cannot fail
	return string(b)
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
