package objective

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/trajflow/trajflow/schemas"
)

var allNorms = []string{TokenMean, SeqMeanTokenSum, SeqMeanTokenMean}

func baseOpts(norm string) Options {
	return Options{ClipLow: 0.2, ClipHigh: 0.28, Normalization: norm, KLPlacement: KLNone}
}

func mustDen(t testing.TB, in Inputs) Denominators {
	t.Helper()
	d, err := CountDenominators(in.Mask, in.SegmentIDs)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestIdentityPolicy: with old log-probs built from the logits' own
// LogSoftmaxGather and ref == current, every ratio is exactly 1 and every
// KL estimate exactly 0 (the float32 rounding of the current log-probs
// matches the stored ones bit for bit).
func TestIdentityPolicy(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, norm := range allNorms {
		for _, est := range []string{K1, K2, K3} {
			t.Run(norm+"/"+est, func(t *testing.T) {
				in := randProblem(t, rng, 40, 17, 3, 0)
				cur := make([]float32, in.T)
				if err := LogSoftmaxGather(in.Logits, in.T, in.V, in.Targets, cur); err != nil {
					t.Fatal(err)
				}
				copy(in.OldLogprobs, cur)
				copy(in.RefLogprobs, cur)
				opts := baseOpts(norm)
				opts.KLPlacement, opts.KLEstimator, opts.KLCoef = KLLoss, est, 0.5
				res, err := Compute(in, opts, mustDen(t, in))
				if err != nil {
					t.Fatal(err)
				}
				if res.Tokens == 0 {
					t.Fatal("no masked token drawn")
				}
				if res.RatioMin != 1 || res.RatioMax != 1 || res.RatioMean != 1 {
					t.Errorf("ratio min/mean/max = %v/%v/%v, want exactly 1", res.RatioMin, res.RatioMean, res.RatioMax)
				}
				if res.KL != 0 || res.ApproxKLOld != 0 {
					t.Errorf("KL = %v, ApproxKLOld = %v, want exactly 0", res.KL, res.ApproxKLOld)
				}
				if res.ClippedPos != 0 || res.ClippedNeg != 0 || res.LogRatioClamped != 0 {
					t.Errorf("clipped %d/%d clamped %d at ratio 1", res.ClippedPos, res.ClippedNeg, res.LogRatioClamped)
				}
				if !slices.Equal(res.CurLogprobs, cur) {
					t.Errorf("CurLogprobs differ from LogSoftmaxGather")
				}
				// At ratio 1 the policy loss is -Σ c_t A_t.
				den := mustDen(t, in)
				perSeg, _ := segmentCounts(in.Mask, in.SegmentIDs)
				var want float64
				for i, m := range in.Mask {
					if m == 0 {
						continue
					}
					a := float64(in.Advantages[i])
					switch norm {
					case TokenMean:
						want -= a / float64(den.Tokens)
					case SeqMeanTokenSum:
						want -= a / float64(den.Sequences)
					case SeqMeanTokenMean:
						want -= a / float64(perSeg[in.SegmentIDs[i]]) / float64(den.Sequences)
					}
				}
				if !near(res.PolicyLoss, want, 1e-12, 1e-12) {
					t.Errorf("PolicyLoss = %v, want %v", res.PolicyLoss, want)
				}
			})
		}
	}
}

// clipCase is one hand-built token of TestClipping.
type clipCase struct {
	adv     float32
	ratio   float64 // target ratio; the realized one is within float32 rounding
	clipped bool    // the clipped branch is the strict minimum
}

// TestClipping builds tokens with ratios inside and outside the trust
// region [0.8, 1.2] for both advantage signs and checks the surrogate, the
// clip counts, and that the gradient is exactly zero where clipping binds.
func TestClipping(t *testing.T) {
	cases := []clipCase{
		{+1, 1.5, true},  // A>0, r above 1+ε: min picks 1.2·A
		{+1, 0.5, false}, // A>0, r below 1-ε: unclipped 0.5 < 0.8
		{+1, 1.1, false}, // inside
		{-1, 0.5, true},  // A<0, r below 1-ε: min picks 0.8·A = -0.8 < -0.5
		{-1, 1.5, false}, // A<0, r above 1+ε: unclipped -1.5 < -1.2
		{-2, 0.9, false}, // inside
		{0, 1.5, false},  // A=0: neither sign, zero surrogate and gradient
	}
	T, V := len(cases)+1, 6
	rng := rand.New(rand.NewPCG(5, 6))
	in := Inputs{
		T: T, V: V,
		Logits:      randLogits(rng, T, V, 2),
		Targets:     make([]int32, T),
		Mask:        make([]uint8, T),
		OldLogprobs: make([]float32, T),
		Advantages:  make([]float32, T),
		SegmentIDs:  make([]int32, T),
	}
	for i := range in.Targets {
		in.Targets[i] = int32(rng.IntN(V))
	}
	in.Targets[T-1] = NoTarget
	cur := make([]float32, T)
	if err := LogSoftmaxGather(in.Logits, T, V, in.Targets, cur); err != nil {
		t.Fatal(err)
	}
	for i, c := range cases {
		in.Mask[i] = 1
		in.Advantages[i] = c.adv
		in.OldLogprobs[i] = float32(float64(cur[i]) - math.Log(c.ratio))
	}
	opts := Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: TokenMean}
	res, err := Compute(in, opts, mustDen(t, in))
	if err != nil {
		t.Fatal(err)
	}
	if res.PosTokens != 3 || res.ClippedPos != 1 || res.NegTokens != 3 || res.ClippedNeg != 1 {
		t.Fatalf("pos %d clipped %d, neg %d clipped %d; want 3/1, 3/1",
			res.PosTokens, res.ClippedPos, res.NegTokens, res.ClippedNeg)
	}
	if res.ClipFracPos != 1.0/3 || res.ClipFracNeg != 1.0/3 {
		t.Fatalf("clip fractions %v %v, want 1/3 1/3", res.ClipFracPos, res.ClipFracNeg)
	}
	n := float64(len(cases))
	var wantLoss float64
	for i, c := range cases {
		r := math.Exp(float64(cur[i]) - float64(in.OldLogprobs[i]))
		a := float64(c.adv)
		s := r * a
		if c.clipped {
			s = math.Max(0.8, math.Min(1.2, r)) * a
		}
		wantLoss -= s / n
		d := res.DLogits[i*V : (i+1)*V]
		zero := !slices.ContainsFunc(d, func(x float32) bool { return x != 0 })
		if c.clipped || c.adv == 0 {
			if !zero {
				t.Errorf("token %d (A=%v r=%.3f): gradient %v, want exactly 0", i, c.adv, r, d)
			}
			continue
		}
		// Unclipped: dL/dz_v = -(1/n)·r·A·(1[v=y] - p_v).
		z := in.Logits[i*V : (i+1)*V]
		for v := range d {
			p := math.Exp(naiveLogSoftmax(z, v))
			ind := 0.0
			if int32(v) == in.Targets[i] {
				ind = 1
			}
			want := -r * a * (ind - p) / n
			if !near(float64(d[v]), want, 1e-7, 1e-5) {
				t.Errorf("token %d vocab %d: gradient %v, want %v", i, v, d[v], want)
			}
		}
	}
	if !near(res.PolicyLoss, wantLoss, 1e-12, 1e-12) || res.Loss != res.PolicyLoss {
		t.Fatalf("PolicyLoss %v Loss %v, want %v", res.PolicyLoss, res.Loss, wantLoss)
	}
	if d := res.DLogits[(T-1)*V:]; slices.ContainsFunc(d, func(x float32) bool { return x != 0 }) {
		t.Fatalf("unmasked position has gradient %v", d)
	}
}

