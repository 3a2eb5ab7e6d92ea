package objective

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestOffPolicyOnPolicyRatioOne: on policy (old = current log-probs), the
// truncated importance sampling and decoupled objectives have ratio and
// importance weight exactly 1 and give the plain objective's loss and
// gradient bit for bit.
func TestOffPolicyOnPolicyRatioOne(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	in := randProblem(t, rng, 40, 7, 3, 0)
	cur := make([]float32, in.T)
	if err := LogSoftmaxGather(in.Logits, in.T, in.V, in.Targets, cur); err != nil {
		t.Fatal(err)
	}
	copy(in.OldLogprobs, cur)
	den := mustDen(t, in)
	base := Options{ClipLow: 0.2, ClipHigh: 0.28, Normalization: TokenMean, EntropyCoef: 0.01, MaxLogRatio: DefaultMaxLogRatio}
	plain, err := Compute(in, base, den)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range []Options{
		{OffPolicy: OffPolicyTIS, ISCap: 2},
		{OffPolicy: OffPolicyDecoupled},
		{OffPolicy: OffPolicyDecoupled, ISCap: 1},
	} {
		opts := base
		opts.OffPolicy, opts.ISCap = o.OffPolicy, o.ISCap
		for _, prox := range [][]float32{nil, cur} {
			in := in
			in.ProxLogprobs = prox
			res, err := Compute(in, opts, den)
			if err != nil {
				t.Fatal(err)
			}
			if res.RatioMin != 1 || res.RatioMax != 1 || res.ISWeightMean != 1 || res.ISWeightMax != 1 || res.ISTruncated != 0 {
				t.Errorf("%s cap %v prox %v: ratio [%v, %v], weight mean %v max %v, truncated %d; want all 1",
					o.OffPolicy, o.ISCap, prox != nil, res.RatioMin, res.RatioMax, res.ISWeightMean, res.ISWeightMax, res.ISTruncated)
			}
			if res.Loss != plain.Loss || !slices.Equal(res.DLogits, plain.DLogits) {
				t.Errorf("%s cap %v: loss %v, want the plain objective's %v bit for bit (gradient equal: %v)",
					o.OffPolicy, o.ISCap, res.Loss, plain.Loss, slices.Equal(res.DLogits, plain.DLogits))
			}
		}
	}
}

// offPolicyToken is one token over two logits [0, 0]: the current
// probability of the target is exactly 1/2.
func offPolicyToken(old, prox float64, adv float32) Inputs {
	in := Inputs{
		T: 2, V: 2,
		Logits:      []float32{0, 0, 0, 0},
		Targets:     []int32{1, NoTarget},
		Mask:        []uint8{1, 0},
		OldLogprobs: []float32{float32(math.Log(old)), 0},
		Advantages:  []float32{adv, 0},
		SegmentIDs:  []int32{0, 0},
	}
	if prox > 0 {
		in.ProxLogprobs = []float32{float32(math.Log(prox)), 0}
	}
	return in
}

