package objective

import (
	"errors"
	"math"
	"math/rand/v2"
	"reflect"
	"testing"
)

// TestSequenceRatioHandComputed: one sequence of two trained tokens, each
// with current log-prob log 1/2 (zero logits over V = 2) and advantage 1,
// normalization seq-mean-token-mean, clip region [0.8, 1.28].
//
// Log ratios 0.2 and 0: the sequence's ratio is e^0.1 = 1.1051709180756477
// (inside the region) for both tokens; the loss is -(1/2 + 1/2)·e^0.1 and
// each token's gradient c·(-r·A)·(1[v=y] - 1/2) = ∓0.5·e^0.1·0.5.
// The token ratio would give -(e^0.2 + 1)/2 instead.
//
// Log ratios 0.5 and 0.1: the sequence's ratio is e^0.3 = 1.3498588075760032,
// above 1.28 with A > 0: both tokens are clipped, the loss is -1.28 and
// the gradient 0. The token ratio would clip only the first token.
func TestSequenceRatioHandComputed(t *testing.T) {
	for _, tc := range []struct {
		name     string
		lrs      [2]float64
		loss     float64
		grad     float64 // |dL/dz| of every entry
		clipped  int
		ratio    float64
		tokLoss  float64
		tokClips int
	}{
		{"inside", [2]float64{0.2, 0}, -math.Exp(0.1), 0.25 * math.Exp(0.1), 0, math.Exp(0.1), -(math.Exp(0.2) + 1) / 2, 0},
		{"clipped", [2]float64{0.5, 0.1}, -1.28, 0, 2, math.Exp(0.3), -(1.28 + math.Exp(0.1)) / 2, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cur := float32(math.Log(0.5))
			in := Inputs{
				T: 3, V: 2, Logits: make([]float32, 6), Targets: []int32{1, 0, NoTarget},
				Mask:        []uint8{1, 1, 0},
				OldLogprobs: []float32{cur - float32(tc.lrs[0]), cur - float32(tc.lrs[1]), 0},
				Advantages:  []float32{1, 1, 0},
				SegmentIDs:  []int32{0, 0, 0},
			}
			den := Denominators{Tokens: 2, Sequences: 1}
			o := baseOpts(SeqMeanTokenMean)
			o.Ratio = RatioSequence
			res := mustCompute(t, in, o, den)
			// The stored old log-probs are float32: the log ratios are the
			// float32 differences, within 1e-7 of the decimal ones.
			if !near(res.Loss, tc.loss, 1e-6, 0) || res.PolicyLoss != res.Loss {
				t.Errorf("loss %v (policy %v), want %v", res.Loss, res.PolicyLoss, tc.loss)
			}
			if res.ClippedPos != int64(tc.clipped) || !near(res.RatioMean, tc.ratio, 1e-6, 0) || res.RatioMin != res.RatioMax {
				t.Errorf("clipped %d, ratio mean %v [%v, %v]; want %d clipped, both tokens at %v", res.ClippedPos, res.RatioMean, res.RatioMin, res.RatioMax, tc.clipped, tc.ratio)
			}
			for j, d := range res.DLogits[:4] {
				want := tc.grad
				if j == 1 || j == 2 { // at the targets (z[0,1], z[1,0]) the loss falls as the logit rises
					want = -want
				}
				if !near(float64(d), want, 1e-6, 0) {
					t.Errorf("dL/dz[%d,%d] = %v, want %v", j/2, j%2, d, want)
				}
			}
			if tok := mustCompute(t, in, baseOpts(SeqMeanTokenMean), den); !near(tok.Loss, tc.tokLoss, 1e-6, 0) || tok.ClippedPos != int64(tc.tokClips) {
				t.Errorf("token ratio: loss %v, %d clipped; want %v, %d", tok.Loss, tok.ClippedPos, tc.tokLoss, tc.tokClips)
			}
		})
	}
}