// TestSurrogateBoundary pins the tie convention: a ratio exactly on a bound
// is not clipped and passes gradient r·A; one ulp beyond is clipped.
func TestSurrogateBoundary(t *testing.T) {
	lo, hi := 0.8, 1.2
	for _, tc := range []struct {
		name        string
		r, a        float64
		wantS, want float64
		clipped     bool
	}{
		{"A>0 at hi", hi, 2, hi * 2, hi * 2, false},
		{"A>0 above hi", math.Nextafter(hi, 2), 2, hi * 2, 0, true},
		{"A<0 at lo", lo, -3, lo * -3, lo * -3, false},
		{"A<0 below lo", math.Nextafter(lo, 0), -3, lo * -3, 0, true},
		{"A>0 below lo", 0.5, 1, 0.5, 0.5, false},
		{"A<0 above hi", 1.5, -1, -1.5, -1.5, false},
		{"A=0 outside", 3, 0, 0, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, d, c := surrogate(tc.r, tc.a, lo, hi)
			if s != tc.wantS || d != tc.want || c != tc.clipped {
				t.Fatalf("surrogate(%v, %v) = %v, %v, %v; want %v, %v, %v", tc.r, tc.a, s, d, c, tc.wantS, tc.want, tc.clipped)
			}
		})
	}
}

// fdProblem is a small float64 problem whose ratios stay at least 1e-3
// away from every kink (clip bounds, MaxLogRatio), so that central finite
// differences of the piecewise-smooth loss are valid.
func fdProblem(t *testing.T, rng *rand.Rand, opts Options) coreInputs[float64] {
	t.Helper()
	const T, V = 6, 5
	logits := make([]float64, T*V)
	for i := range logits {
		logits[i] = rng.NormFloat64() * 1.5
	}
	in := coreInputs[float64]{
		T: T, V: V, logits: logits,
		targets: []int32{2, 0, -1, 4, 1, -1},
		mask:    []uint8{1, 1, 0, 1, 1, 0},
		seg:     []int32{0, 0, 0, 1, 1, 1},
		old:     make([]float32, T),
		ref:     make([]float32, T),
		adv:     []float32{1.3, -0.7, 0, -1.1, 0.4, 0},
	}
	// Log ratios cur - old: e^0.45≈1.57 with A>0 (clipped), e^-0.35≈0.70
	// with A<0 (clipped), e^0.5≈1.65 with A<0 (unclipped branch, but clamped
	// when MaxLogRatio = 0.3), e^-0.05 (inside).
	lrs := []float64{0.45, -0.35, 0, 0.5, -0.05, 0}
	cur := make([]float64, T)
	for i := range cur {
		if in.targets[i] < 0 {
			continue
		}
		z := logits[i*V : (i+1)*V]
		m, _, logS, err := softmaxRow(z, nil, i)
		if err != nil {
			t.Fatal(err)
		}
		cur[i] = z[in.targets[i]] - m - logS
		in.old[i] = float32(cur[i] - lrs[i])
		in.ref[i] = float32(cur[i] + rng.Float64() - 0.5)
		lr := cur[i] - float64(in.old[i])
		for _, kink := range []float64{math.Log(1 - opts.ClipLow), math.Log(1 + opts.ClipHigh), opts.MaxLogRatio, -opts.MaxLogRatio} {
			if math.Abs(lr-kink) < 1e-3 {
				t.Fatalf("position %d: log ratio %v within 1e-3 of kink %v", i, lr, kink)
			}
		}
	}
	return in
}