// TestOffPolicyHandComputed: one token with current probability 1/2,
// behavior probability 1/4 (ratio 2), advantage +1, token-mean over one
// token, trust region [0.8, 1.28]:
//
//   - none: r = 2 is clipped: surrogate 1.28, no gradient;
//   - tis, cap 1.5: weight min(2, 1.5) = 1.5: surrogate 1.5, d/dcur = 1.5,
//     so dLoss/dz = -1.5·(1[v=y] - 1/2) = (+0.75, -0.75);
//   - decoupled, proximal 0.4: weight 0.4/0.25 = 1.6, r = 0.5/0.4 = 1.25
//     inside the region: surrogate 1.6·1.25 = 2, d/dcur = 2, dLoss/dz =
//     (+1, -1); with cap 1.5: 1.5·1.25 = 1.875;
//   - decoupled, proximal 0.3: weight 1.2, r = 5/3 clipped: 1.2·1.28 =
//     1.536, no gradient.
func TestOffPolicyHandComputed(t *testing.T) {
	for _, tc := range []struct {
		name      string
		off       string
		cap, prox float64
		sur, dz   float64 // surrogate, dLoss/dz at the target
		ratio, w  float64
		truncated int64
		clipped   int64
	}{
		{"none", OffPolicyNone, 0, 0, 1.28, 0, 2, 0, 0, 1},
		{"tis cap 1.5", OffPolicyTIS, 1.5, 0, 1.5, -0.75, 2, 1.5, 1, 0},
		{"tis cap 3", OffPolicyTIS, 3, 0, 2, -1, 2, 2, 0, 0},
		{"decoupled prox 0.4", OffPolicyDecoupled, 0, 0.4, 2, -1, 1.25, 1.6, 0, 0},
		{"decoupled prox 0.4 cap 1.5", OffPolicyDecoupled, 1.5, 0.4, 1.875, -0.9375, 1.25, 1.5, 1, 0},
		{"decoupled prox 0.3", OffPolicyDecoupled, 0, 0.3, 1.536, 0, 5.0 / 3, 1.2, 0, 1},
	} {
		in := offPolicyToken(0.25, tc.prox, 1)
		opts := Options{ClipLow: 0.2, ClipHigh: 0.28, Normalization: TokenMean, OffPolicy: tc.off, ISCap: tc.cap, MaxLogRatio: DefaultMaxLogRatio}
		res, err := Compute(in, opts, Denominators{Tokens: 1, Sequences: 1})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		const tol = 1e-6
		if !near(res.PolicyLoss, -tc.sur, tol, tol) {
			t.Errorf("%s: policy loss %v, want %v", tc.name, res.PolicyLoss, -tc.sur)
		}
		if !near(float64(res.DLogits[1]), tc.dz, tol, tol) || !near(float64(res.DLogits[0]), -tc.dz, tol, tol) {
			t.Errorf("%s: dLoss/dz %v, want (%v, %v)", tc.name, res.DLogits[:2], -tc.dz, tc.dz)
		}
		if !near(res.RatioMean, tc.ratio, tol, tol) || !near(res.ISWeightMean, tc.w, tol, tol) ||
			res.ISTruncated != tc.truncated || res.ClippedPos != tc.clipped {
			t.Errorf("%s: ratio %v weight %v truncated %d clipped %d, want %v %v %d %d",
				tc.name, res.RatioMean, res.ISWeightMean, res.ISTruncated, res.ClippedPos, tc.ratio, tc.w, tc.truncated, tc.clipped)
		}
		// Behavior-policy diagnostics are the same in every mode.
		if want := 0.5 * math.Log(2) * math.Log(2); !near(res.ApproxKLOld, want, tol, tol) {
			t.Errorf("%s: approx KL to old %v, want %v", tc.name, res.ApproxKLOld, want)
		}
	}
}

// TestOffPolicyGradientFiniteDifference: the analytic gradient of both
// corrections matches central differences of the loss where no branch
// changes.
func TestOffPolicyGradientFiniteDifference(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 1))
	in := randProblem(t, rng, 24, 5, 2, 0.08)
	prox := make([]float32, in.T)
	for i := range prox {
		prox[i] = in.OldLogprobs[i] + float32((rng.Float64()*2-1)*0.05)
	}
	den := mustDen(t, in)
	for _, o := range []Options{
		{ClipLow: 0.5, ClipHigh: 0.5, Normalization: SeqMeanTokenMean, EntropyCoef: 0.02, OffPolicy: OffPolicyTIS, ISCap: 5},
		{ClipLow: 0.5, ClipHigh: 0.5, Normalization: TokenMean, EntropyCoef: 0.02, OffPolicy: OffPolicyDecoupled, ISCap: 5},
	} {
		in := in
		in.ProxLogprobs = prox
		res, err := Compute(in, o, den)
		if err != nil {
			t.Fatal(err)
		}
		loss := func(z []float32) float64 {
			in2 := in
			in2.Logits = z
			r, err := Compute(in2, o, den)
			if err != nil {
				t.Fatal(err)
			}
			return r.Loss
		}
		const h = 1e-2
		for k := 0; k < 30; k++ {
			j := rng.IntN(len(in.Logits))
			if in.Mask[j/in.V] == 0 {
				continue
			}
			z := slices.Clone(in.Logits)
			z[j] += h
			up := loss(z)
			z[j] -= 2 * h
			down := loss(z)
			num := (up - down) / (2 * h)
			if !near(num, float64(res.DLogits[j]), 2e-4, 2e-2) {
				t.Errorf("%s: dLoss/dz[%d] analytic %v, numeric %v", o.OffPolicy, j, res.DLogits[j], num)
			}
		}
	}
}

// TestOffPolicyValidate: the contract's rules for the correction and its
// cap.
func TestOffPolicyValidate(t *testing.T) {
	base := Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: TokenMean}
	for _, tc := range []struct {
		off string
		cap float64
		ok  bool
	}{
		{"", 0, true}, {OffPolicyNone, 0, true}, {OffPolicyNone, 2, false},
		{OffPolicyTIS, 0, false}, {OffPolicyTIS, 0.5, false}, {OffPolicyTIS, 2, true},
		{OffPolicyDecoupled, 0, true}, {OffPolicyDecoupled, 5, true}, {OffPolicyDecoupled, math.Inf(1), false},
		{"vtrace", 0, false},
	} {
		o := base
		o.OffPolicy, o.ISCap = tc.off, tc.cap
		if err := o.Validate(); (err == nil) != tc.ok {
			t.Errorf("off_policy %q is_cap %v: error %v, want ok=%v", tc.off, tc.cap, err, tc.ok)
		}
	}
}
