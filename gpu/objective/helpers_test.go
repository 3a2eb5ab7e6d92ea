package objective

import (
	"math"
	"math/rand/v2"
	"testing"
)

// randLogits returns T*V logits drawn uniformly from [-scale, scale).
func randLogits(rng *rand.Rand, T, V int, scale float64) []float32 {
	out := make([]float32, T*V)
	for i := range out {
		out[i] = float32((rng.Float64()*2 - 1) * scale)
	}
	return out
}

// randProblem builds a valid Inputs of T positions in nseg contiguous
// segments: random input ids, targets shifted inside segments, about 70%
// of the positions with a target masked, old and ref log-probs equal to the
// current ones plus offsets in [-spread, spread], and random advantages of
// both signs (some exactly 0).
func randProblem(t testing.TB, rng *rand.Rand, T, V, nseg int, spread float64) Inputs {
	t.Helper()
	ids := make([]int32, T)
	seg := make([]int32, T)
	for i := range ids {
		ids[i] = int32(rng.IntN(V))
		seg[i] = int32(i * nseg / T)
	}
	targets, err := ShiftTargets(ids, seg)
	if err != nil {
		t.Fatal(err)
	}
	in := Inputs{
		T: T, V: V,
		Logits:      randLogits(rng, T, V, 3),
		Targets:     targets,
		Mask:        make([]uint8, T),
		OldLogprobs: make([]float32, T),
		RefLogprobs: make([]float32, T),
		Advantages:  make([]float32, T),
		SegmentIDs:  seg,
	}
	cur := make([]float32, T)
	if err := LogSoftmaxGather(in.Logits, T, V, targets, cur); err != nil {
		t.Fatal(err)
	}
	for i := range in.Mask {
		if targets[i] >= 0 && rng.Float64() < 0.7 {
			in.Mask[i] = 1
		}
		in.OldLogprobs[i] = cur[i] + float32((rng.Float64()*2-1)*spread)
		in.RefLogprobs[i] = cur[i] + float32((rng.Float64()*2-1)*spread)
		switch rng.IntN(5) {
		case 0:
			in.Advantages[i] = 0
		default:
			in.Advantages[i] = float32(rng.NormFloat64())
		}
	}
	return in
}

// naiveLogSoftmax is log_softmax(z)[y] computed directly in float64
// (log Σ exp z, no max subtraction); valid for |z| well below 700.
func naiveLogSoftmax(z []float32, y int) float64 {
	var s float64
	for _, x := range z {
		s += math.Exp(float64(x))
	}
	return float64(z[y]) - math.Log(s)
}

// naiveEntropy is -Σ p log p computed directly in float64.
func naiveEntropy(z []float32) float64 {
	var s float64
	for _, x := range z {
		s += math.Exp(float64(x))
	}
	var h float64
	for _, x := range z {
		p := math.Exp(float64(x)) / s
		h -= p * math.Log(p)
	}
	return h
}

func near(a, b, abs, rel float64) bool {
	return math.Abs(a-b) <= abs+rel*math.Max(math.Abs(a), math.Abs(b))
}

// mustCompute is Compute, failing the test on an error.
func mustCompute(t testing.TB, in Inputs, o Options, den Denominators) Result {
	t.Helper()
	res, err := Compute(in, o, den)
	if err != nil {
		t.Fatal(err)
	}
	return res
}