// TestGradientFiniteDifference checks DLogits against central differences
// of Loss in float64 (the float64 instantiation of the same code), for
// every normalization and KL estimator, with the KL term in the loss and
// the entropy bonus on, with and without a MaxLogRatio clamp.
//
// Tolerance: h = 1e-6 gives truncation error O(h² · third derivative) ≈ 1e-12 and
// rounding error O(ε·|L|/h) ≈ 1e-10, so |fd - analytic| <= 1e-8 +
// 1e-6·|analytic| is loose by two orders of magnitude yet catches any
// wrong term (all terms here are of order 1e-2..1).
func TestGradientFiniteDifference(t *testing.T) {
	const h = 1e-6
	rng := rand.New(rand.NewPCG(7, 8))
	for _, norm := range allNorms {
		for _, est := range []string{K1, K2, K3} {
			for _, maxLR := range []float64{0, 0.3} {
				name := fmt.Sprintf("%s/%s/maxlr=%v", norm, est, maxLR)
				t.Run(name, func(t *testing.T) {
					opts := Options{ClipLow: 0.2, ClipHigh: 0.28, Normalization: norm,
						KLPlacement: KLLoss, KLEstimator: est, KLCoef: 0.3, EntropyCoef: 0.05, MaxLogRatio: maxLR}
					in := fdProblem(t, rng, opts)
					den := Denominators{Tokens: 9, Sequences: 3} // global: more than this call's 4 / 2
					cur := make([]float64, in.T)
					grad := make([]float64, in.T*in.V)
					st, err := compute(in, opts, den, cur, grad)
					if err != nil {
						t.Fatal(err)
					}
					if st.ClippedPos != 1 || st.ClippedNeg != 1 {
						t.Fatalf("problem should clip one token of each sign: %+v", st)
					}
					if maxLR > 0 && st.LogRatioClamped != 3 {
						t.Fatalf("MaxLogRatio %v clamped %d tokens, want 3", maxLR, st.LogRatioClamped)
					}
					scratchC := make([]float64, in.T)
					scratchG := make([]float64, in.T*in.V)
					loss := func() float64 {
						s, err := compute(in, opts, den, scratchC, scratchG)
						if err != nil {
							t.Fatal(err)
						}
						return s.Loss
					}
					var maxErr float64
					for j := range in.logits {
						orig := in.logits[j]
						in.logits[j] = orig + h
						lp := loss()
						in.logits[j] = orig - h
						lm := loss()
						in.logits[j] = orig
						fd := (lp - lm) / (2 * h)
						if !near(fd, grad[j], 1e-8, 1e-6) {
							t.Errorf("dL/dz[%d,%d]: analytic %.12g, finite difference %.12g", j/in.V, j%in.V, grad[j], fd)
						}
						maxErr = math.Max(maxErr, math.Abs(fd-grad[j]))
					}
					t.Logf("max |fd - analytic| = %.2g", maxErr)
				})
			}
		}
	}
}

// TestFloat32MatchesFloat64: the public float32 path agrees with the
// float64 instantiation up to float32 rounding of logits, log-probs and
// gradients.
func TestFloat32MatchesFloat64(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	in := randProblem(t, rng, 64, 31, 4, 0.4)
	opts := baseOpts(SeqMeanTokenMean)
	opts.KLPlacement, opts.KLEstimator, opts.KLCoef, opts.EntropyCoef = KLLoss, K3, 0.1, 0.01
	den := mustDen(t, in)
	res, err := Compute(in, opts, den)
	if err != nil {
		t.Fatal(err)
	}
	l64 := make([]float64, len(in.Logits))
	for i, x := range in.Logits {
		l64[i] = float64(x)
	}
	cur := make([]float64, in.T)
	grad := make([]float64, len(l64))
	st, err := compute(coreInputs[float64]{T: in.T, V: in.V, logits: l64, targets: in.Targets, mask: in.Mask,
		old: in.OldLogprobs, ref: in.RefLogprobs, adv: in.Advantages, seg: in.SegmentIDs}, opts, den, cur, grad)
	if err != nil {
		t.Fatal(err)
	}
	if !near(res.Loss, st.Loss, 1e-6, 1e-5) {
		t.Fatalf("float32 loss %v, float64 loss %v", res.Loss, st.Loss)
	}
	for j := range grad {
		if !near(float64(res.DLogits[j]), grad[j], 1e-7, 1e-4) {
			t.Fatalf("gradient %d: float32 %v, float64 %v", j, res.DLogits[j], grad[j])
		}
	}
}