// TestSequenceRatioOneTokenSequences: where every sequence has one
// trained token, its ratio is the token's, and the sequence level gives
// the token level's result bit for bit.
func TestSequenceRatioOneTokenSequences(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for k := 0; k < 20; k++ {
		in := randProblem(t, rng, 24, 9, 12, 0.4) // sequences of 2 positions: one target each
		for _, norm := range allNorms {
			o := baseOpts(norm)
			o.KLPlacement, o.KLEstimator, o.KLCoef, o.EntropyCoef, o.MaxLogRatio = KLLoss, K3, 0.1, 0.02, 0.3
			den := mustDen(t, in)
			tok := mustCompute(t, in, o, den)
			o.Ratio = RatioSequence
			if seq := mustCompute(t, in, o, den); !reflect.DeepEqual(tok, seq) {
				t.Fatalf("problem %d, %s: sequence level %+v, token level %+v", k, norm, seq.Stats, tok.Stats)
			}
		}
	}
}

// TestSequenceRatioFiniteDifference: with an advantage constant over each
// sequence (as GRPO and RLOO give) the gradient that reaches each token
// through its own log-prob only is the whole gradient of the loss, whose
// sequence ratio depends on every token: checked against central
// differences for every normalization, with the KL term and the entropy
// bonus on (tolerances as TestGradientFiniteDifference).
func TestSequenceRatioFiniteDifference(t *testing.T) {
	const h = 1e-6
	rng := rand.New(rand.NewPCG(9, 10))
	for _, norm := range append(allNorms, TokenSum) {
		t.Run(norm, func(t *testing.T) {
			opts := Options{ClipLow: 0.2, ClipHigh: 0.28, Normalization: norm, KLPlacement: KLLoss, KLEstimator: K3,
				KLCoef: 0.3, EntropyCoef: 0.05, Ratio: RatioSequence}
			if norm == TokenSum {
				opts.NormTokens = 7
			}
			in := fdProblem(t, rng, opts)
			in.adv = []float32{1.3, 1.3, 0, -0.7, -0.7, 0}
			// Sequence log ratios (0.45-0.35)/2 = 0.05 and (0.5-0.05)/2 =
			// 0.225: inside [log 0.8, log 1.28], away from the kinks.
			den := Denominators{Tokens: 9, Sequences: 3}
			cur := make([]float64, in.T)
			grad := make([]float64, in.T*in.V)
			st, err := compute(in, opts, den, cur, grad)
			if err != nil {
				t.Fatal(err)
			}
			if st.ClippedPos+st.ClippedNeg != 0 {
				t.Fatalf("the problem should clip nothing: %+v", st)
			}
			sc, sg := make([]float64, in.T), make([]float64, in.T*in.V)
			loss := func() float64 {
				s, err := compute(in, opts, den, sc, sg)
				if err != nil {
					t.Fatal(err)
				}
				return s.Loss
			}
			for j := range in.logits {
				orig := in.logits[j]
				in.logits[j] = orig + h
				lp := loss()
				in.logits[j] = orig - h
				lm := loss()
				in.logits[j] = orig
				if fd := (lp - lm) / (2 * h); !near(fd, grad[j], 1e-8, 1e-6) {
					t.Errorf("dL/dz[%d,%d]: analytic %.12g, finite difference %.12g", j/in.V, j%in.V, grad[j], fd)
				}
			}
		})
	}
}

// TestSequenceRatioOptions: the sequence level is refused with an
// off-policy correction (not implemented) and an unknown level is refused.
func TestSequenceRatioOptions(t *testing.T) {
	for _, o := range []Options{
		{Ratio: RatioSequence, OffPolicy: OffPolicyTIS, ISCap: 2},
		{Ratio: RatioSequence, OffPolicy: OffPolicyDecoupled},
		{Ratio: "seq"},
	} {
		o.ClipLow, o.ClipHigh, o.Normalization = 0.2, 0.2, TokenMean
		if err := o.Validate(); !errors.Is(err, ErrOptions) {
			t.Errorf("%+v: %v, want ErrOptions", o, err)
		}
	}
	for _, r := range []string{"", RatioToken, RatioSequence} {
		o := Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: TokenMean, Ratio: r}
		if err := o.Validate(); err != nil {
			t.Errorf("ratio %q: %v", r, err)
		}
	}
}
