package main

import (
	"strings"

	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// operatorDeps assembles what the stages need beyond the contract: the
// built-in task registry (dispatch, rollout), its trusted validator as a
// reward evaluator, the hidden-eval denylist (validate, pack, dispatch) and
// the tokenizer's vocabulary size.
func operatorDeps(c *contract.Contract, t pipeline.Topics) (operators.Deps, error) {
	reg, err := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	if err != nil {
		return operators.Deps{}, err
	}
	d := operators.Deps{
		Contract: c, Topics: t, Tasks: reg,
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

// operatorsTopics names the run's topics (the contract's run id is
// validated to be a legal topic prefix).
func operatorsTopics(c *contract.Contract) pipeline.Topics {
	t, _ := pipeline.TopicsFor(c.RunID)
	return t
}
