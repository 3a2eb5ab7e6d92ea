package main

import (
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// operatorDeps assembles what the stages need beyond the contract.
func operatorDeps(c *contract.Contract, t pipeline.Topics) (operators.Deps, error) {
	return operators.Deps{Contract: c, Topics: t}, nil
}

// operatorsTopics names the run's topics (the contract's run id is
// validated to be a legal topic prefix).
func operatorsTopics(c *contract.Contract) pipeline.Topics {
	t, _ := pipeline.TopicsFor(c.RunID)
	return t
}
