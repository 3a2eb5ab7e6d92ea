package rollout

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/schemas"
)

// Validator is the trusted validator of the registry's task family
// (docs/PIPELINE.md §8): it runs apart from the policy, alone knows the hidden
// tables, and judges a finalized trajectory from its actions (re-parsed,
// not trusting the recorded decisions: kv and ledger from the action
// tokens, text from the action texts the environment logged in the
// artifacts; the ledger validator also replays the transfers against the
// environment's journal). It implements the reward stage's Evaluator
// (operators/reward) under the name EvalSuccess (kv), EvalLedgerSuccess or
// EvalTextSuccess.
type Validator struct {
	reg *Registry
}

// Evaluator name and version of the task-success validator.
const (
	EvalSuccess      = "kv_success"
	ValidatorVersion = "1"
)

// NewValidator returns the validator of the tasks of reg.
func NewValidator(reg *Registry) *Validator { return &Validator{reg: reg} }

// Name implements reward.Evaluator.
func (v *Validator) Name() string { return v.reg.fam.evaluator() }

// Version implements reward.Evaluator.
func (v *Validator) Version() string { return ValidatorVersion }

// Evidence is the validator's account of a trajectory. It records what the
// agent did and whether the answer was right, never the right value.
type Evidence struct {
	Success       bool   `json:"success"`
	CalledKey     bool   `json:"called_prompt_key"` // an authorized lookup of the prompt's key happened
	CalledAt      int32  `json:"called_at"`         // turn of the first such lookup, -1 if none
	Answered      bool   `json:"answered"`
	AnswerTurn    int32  `json:"answer_turn"` // -1 if none
	AnswerCorrect bool   `json:"answer_correct"`
	Reason        string `json:"reason"`
}

// Validate judges t against task: success iff an answer ends the episode,
// the answer is the true value of the prompt's key, and an authorized
// lookup of that key happened in an earlier turn. It returns the verdict and
// the evidence as JSON. A trajectory of another task, or of another task or
// environment version, is an error (the validator cannot judge it).
//
// The ledger and text families apply their own rules (ledger.go, text.go)
// and also refuse to judge a trajectory whose artifacts disagree with its
// actions (for the ledger: a journal holding one transfer twice wraps
// ErrDuplicateExecution).
func (v *Validator) Validate(task Task, t *schemas.Trajectory) (bool, string, error) {
	if t.TaskID != task.ID {
		return false, "", fmt.Errorf("rollout: validate: trajectory %s is of task %s, not %s", t.RecordID, t.TaskID, task.ID)
	}
	if _, err := v.reg.task(t.TaskID, t.TaskVersion, t.EnvVersion); err != nil {
		return false, "", fmt.Errorf("rollout: validate %s: %w", t.RecordID, err)
	}
	ok, ev, err := v.reg.fam.judge(task, t)
	if err != nil {
		return false, "", err
	}
	b, _ := json.Marshal(ev)
	return ok, string(b), nil
}

func (v *Validator) judge(task Task, t *schemas.Trajectory) (Evidence, error) {
	if t.TaskID != task.ID {
		return Evidence{}, fmt.Errorf("rollout: validate: trajectory %s is of task %s, not %s", t.RecordID, t.TaskID, task.ID)
	}
	_, h, err := v.reg.lookup(t.TaskID, t.TaskVersion, t.EnvVersion)
	if err != nil {
		return Evidence{}, fmt.Errorf("rollout: validate %s: %w", t.RecordID, err)
	}
	cfg := v.reg.cfg
	ev := Evidence{CalledAt: -1, AnswerTurn: -1}
	for i := range t.Turns {
		a, err := Parse(t.Turns[i].ActionIDs, cfg.Keys, cfg.Values)
		if err != nil {
			continue // invalid actions do nothing
		}
		switch a.Kind {
		case KindCall:
			if a.Key == task.Key && a.Key != h.forbidden && !ev.CalledKey {
				ev.CalledKey, ev.CalledAt = true, int32(i)
			}
		case KindAnswer:
			if i != len(t.Turns)-1 {
				return ev, fmt.Errorf("rollout: validate %s: answer at turn %d of %d", t.RecordID, i, len(t.Turns))
			}
			ev.Answered, ev.AnswerTurn = true, int32(i)
			ev.AnswerCorrect = a.Value == h.table[task.Key]
		}
	}
	switch {
	case !ev.Answered:
		ev.Reason = "no answer"
	case !ev.AnswerCorrect:
		ev.Reason = "wrong answer"
	case !ev.CalledKey:
		ev.Reason = "answer without looking the key up"
	default:
		ev.Success, ev.Reason = true, "ok"
	}
	return ev, nil
}

// Evaluate implements reward.Evaluator: one trajectory-scoped term, Raw 1
// for success and 0 otherwise, with the evidence JSON. A trajectory the
// validator cannot judge (unknown task or version) is an error: the reward
// is unavailable, not zero.
func (v *Validator) Evaluate(ctx context.Context, t *schemas.Trajectory) ([]schemas.RewardComponent, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	task, ok := v.reg.Lookup(t.TaskID)
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrUnknownTask, t.TaskID)
	}
	ok, evidence, err := v.Validate(task, t)
	if err != nil {
		return nil, err
	}
	raw := 0.0
	if ok {
		raw = 1
	}
	return []schemas.RewardComponent{{Raw: raw, Scope: schemas.ScopeTrajectory, Turn: -1, Evidence: evidence}}, nil
}

// Teacher is a scripted expert for demonstrations (docs/PIPELINE.md §4): it looks
// the prompt's key up, then answers with the observed value. Its actions
// are ordinary action tokens, so a demonstration trains only
// policy-authored spans when packed.
type Teacher struct{}

// Act returns the teacher's action tokens for an episode whose token
// stream so far is stream (ending with ACT).
func (Teacher) Act(stream []int32) []int32 {
	key := int32(-1)
	for i := 0; i+1 < len(stream); i++ {
		if stream[i] == TokTask {
			key = stream[i+1] - TokKey0
		}
	}
	for i := len(stream) - 2; i >= 0; i-- {
		if stream[i] == TokObs && i >= 2 && stream[i-1] == TokEnd && stream[i-2] == TokKey0+key {
			return []int32{TokAns, stream[i+1], TokEnd}
		}
	}
	return []int32{TokCall, TokKey0 + key, TokEnd}
}

// Generate implements Policy: the teacher's action for every request, with
// log-probability 0 (a deterministic expert) and policy version 0. Use it
// with RunEpisodes to record demonstrations.
func (tc Teacher) Generate(ctx context.Context, reqs []model.Request) ([]model.Sample, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	out := make([]model.Sample, len(reqs))
	for i, r := range reqs {
		a := tc.Act(r.Context)
		out[i] = model.Sample{Tokens: a, Logprobs: make([]float32, len(a)), Finish: model.FinishStop}
	}
	return out, nil
}