// TestNormalizationHandComputed: one row, two sequences, ratio 1 (old =
// current), no KL, no entropy, so each token's surrogate is its advantage.
//
//	positions: 0 1 2 | 3 4 5 6 7
//	segment:   0 0 0 | 1 1 1 1 1
//	mask:      0 1 0 | 0 1 1 1 0
//	advantage:   2   |  -1 -1 -1
//
// Global denominators: N_tok = 4 masked tokens, N_seq = 2 sequences.
//
//	token-mean:          -(2 + (-1-1-1)) / 4           = -(-1)/4 =  0.25
//	seq-mean-token-sum:  -((2) + (-3)) / 2             = -(-1)/2 =  0.5
//	seq-mean-token-mean: -((2/1) + (-3/3)) / 2         = -(1)/2  = -0.5
//	token-sum, norm_tokens 8: -(2 + (-1-1-1)) / 8      = -(-1)/8 =  0.125
//	token-sum, norm_tokens 2: -(2 + (-1-1-1)) / 2      = -(-1)/2 =  0.5
//
// and the gradient of token-sum is token-mean's times N_tok/norm_tokens
// (4/8 and 4/2).
func TestNormalizationHandComputed(t *testing.T) {
	ids := []int32{3, 1, 4, 1, 5, 2, 6, 5}
	seg := []int32{0, 0, 0, 1, 1, 1, 1, 1}
	targets, err := ShiftTargets(ids, seg)
	if err != nil {
		t.Fatal(err)
	}
	const T, V = 8, 7
	rng := rand.New(rand.NewPCG(11, 12))
	in := Inputs{
		T: T, V: V, Logits: randLogits(rng, T, V, 2), Targets: targets,
		Mask:        []uint8{0, 1, 0, 0, 1, 1, 1, 0},
		OldLogprobs: make([]float32, T),
		Advantages:  []float32{0, 2, 0, 0, -1, -1, -1, 0},
		SegmentIDs:  seg,
	}
	if err := LogSoftmaxGather(in.Logits, T, V, targets, in.OldLogprobs); err != nil {
		t.Fatal(err)
	}
	den := mustDen(t, in)
	if den != (Denominators{Tokens: 4, Sequences: 2}) {
		t.Fatalf("denominators %+v", den)
	}
	mean, err := Compute(in, baseOpts(TokenMean), den)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		norm    string
		normTok int64
		want    float64
	}{
		{TokenMean, 0, 0.25},
		{SeqMeanTokenSum, 0, 0.5},
		{SeqMeanTokenMean, 0, -0.5},
		{TokenSum, 8, 0.125},
		{TokenSum, 2, 0.5},
	} {
		t.Run(fmt.Sprintf("%s/%d", tc.norm, tc.normTok), func(t *testing.T) {
			o := baseOpts(tc.norm)
			o.NormTokens = tc.normTok
			res, err := Compute(in, o, den)
			if err != nil {
				t.Fatal(err)
			}
			if !near(res.Loss, tc.want, 1e-15, 0) || res.PolicyLoss != res.Loss {
				t.Fatalf("loss %v (policy %v), want %v", res.Loss, res.PolicyLoss, tc.want)
			}
			if tc.norm != TokenSum {
				return
			}
			scale := float64(den.Tokens) / float64(tc.normTok)
			for i := range res.DLogits {
				if want := float64(mean.DLogits[i]) * scale; !near(float64(res.DLogits[i]), want, 1e-6, 1e-12) {
					t.Fatalf("dlogits[%d] = %v, want token-mean's %v times %v", i, res.DLogits[i], mean.DLogits[i], scale)
				}
			}
		})
	}
}

// TestMicrobatchSum: per-row losses computed with the global denominators
// add up to the loss of all rows at once; the gradients are identical; with
// per-microbatch (local) denominators they would not add up.
func TestMicrobatchSum(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	var rows []Inputs
	var den Denominators
	for _, shape := range []struct{ T, nseg int }{{30, 2}, {17, 1}, {45, 5}} {
		r := randProblem(t, rng, shape.T, 11, shape.nseg, 0.5)
		rows = append(rows, r)
		den = den.Add(mustDen(t, r))
	}
	full, err := Concat(rows...)
	if err != nil {
		t.Fatal(err)
	}
	if d := mustDen(t, full); d != den {
		t.Fatalf("concat denominators %+v, summed %+v", d, den)
	}
	for _, norm := range allNorms {
		for _, est := range []string{K1, K3} {
			t.Run(norm+"/"+est, func(t *testing.T) {
				opts := baseOpts(norm)
				opts.KLPlacement, opts.KLEstimator, opts.KLCoef, opts.EntropyCoef = KLLoss, est, 0.2, 0.01
				opts.MaxLogRatio = 0.4
				want, err := Compute(full, opts, den)
				if err != nil {
					t.Fatal(err)
				}
				var sum Stats
				var grads []float32
				var localSum float64
				for _, r := range rows {
					res, err := Compute(r, opts, den)
					if err != nil {
						t.Fatal(err)
					}
					sum = sum.Merge(res.Stats)
					grads = append(grads, res.DLogits...)
					local, err := Compute(r, opts, mustDen(t, r))
					if err != nil {
						t.Fatal(err)
					}
					localSum += local.Loss
				}
				for _, c := range []struct {
					name      string
					got, want float64
				}{
					{"loss", sum.Loss, want.Loss},
					{"policy", sum.PolicyLoss, want.PolicyLoss},
					{"kl", sum.KL, want.KL},
					{"entropy", sum.Entropy, want.Entropy},
					{"ratio mean", sum.RatioMean, want.RatioMean},
					{"approx kl", sum.ApproxKLOld, want.ApproxKLOld},
				} {
					if !near(c.got, c.want, 1e-13, 1e-12) {
						t.Errorf("%s: microbatch sum %v, full batch %v", c.name, c.got, c.want)
					}
				}
				if sum.Tokens != want.Tokens || sum.Sequences != want.Sequences ||
					sum.RatioMin != want.RatioMin || sum.RatioMax != want.RatioMax ||
					sum.ClippedPos != want.ClippedPos || sum.ClippedNeg != want.ClippedNeg ||
					sum.PosTokens != want.PosTokens || sum.NegTokens != want.NegTokens ||
					sum.ClipFracPos != want.ClipFracPos || sum.ClipFracNeg != want.ClipFracNeg ||
					sum.LogRatioClamped != want.LogRatioClamped {
					t.Errorf("merged stats %+v\nfull stats %+v", sum, want.Stats)
				}
				if !slices.Equal(grads, want.DLogits) {
					t.Errorf("microbatch gradients differ from the full batch's")
				}
				if near(localSum, want.Loss, 1e-6, 1e-6) {
					t.Errorf("local denominators also sum to %v: the test cannot tell global from local", localSum)
				}
			})
		}
	}
}

