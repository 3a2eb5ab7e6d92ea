package operators

import (
	"errors"
	"fmt"

	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// BuiltinDeps assembles what the stages of a run of the built-in
// environment need beyond the resolved contract c: the run's topics, the
// task registry of the family c.Artifacts.Environment names
// (rollout.RegistryForArtifact; dispatch, rollout), its trusted validator
// as a reward evaluator, the hidden-eval denylist (validate, pack,
// dispatch) and, for the families of the built-in vocabulary, its size. The launch
// settings (release directory, rounds, timeouts, device) are the caller's.
func BuiltinDeps(c *contract.Contract) (Deps, error) {
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return Deps{}, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	// The contract's artifacts.environment chooses the family (kv, the
	// demo's, is DefaultRegistryConfig as before).
	reg, err := rollout.RegistryForArtifact(c.Artifacts.Environment)
	switch {
	case errors.Is(err, rollout.ErrNotBuiltin):
		// A run of an environment of its own (e.g. synthetic rollouts):
		// validate, reward, advantage, pack and train need no task
		// registry; dispatch and rollout refuse to start without one
		// (TaskRegistry names the contract field).
		return Deps{Contract: c, Topics: topics}, nil
	case err != nil:
		return Deps{}, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	d := Deps{
		Contract: c, Topics: topics, Tasks: reg,
		Evaluators:   []reward.Evaluator{rollout.NewValidator(reg)},
		EvalDenylist: reg.IsEval,
	}
	// The built-in vocabulary bounds token ids for the families that
	// speak it (kv, ledger); text episodes are tokenized by the policy
	// server's tokenizer.
	if reg.Spec().Observations == rollout.ObsTokens {
		d.VocabSize = rollout.VocabSize
	}
	return d, nil
}
