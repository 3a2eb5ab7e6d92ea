package operators

import (
	"fmt"
	"strings"

	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// BuiltinDeps assembles what the stages of a run of the built-in
// environment need beyond the resolved contract c: the run's topics, the
// built-in task registry (dispatch, rollout), its trusted validator as a
// reward evaluator, the hidden-eval denylist (validate, pack, dispatch)
// and, for the built-in tokenizer, its vocabulary size. The launch
// settings (release directory, rounds, timeouts, device) are the caller's.
func BuiltinDeps(c *contract.Contract) (Deps, error) {
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return Deps{}, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	// The registry of the built-in family the contract's environment
	// names (kv, ledger, text); the kv family's for any other environment.
	reg, err := rollout.RegistryForArtifact(c.Artifacts.Environment)
	if _, ferr := rollout.FamilyOfArtifact(c.Artifacts.Environment); ferr != nil {
		reg, err = rollout.NewRegistry(rollout.DefaultRegistryConfig())
	}
	if err != nil {
		return Deps{}, err
	}
	d := Deps{
		Contract: c, Topics: topics, Tasks: reg,
		Evaluators:   []reward.Evaluator{rollout.NewValidator(reg)},
		EvalDenylist: reg.IsEval,
	}
	// The built-in tokenizer's vocabulary bounds token ids only for runs of
	// the built-in environment (other runs bring their own tokenizer).
	if strings.HasPrefix(c.Artifacts.Tokenizer, "builtin:tokenizer/kv@") {
		d.VocabSize = rollout.VocabSize
	}
	return d, nil
}