// TestDeterministic: two evaluations are bit-identical, and ComputeInto
// reusing buffers matches Compute.
func TestDeterministic(t *testing.T) {
	rng := rand.New(rand.NewPCG(15, 16))
	in := randProblem(t, rng, 50, 13, 3, 0.6)
	opts := baseOpts(SeqMeanTokenSum)
	opts.KLPlacement, opts.KLEstimator, opts.KLCoef, opts.EntropyCoef = KLLoss, K2, 0.1, 0.02
	den := mustDen(t, in)
	a, err := Compute(in, opts, den)
	if err != nil {
		t.Fatal(err)
	}
	b := Result{DLogits: make([]float32, 10*len(in.Logits)), CurLogprobs: make([]float32, 3)}
	for i := range b.DLogits {
		b.DLogits[i] = 7 // stale content must be overwritten
	}
	if err := ComputeInto(in, opts, den, &b); err != nil {
		t.Fatal(err)
	}
	if a.Stats != b.Stats || !slices.Equal(a.DLogits, b.DLogits) || !slices.Equal(a.CurLogprobs, b.CurLogprobs) {
		t.Fatal("repeated evaluation differs")
	}
}

// TestKLPlacement: the KL term is reported whenever a reference and an
// estimator are given, and enters Loss only with KLPlacement == KLLoss.
func TestKLPlacement(t *testing.T) {
	rng := rand.New(rand.NewPCG(17, 18))
	in := randProblem(t, rng, 30, 9, 2, 0.5)
	den := mustDen(t, in)
	opts := baseOpts(TokenMean)
	opts.KLEstimator, opts.KLCoef = K3, 0.5
	opts.KLPlacement = KLReward
	rew, err := Compute(in, opts, den)
	if err != nil {
		t.Fatal(err)
	}
	opts.KLPlacement = KLLoss
	loss, err := Compute(in, opts, den)
	if err != nil {
		t.Fatal(err)
	}
	if rew.KL <= 0 || rew.KL != loss.KL {
		t.Fatalf("KL reported %v (reward) vs %v (loss); want equal and > 0 (k3 >= 0)", rew.KL, loss.KL)
	}
	if rew.Loss != rew.PolicyLoss {
		t.Fatalf("reward placement: loss %v != policy loss %v", rew.Loss, rew.PolicyLoss)
	}
	if !near(loss.Loss, loss.PolicyLoss+0.5*loss.KL, 1e-15, 1e-15) {
		t.Fatalf("loss placement: loss %v, want %v", loss.Loss, loss.PolicyLoss+0.5*loss.KL)
	}
	noRef := in
	noRef.RefLogprobs = nil
	if _, err := Compute(noRef, opts, den); !errors.Is(err, ErrInput) {
		t.Fatalf("KLLoss without reference: err = %v", err)
	}
	opts.KLPlacement = KLNone
	r, err := Compute(noRef, opts, den)
	if err != nil || r.KL != 0 {
		t.Fatalf("no reference: KL %v err %v", r.KL, err)
	}
}

