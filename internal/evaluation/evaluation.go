// Package evaluation measures a policy on the hidden evaluation split
// (docs/PIPELINE.md §6, §18): the evaluation plane, apart from training. It runs
// in process on fixed attempts — the same attempt ids and environment
// seeds for every policy version and every run of the same contract seed —
// so the success rates of two versions differ only by the policy.
package evaluation

import (
	"context"
	"errors"
	"fmt"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// RunID is the run id of every evaluation attempt: it names no training
// run, so an evaluation attempt can never be mistaken for a training one.
const RunID = "hidden-eval"

// ContractHash is the contract hash evaluation attempts carry.
const ContractHash = "eval"

// Config configures an Evaluator.
type Config struct {
	// Registry holds the hidden eval split (Registry.Eval) and its tasks.
	Registry *rollout.Registry
	// Settings and Limits are the sampler and the episode budgets of the
	// run (the policy is evaluated as it samples in training).
	Settings model.Settings
	Limits   rollout.Limits
	// Seed is the contract seed: with it, the attempts' environment seeds
	// are fixed.
	Seed int64
	// Samples is the number of attempts per eval task (>= 1).
	Samples int32
}

// Evaluator measures hidden-eval success. It is safe for sequential use.
type Evaluator struct {
	cfg Config
	val *rollout.Validator
}

// New returns an evaluator, or an error naming the field that is wrong.
func New(c Config) (*Evaluator, error) {
	switch {
	case c.Registry == nil:
		return nil, errors.New("evaluation: no task registry")
	case len(c.Registry.Eval()) == 0:
		return nil, errors.New("evaluation: the task registry has no hidden eval split")
	case c.Samples < 1:
		return nil, fmt.Errorf("evaluation: samples %d: want at least 1 attempt per task", c.Samples)
	}
	return &Evaluator{cfg: c, val: rollout.NewValidator(c.Registry)}, nil
}

// Tasks is the number of hidden eval tasks.
func (e *Evaluator) Tasks() int { return len(e.cfg.Registry.Eval()) }

// Samples is the number of attempts per task.
func (e *Evaluator) Samples() int32 { return e.cfg.Samples }

// Attempts are the evaluation attempts for a policy version: the same ids
// and seeds for every version (only PolicyVersion differs).
func (e *Evaluator) Attempts(version int64) []schemas.TaskAttempt {
	var atts []schemas.TaskAttempt
	for i, t := range e.cfg.Registry.Eval() {
		atts = append(atts, rollout.Attempts(RunID, t, int64(i), e.cfg.Samples, e.cfg.Seed, version, ContractHash)...)
	}
	return atts
}

// Success runs every evaluation attempt on pol and returns the share the
// trusted validator verifies.
func (e *Evaluator) Success(ctx context.Context, pol *model.Policy) (float64, error) {
	trajs, err := e.cfg.Registry.RunEpisodes(ctx, pol, e.Attempts(pol.Version()), e.cfg.Settings, e.cfg.Limits)
	if err != nil {
		return 0, fmt.Errorf("evaluation: %w", err)
	}
	ok := 0
	for i := range trajs {
		task, _ := e.cfg.Registry.Lookup(trajs[i].TaskID)
		good, _, err := e.val.Validate(task, &trajs[i])
		if err != nil {
			return 0, fmt.Errorf("evaluation: validate %s: %w", trajs[i].RecordID, err)
		}
		if good {
			ok++
		}
	}
	return float64(ok) / float64(len(trajs)), nil
}

// Release loads a policy release (verifying its checkpoint hash) and
// returns its success.
func (e *Evaluator) Release(ctx context.Context, rel schemas.PolicyRelease) (float64, error) {
	pol, err := gpu.LoadRelease(rel)
	if err != nil {
		return 0, err
	}
	return e.Success(ctx, pol)
}
