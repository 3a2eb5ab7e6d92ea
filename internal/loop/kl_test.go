package loop_test

import (
	"path/filepath"
	"testing"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// TestKLToReferenceHoldsThePolicy: the demo with loss.kl_placement loss
// (k3, coefficient 1) trains against the initial policy's log-probs. Its
// first update starts on the reference itself (KL exactly 0), later ones
// have a positive KL term in the loss, and the evaluation plane's KL of
// every release to the reference (kl_ref) stays below half of the same
// seed's run without the term: the penalty holds the policy near its
// start, as it is meant to.
func TestKLToReferenceHoldsThePolicy(t *testing.T) {
	const updates = 3
	out := t.TempDir()
	kl := testkit.Demo(t, loop.Options{Updates: updates, Seed: 1, Out: out, Edit: func(c *contract.Contract) {
		c.Loss.KLPlacement, c.Loss.KLEstimator, c.Loss.KLCoef = objective.KLLoss, objective.K3, 1
	}})
	plain := testkit.Demo(t, loop.Options{Updates: updates, Seed: 1})
	files, err := pipeline.NewDirReleases(filepath.Join(out, "releases"))
	if err != nil {
		t.Fatal(err)
	}
	for v := int64(1); v <= updates; v++ {
		u, err := gpu.ReadUpdate(files, v)
		if err != nil {
			t.Fatal(err)
		}
		if v == 1 && u.Metrics.KL != 0 {
			t.Errorf("update 1 starts on the reference: KL %v, want exactly 0", u.Metrics.KL)
		}
		if v > 1 && !(u.Metrics.KL > 0) {
			t.Errorf("update %d: KL %v, want > 0", v, u.Metrics.KL)
		}
	}
	var withKL, without float64
	for i := range kl.PerUpdate {
		withKL += kl.PerUpdate[i].KLRef
		without += plain.PerUpdate[i].KLRef
	}
	t.Logf("KL to the reference over %d releases: %.4f with the term, %.4f without", updates, withKL, without)
	if len(kl.PerUpdate) != updates || len(plain.PerUpdate) != updates || !(withKL < without/2) {
		t.Errorf("KL to the reference over %d releases: %.4f with the term, %.4f without; want less than half", len(kl.PerUpdate), withKL, without)
	}
}