func TestComputeErrors(t *testing.T) {
	rng := rand.New(rand.NewPCG(19, 20))
	good := randProblem(t, rng, 12, 5, 2, 0.3)
	den := mustDen(t, good)
	opts := baseOpts(TokenMean)
	clone := func() Inputs {
		c := good
		c.Logits = slices.Clone(good.Logits)
		c.Targets = slices.Clone(good.Targets)
		c.Mask = slices.Clone(good.Mask)
		c.OldLogprobs = slices.Clone(good.OldLogprobs)
		c.RefLogprobs = slices.Clone(good.RefLogprobs)
		c.Advantages = slices.Clone(good.Advantages)
		c.SegmentIDs = slices.Clone(good.SegmentIDs)
		return c
	}
	firstMasked := slices.Index(good.Mask, 1)
	if firstMasked < 0 {
		t.Fatal("no masked token")
	}
	for _, tc := range []struct {
		name string
		edit func(*Inputs, *Options, *Denominators)
		want error
	}{
		{"ok", func(*Inputs, *Options, *Denominators) {}, nil},
		{"logits length", func(in *Inputs, _ *Options, _ *Denominators) { in.Logits = in.Logits[1:] }, ErrShape},
		{"targets length", func(in *Inputs, _ *Options, _ *Denominators) { in.Targets = in.Targets[1:] }, ErrShape},
		{"mask length", func(in *Inputs, _ *Options, _ *Denominators) { in.Mask = append(in.Mask, 0) }, ErrShape},
		{"old length", func(in *Inputs, _ *Options, _ *Denominators) { in.OldLogprobs = nil }, ErrShape},
		{"ref length", func(in *Inputs, _ *Options, _ *Denominators) { in.RefLogprobs = in.RefLogprobs[:3] }, ErrShape},
		{"advantages length", func(in *Inputs, _ *Options, _ *Denominators) { in.Advantages = in.Advantages[1:] }, ErrShape},
		{"segments length", func(in *Inputs, _ *Options, _ *Denominators) { in.SegmentIDs = in.SegmentIDs[1:] }, ErrShape},
		{"target >= V", func(in *Inputs, _ *Options, _ *Denominators) { in.Targets[0] = int32(in.V) }, ErrTarget},
		{"masked without target", func(in *Inputs, _ *Options, _ *Denominators) { in.Targets[firstMasked] = NoTarget }, ErrTarget},
		{"mask value 2", func(in *Inputs, _ *Options, _ *Denominators) { in.Mask[0] = 2 }, ErrInput},
		{"segment id >= T", func(in *Inputs, _ *Options, _ *Denominators) { in.SegmentIDs[0] = int32(in.T) }, ErrInput},
		{"negative segment id", func(in *Inputs, _ *Options, _ *Denominators) { in.SegmentIDs[0] = -1 }, ErrInput},
		{"NaN logit", func(in *Inputs, _ *Options, _ *Denominators) { in.Logits[0] = float32(math.NaN()) }, ErrInput},
		{"NaN old", func(in *Inputs, _ *Options, _ *Denominators) { in.OldLogprobs[firstMasked] = float32(math.NaN()) }, ErrInput},
		{"Inf advantage", func(in *Inputs, _ *Options, _ *Denominators) { in.Advantages[firstMasked] = float32(math.Inf(1)) }, ErrInput},
		{"NaN ref with KL", func(in *Inputs, o *Options, _ *Denominators) {
			in.RefLogprobs[firstMasked] = float32(math.NaN())
			o.KLPlacement, o.KLEstimator = KLLoss, K1
		}, ErrInput},
		{"-Inf current log-prob", func(in *Inputs, _ *Options, _ *Denominators) {
			in.Logits[firstMasked*in.V+int(in.Targets[firstMasked])] = float32(math.Inf(-1))
		}, ErrInput},
		{"denominator too small", func(_ *Inputs, _ *Options, d *Denominators) { d.Tokens-- }, ErrInput},
		{"sequences too small", func(_ *Inputs, _ *Options, d *Denominators) { d.Sequences = 0 }, ErrInput},
		{"no normalization", func(_ *Inputs, o *Options, _ *Denominators) { o.Normalization = "" }, ErrOptions},
		{"token-sum without norm_tokens", func(_ *Inputs, o *Options, _ *Denominators) { o.Normalization = TokenSum }, ErrOptions},
		{"norm_tokens with token-mean", func(_ *Inputs, o *Options, _ *Denominators) { o.NormTokens = 64 }, ErrOptions},
		{"negative norm_tokens", func(_ *Inputs, o *Options, _ *Denominators) { o.Normalization, o.NormTokens = TokenSum, -1 }, ErrOptions},
		{"clip_low 1", func(_ *Inputs, o *Options, _ *Denominators) { o.ClipLow = 1 }, ErrOptions},
		{"negative clip_high", func(_ *Inputs, o *Options, _ *Denominators) { o.ClipHigh = -0.1 }, ErrOptions},
		{"NaN kl_coef", func(_ *Inputs, o *Options, _ *Denominators) { o.KLCoef = math.NaN() }, ErrOptions},
		{"negative entropy_coef", func(_ *Inputs, o *Options, _ *Denominators) { o.EntropyCoef = -1 }, ErrOptions},
		// Finite, but +Inf as the float32 the CUDA kernels take.
		{"entropy_coef beyond float32", func(_ *Inputs, o *Options, _ *Denominators) { o.EntropyCoef = 1e300 }, ErrOptions},
		{"negative max_log_ratio", func(_ *Inputs, o *Options, _ *Denominators) { o.MaxLogRatio = -1 }, ErrOptions},
		{"bad placement", func(_ *Inputs, o *Options, _ *Denominators) { o.KLPlacement = "both" }, ErrOptions},
		{"bad estimator", func(_ *Inputs, o *Options, _ *Denominators) { o.KLEstimator = "k4" }, ErrOptions},
		{"loss placement without estimator", func(_ *Inputs, o *Options, _ *Denominators) { o.KLPlacement = KLLoss }, ErrOptions},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in, o, d := clone(), opts, den
			tc.edit(&in, &o, &d)
			_, err := Compute(in, o, d)
			if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestNoMaskedTokens(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	in := randProblem(t, rng, 10, 4, 1, 0.3)
	clear(in.Mask)
	res, err := Compute(in, baseOpts(SeqMeanTokenMean), Denominators{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Stats != (Stats{}) || slices.ContainsFunc(res.DLogits, func(x float32) bool { return x != 0 }) {
		t.Fatalf("stats %+v, want zero and no gradient", res.Stats)
	}
}

func TestDenominatorsAndRows(t *testing.T) {
	rows := []schemas.PackedRow{
		{ // two segments with trained tokens, one without
			InputIDs:    []int32{1, 2, 3, 4, 5, 6, 7},
			SegmentIDs:  []int32{0, 0, 1, 1, 1, 2, 2},
			ActionMask:  []uint8{1, 0, 0, 1, 0, 0, 0},
			OldLogprobs: make([]float32, 7), Advantages: make([]float32, 7),
		},
		{ // non-contiguous use of segment ids is counted per id
			InputIDs:    []int32{1, 2, 3, 4},
			SegmentIDs:  []int32{0, 0, 0, 0},
			ActionMask:  []uint8{1, 1, 1, 0},
			OldLogprobs: make([]float32, 4), Advantages: make([]float32, 4),
		},
	}
	d, err := GlobalDenominators(rows...)
	if err != nil {
		t.Fatal(err)
	}
	if d != (Denominators{Tokens: 5, Sequences: 3}) {
		t.Fatalf("GlobalDenominators = %+v, want {5 3}", d)
	}
	bad := rows[1]
	bad.ActionMask = []uint8{1}
	if _, err := GlobalDenominators(rows[0], bad); !errors.Is(err, ErrShape) {
		t.Fatalf("bad row: err = %v", err)
	}
	in, err := InputsFromRow(rows[0], make([]float32, 7*8), 8)
	if err != nil {
		t.Fatal(err)
	}
	if want := []int32{2, -1, 4, 5, -1, 7, -1}; !slices.Equal(in.Targets, want) {
		t.Fatalf("targets %v, want %v", in.Targets, want)
	}
	res, err := Compute(in, baseOpts(TokenMean), d)
	if err != nil {
		t.Fatal(err)
	}
	if res.Tokens != 2 || res.Sequences != 2 {
		t.Fatalf("row 0: %d tokens %d sequences, want 2 2", res.Tokens, res.Sequences)
	}
	// Uniform logits over 8 entries: every current log-prob is -ln 8.
	for i, lp := range res.CurLogprobs {
		if in.Targets[i] >= 0 && !near(float64(lp), -math.Log(8), 1e-7, 0) {
			t.Fatalf("cur[%d] = %v, want -ln 8", i, lp)
		}
	}
	if _, err := Concat(); !errors.Is(err, ErrShape) {
		t.Fatalf("empty concat: %v", err)
	}
	noRef := in
	withRef := in
	withRef.RefLogprobs = make([]float32, in.T)
	if _, err := Concat(noRef, withRef); !errors.Is(err, ErrShape) {
		t.Fatalf("concat mixing ref: %v", err)
	}
	otherV := in
	otherV.V, otherV.Logits = 4, make([]float32, 7*4)
	if _, err := Concat(in, otherV); !errors.Is(err, ErrShape) {
		t.Fatalf("concat mixing V: %v", err)
	}
}

func TestLagStats(t *testing.T) {
	// trainer version 5; tokens sampled by versions 5, 5, 3 and one context
	// position (-1, unmasked).
	cur := []float32{-1, -2, -0.5, -3}
	old := []float32{-1, -2.5, -0.25, -9}
	versions := []int32{5, 5, 3, -1}
	mask := []uint8{1, 1, 1, 0}
	got, err := LagStats(cur, old, versions, mask, 5)
	if err != nil {
		t.Fatal(err)
	}
	// lag 0: log ratios 0 and 0.5; lag 2: log ratio -0.25.
	e := math.Exp
	want := []LagStat{
		{Lag: 0, Tokens: 2, RatioMean: (1 + e(0.5)) / 2, RatioMin: 1, RatioMax: e(0.5),
			ApproxKL: 0.5 * 0.25 / 2, K3: (e(0.5) - 1 - 0.5) / 2},
		{Lag: 2, Tokens: 1, RatioMean: e(-0.25), RatioMin: e(-0.25), RatioMax: e(-0.25),
			ApproxKL: 0.5 * 0.0625, K3: e(-0.25) - 1 + 0.25},
	}
	if len(got) != len(want) {
		t.Fatalf("LagStats = %+v, want %+v", got, want)
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.Lag != w.Lag || g.Tokens != w.Tokens ||
			!near(g.RatioMean, w.RatioMean, 1e-15, 1e-15) || !near(g.RatioMin, w.RatioMin, 1e-15, 1e-15) ||
			!near(g.RatioMax, w.RatioMax, 1e-15, 1e-15) || !near(g.ApproxKL, w.ApproxKL, 1e-15, 1e-15) ||
			!near(g.K3, w.K3, 1e-15, 1e-15) {
			t.Errorf("lag entry %d = %+v, want %+v", i, g, w)
		}
	}
	// Splitting the tokens and merging gives the same statistics.
	a, err := LagStats(cur[:1], old[:1], versions[:1], mask[:1], 5)
	if err != nil {
		t.Fatal(err)
	}
	b, err := LagStats(cur[1:], old[1:], versions[1:], mask[1:], 5)
	if err != nil {
		t.Fatal(err)
	}
	m := MergeLagStats(a, b)
	for i := range m {
		if m[i].Lag != got[i].Lag || m[i].Tokens != got[i].Tokens || !near(m[i].RatioMean, got[i].RatioMean, 1e-15, 1e-15) ||
			!near(m[i].K3, got[i].K3, 1e-15, 1e-15) || m[i].RatioMin != got[i].RatioMin || m[i].RatioMax != got[i].RatioMax {
			t.Errorf("merged %+v, want %+v", m[i], got[i])
		}
	}
	for _, tc := range []struct {
		name     string
		versions []int32
		mask     []uint8
		n        int
		want     error
	}{
		{"length", versions[:2], mask, 4, ErrShape},
		{"masked context version", []int32{5, 5, 3, -1}, []uint8{1, 1, 1, 1}, 4, ErrInput},
		{"future version", []int32{6, 5, 3, -1}, mask, 4, ErrInput},
		{"mask value", versions, []uint8{1, 3, 1, 0}, 4, ErrInput},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := LagStats(cur[:tc.n], old[:tc.n], tc.versions, tc.mask, 5); !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
	// Ratios saturate at e^600: a log ratio of 600 is reported as it is,
	// larger ones as 600 (K3 too), far past exp's range included, so the
	// statistics stay finite; ApproxKL keeps the log ratio itself.
	for _, tc := range []struct{ old float32 }{{-600}, {-601}, {-6e29}} {
		lr := -float64(tc.old)
		got, err := LagStats([]float32{0}, []float32{tc.old}, []int32{5}, []uint8{1}, 5)
		if err != nil {
			t.Fatal(err)
		}
		g, r := got[0], math.Exp(600)
		if g.RatioMax != r || g.RatioMin != r || g.RatioMean != r || g.K3 != r-1-600 || g.ApproxKL != 0.5*lr*lr {
			t.Fatalf("behavior log-prob %v: %+v, want ratios e^600, K3 e^600-601, ApproxKL %v", tc.old, g, 0.5*lr*lr)
		}
	}
	m = MergeLagStats([]LagStat{{Lag: 0, Tokens: 3, RatioMean: math.Exp(600), RatioMin: 1, RatioMax: math.Exp(600)}},
		[]LagStat{{Lag: 0, Tokens: 1 << 40, RatioMean: math.Exp(600), RatioMin: 1, RatioMax: math.Exp(600)}})
	if math.IsInf(m[0].RatioMean, 0) || math.IsNaN(m[0].RatioMean) {
		t.Fatalf("merged saturated means %+v", m[0])
	}
}

// TestMaskedVocabulary: -Inf logits (vocabulary entries masked out) at a
// trained position give probability 0, a finite loss and exactly zero
// gradient on those entries, with the entropy bonus on.
func TestMaskedVocabulary(t *testing.T) {
	ninf := float32(math.Inf(-1))
	in := Inputs{
		T: 2, V: 4,
		Logits:      []float32{0.3, ninf, -0.2, ninf, 0, 0, 0, 0},
		Targets:     []int32{2, NoTarget},
		Mask:        []uint8{1, 0},
		OldLogprobs: []float32{-0.5, 0},
		Advantages:  []float32{1, 0},
		SegmentIDs:  []int32{0, 0},
	}
	opts := baseOpts(TokenMean)
	opts.EntropyCoef = 0.1
	res, err := Compute(in, opts, mustDen(t, in))
	if err != nil {
		t.Fatal(err)
	}
	if !finite(res.Loss) || !finite(res.Entropy) {
		t.Fatalf("loss %v entropy %v", res.Loss, res.Entropy)
	}
	// Two live entries: entropy of softmax(0.3, -0.2).
	p := 1 / (1 + math.Exp(-0.5))
	if h := -p*math.Log(p) - (1-p)*math.Log(1-p); !near(res.Entropy, h, 1e-7, 0) {
		t.Fatalf("entropy %v, want %v", res.Entropy, h)
	}
	d := res.DLogits[:4]
	if d[1] != 0 || d[3] != 0 || d[0] == 0 || d[2] == 0 {
		t.Fatalf("gradient %v: want 0 exactly on -Inf entries, non-zero elsewhere", d)
	}
	if s := float64(d[0]) + float64(d[2]); !near(s, 0, 1e-7, 0) {
		t.Fatalf("gradient sums to %v, want 0 (softmax shift invariance)", s)
	}
}

// TestPerToken: under token-sum a normalized sum is divided by the
// declared constant, and PerToken gives the mean per trained token back:
// a 1024-token batch with mean entropy 0.2 has Entropy 0.2·1024/4096 =
// 0.05. Token-mean's value is that mean already.
func TestPerToken(t *testing.T) {
	for _, tc := range []struct {
		o      Options
		x      float64
		tokens int64
		want   float64
	}{
		{Options{Normalization: TokenMean}, 0.2, 1024, 0.2},
		{Options{Normalization: TokenSum, NormTokens: 4096}, 0.05, 1024, 0.2},
		{Options{Normalization: TokenSum, NormTokens: 4096}, 0, 0, 0},
		{Options{Normalization: SeqMeanTokenSum}, 3, 12, 3},
	} {
		if got := tc.o.PerToken(tc.x, tc.tokens); got != tc.want {
			t.Errorf("%s PerToken(%v, %d) = %v, want %v", tc.o.Normalization, tc.x, tc.tokens, got, tc.want)
		}
	}
}
