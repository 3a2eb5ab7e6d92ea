package operators

import (
	"testing"

	"github.com/trajflow/trajflow/pipeline/contract"
)

// TestRolloutSettingsMinP: the contract's sampler.min_p reaches the
// behavior the rollouts sample and the trainer optimizes, and enters the
// sampler id (model.TestMinPIdentity pins that a behavior without min-p
// keeps the id it had before min-p existed).
func TestRolloutSettingsMinP(t *testing.T) {
	reg, err := TaskRegistry(Deps{})
	if err != nil {
		t.Fatal(err)
	}
	c := contract.Default()
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	demo := RolloutSettings(c, reg)
	if demo.MinP != 0 {
		t.Fatalf("demo sampler: min_p %v", demo.MinP)
	}
	c.Sampler.MinP = 0.2
	s := RolloutSettings(c, reg)
	if s.MinP != 0.2 || s.ID() == demo.ID() {
		t.Fatalf("min_p 0.2: behavior min_p %v, id %s (demo %s)", s.MinP, s.ID(), demo.ID())
	}
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
}
