package gpu

import (
	"context"
	"math"
	"testing"

	"github.com/trajflow/trajflow/gpu/gputest"
	"github.com/trajflow/trajflow/gpu/model"
)

// TestMinPRatioOne: on a batch the built-in loop sampled with min_p (and
// the task grammar), the trainer's first step has ratio exactly 1 and
// approximate KL exactly 0: it recomputes the same min-p mask from the
// current logits. The policy is sharpened so that min-p removes tokens the
// grammar allows at many trained positions (counted), and a trainer that
// ignored min-p would see ratios != 1 there.
func TestMinPRatioOne(t *testing.T) {
	loop, err := gputest.Small()
	if err != nil {
		t.Fatal(err)
	}
	loop.Settings.Temperature = 0.9
	loop.Settings.MinP = 0.3
	m, err := InitialModel(model.DefaultConfig(), 3)
	if err != nil {
		t.Fatal(err)
	}
	v := m.Views()
	for i := range v.W2 { // a peaked policy, so min-p matters
		v.W2[i] *= 40
	}
	batch, err := loop.Batch(context.Background(), model.NewPolicy(m, 0), 0)
	if err != nil {
		t.Fatal(err)
	}
	// Positions where min-p removes a token the rest of the behavior keeps.
	without := loop.Settings.Behavior
	without.MinP = 0
	V := m.Config.Vocab
	cut, trained := 0, 0
	for _, row := range batch.Rows {
		n := len(row.InputIDs)
		need := make([]bool, n)
		for i, mk := range row.ActionMask {
			need[i] = mk == 1
			if need[i] {
				trained++
			}
		}
		raw, a, b := make([]float32, n*V), make([]float32, n*V), make([]float32, n*V)
		if err := m.BehaviorLogits(loop.Settings.Behavior, row.InputIDs, row.PositionIDs, need, nil, raw, a); err != nil {
			t.Fatal(err)
		}
		if err := m.BehaviorLogits(without, row.InputIDs, row.PositionIDs, need, nil, raw, b); err != nil {
			t.Fatal(err)
		}
		for i := range need {
			if !need[i] {
				continue
			}
			for k := i * V; k < (i+1)*V; k++ {
				if math.IsInf(float64(a[k]), -1) && !math.IsInf(float64(b[k]), -1) {
					cut++
					break
				}
			}
		}
	}
	t.Logf("%d rows, %d trained positions, min-p removes tokens at %d", len(batch.Rows), trained, cut)
	if cut == 0 {
		t.Fatal("min-p removed no token: the test does not exercise it")
	}
	for _, tc := range []struct {
		name  string
		b     model.Behavior
		exact bool
	}{{"min-p", loop.Settings.Behavior, true}, {"without min-p", without, false}} {
		tr, err := NewTrainer(m, tc.b, 0)
		if err != nil {
			t.Fatal(err)
		}
		met, err := tr.Step(batch, DefaultObjective(), DefaultAdam())
		if err != nil {
			t.Fatal(err)
		}
		one := met.RatioMin == 1 && met.RatioMax == 1 && met.RatioMean == 1 && met.ApproxKLOld == 0
		t.Logf("%s: ratio [%v %v] mean %v, approx KL %v", tc.name, met.RatioMin, met.RatioMax, met.RatioMean, met.ApproxKLOld)
		if one != tc.exact {
			t.Fatalf("%s: ratio [%v %v] mean %v, approx KL %v at the first step", tc.name, met.RatioMin, met.RatioMax, met.RatioMean, met.ApproxKLOld)
		}
	}
}
