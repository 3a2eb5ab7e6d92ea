package main

import (
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
	return operators.Deps{
		Contract: c, Topics: t, Tasks: reg,
		Evaluators:   []reward.Evaluator{rollout.NewValidator(reg)},
		EvalDenylist: reg.IsEval, VocabSize: rollout.VocabSize,
	}, nil
}

// operatorsTopics names the run's topics (the contract's run id is
// validated to be a legal topic prefix).
func operatorsTopics(c *contract.Contract) pipeline.Topics {
	t, _ := pipeline.TopicsFor(c.RunID)
	return t
}
