package loop

import "fmt"

// Check reports what Run would refuse in o before it starts anything: the
// counts, the option combinations and, unless the stop ids of a text run
// are still to be asked of its server, the contract o makes (Contract).
// It starts nothing and writes nothing.
func Check(o Options) error {
	if o.Updates < 1 || o.EvalSamples < 1 {
		return fmt.Errorf("loop: updates %d and eval samples %d must be positive", o.Updates, o.EvalSamples)
	}
	if o.RolloutWorkers > 1 && len(o.Env) > 0 {
		return fmt.Errorf("loop: %d rollout workers with environment services: one rollout stage per client", o.RolloutWorkers)
	}
	if err := o.check(); err != nil {
		return err
	}
	if o.Tasks == TasksText && o.StopTokenIDs == nil {
		return nil
	}
	_, err := Contract(o)
	return err
}
