package train_test

import (
	"testing"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/objective"
)

// BenchmarkKLReference compares, on one batch of the small loop, the
// reference log-probs the stage computes before an update with
// kl_placement loss (a forward pass of the initial policy at the trained
// positions of every row) against the update itself (two epochs of
// forward and backward passes with the KL term). Compare the two ns/op.
func BenchmarkKLReference(b *testing.B) {
	f := newFixture(b)
	batch := f.batch(0, 0)
	opts := f.cfg.Objective
	opts.KLPlacement, opts.KLEstimator, opts.KLCoef = objective.KLLoss, objective.K3, 0.05
	b.Run("reference", func(b *testing.B) {
		for b.Loop() {
			for ri := range batch.Rows {
				r := &batch.Rows[ri]
				ref, err := f.m0.LogprobsAt(f.cfg.Behavior, r.InputIDs, r.PositionIDs, r.SegmentIDs, r.ActionMask)
				if err != nil {
					b.Fatal(err)
				}
				r.RefLogprobs = ref
			}
		}
	})
	b.Run("update", func(b *testing.B) {
		for b.Loop() {
			tr, err := gpu.NewTrainer(f.m0.Clone(), f.cfg.Behavior, 0)
			if err != nil {
				b.Fatal(err)
			}
			if _, _, err := tr.Update(batch, opts, f.cfg.Adam, f.cfg.Epochs); err != nil {
				b.Fatal(err)
			}
		}
	})
}
