package operators

import (
	"fmt"

	"github.com/trajflow/trajflow/pipeline"
)

// NewOperator is the one way to start an operator of a run — `trajflow
// run`, the demo, the fleet launcher, the bench and the tests all call it:
// it builds the stage registered under name and its runtime, filling what
// the run determines when rc leaves it empty: the consumer group
// "<run>.<name>", the quarantine topic, the topics' record size limit, and
// the release store of d.ReleaseDir.
func NewOperator(name string, d Deps, rc pipeline.Config) (*pipeline.Operator, error) {
	st, err := New(name, d)
	if err != nil {
		return nil, err
	}
	c := d.Contract
	if rc.GroupID == "" {
		rc.GroupID = c.RunID + "." + name
	}
	if rc.QuarantineTopic == "" {
		rc.QuarantineTopic = d.Topics.Quarantine
	}
	if rc.MaxMessageBytes == 0 {
		rc.MaxMessageBytes = c.Topics.MaxMessageBytes
	}
	if rc.Releases == nil && d.ReleaseDir != "" {
		if rc.Releases, err = pipeline.NewDirReleases(d.ReleaseDir); err != nil {
			return nil, fmt.Errorf("operators: %s: %w", name, err)
		}
	}
	return pipeline.NewOperator(rc, st)
}
