package objective

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// hugeRatio is one masked token whose current log-prob is log(1/2) (two
// equal logits) and whose stored old log-prob is -1000: a finite log ratio
// of about 999.3, whose exp overflows float64.
func hugeRatio(adv float32) Inputs {
	return Inputs{
		T: 2, V: 2,
		Logits:      []float32{0, 0, 0, 0},
		Targets:     []int32{1, NoTarget},
		Mask:        []uint8{1, 0},
		OldLogprobs: []float32{-1000, 0},
		Advantages:  []float32{adv, 0},
		SegmentIDs:  []int32{0, 0},
	}
}

// Without a clamp a huge finite log ratio makes the loss or the gradient
// non-finite: the batch is refused with ErrInput (ErrNonFinite), never
// returned as a loss to apply.
func TestNonFiniteLossIsAnError(t *testing.T) {
	den := Denominators{Tokens: 1, Sequences: 1}
	for _, adv := range []float32{-1, 0} { // -Inf loss; 0·Inf = NaN
		opts := Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: TokenMean, MaxLogRatio: 0}
		res, err := Compute(hugeRatio(adv), opts, den)
		if !errors.Is(err, ErrInput) || !errors.Is(err, ErrNonFinite) {
			t.Fatalf("advantage %v, no clamp: loss %v, err %v; want ErrNonFinite wrapping ErrInput", adv, res.Loss, err)
		}
		if !strings.Contains(err.Error(), "max_log_ratio") {
			t.Errorf("error %q does not point at max_log_ratio", err)
		}
	}
	// K3 KL in the loss overflows the same way when ref - cur is huge.
	in := hugeRatio(1)
	in.OldLogprobs[0] = float32(math.Log(0.5))
	in.RefLogprobs = []float32{-1, 0}
	in.Logits = []float32{1000, 0, 0, 0} // cur = -1000: ref - cur = 999
	opts := Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: TokenMean, KLPlacement: KLLoss, KLEstimator: K3, KLCoef: 0.1, MaxLogRatio: DefaultMaxLogRatio}
	if res, err := Compute(in, opts, den); !errors.Is(err, ErrNonFinite) {
		t.Fatalf("k3 KL of exp(999): loss %v, err %v; want ErrNonFinite", res.Loss, err)
	}
}

// With the default clamp the same token trains: the ratio is exp(20), the
// token's surrogate gradient is cut (as for a clipped token) and the loss is
// finite; a ratio of exactly 1 is untouched.
func TestDefaultClampKeepsLossFinite(t *testing.T) {
	den := Denominators{Tokens: 1, Sequences: 1}
	opts := Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: TokenMean, MaxLogRatio: DefaultMaxLogRatio}
	res, err := Compute(hugeRatio(-1), opts, den)
	if err != nil {
		t.Fatal(err)
	}
	// s = min(r A, clip(r) A) with r = e^20, A = -1: r A = -e^20.
	if want := math.Exp(20); res.Loss != want || res.LogRatioClamped != 1 || res.RatioMax != want {
		t.Fatalf("loss %v ratio max %v clamped %d, want loss %v (= e^20), ratio e^20, 1 clamped", res.Loss, res.RatioMax, res.LogRatioClamped, want)
	}
	for v, d := range res.DLogits {
		if d != 0 {
			t.Errorf("dlogits[%d] = %v, want 0 (clamped token, no entropy term)", v, d)
		}
	}
	// On policy: old = cur exactly, ratio exactly 1, nothing clamped.
	in := hugeRatio(-1)
	in.OldLogprobs[0] = float32(math.Log(0.5))
	res, err = Compute(in, opts, den)
	if err != nil {
		t.Fatal(err)
	}
	if res.RatioMin != 1 || res.RatioMax != 1 || res.LogRatioClamped != 0 || res.Loss != 1 {
		t.Fatalf("on-policy token: ratio [%v, %v], %d clamped, loss %v; want ratio 1, none clamped, loss 1", res.RatioMin, res.RatioMax, res.LogRatioClamped, res.Loss)
	}
}
