package cuda

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

// TestLSEChunks: the online log-sum-exp over random vocabulary chunks,
// merged in any grouping, equals the reference log-softmax and entropy.
func TestLSEChunks(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	for _, V := range []int{1, 2, 7, 32, 1000} {
		z := make([]float32, V)
		for v := range z {
			z[v] = float32(rng.NormFloat64() * 6)
		}
		if V > 3 {
			z[2] = float32(math.Inf(-1)) // a removed token
		}
		lp := make([]float32, 1)
		ent := make([]float32, 1)
		y := int32(rng.IntN(V))
		if V > 3 && y == 2 {
			y = 3
		}
		if err := objective.LogSoftmaxGather(z, 1, V, []int32{y}, lp); err != nil {
			t.Fatal(err)
		}
		if err := objective.Entropy(z, 1, V, ent); err != nil {
			t.Fatal(err)
		}
		for _, chunk := range []int{1, 3, 8, V} {
			var total LSE
			for c := 0; c < V; c += chunk {
				var part LSE
				for v := c; v < min(c+chunk, V); v++ {
					part = part.Add(float64(z[v]))
				}
				total = total.Merge(part)
			}
			gotLP := float64(z[y]) - total.LogZ()
			if math.Abs(gotLP-float64(lp[0])) > 1e-6 || math.Abs(total.Entropy()-float64(ent[0])) > 1e-6 {
				t.Fatalf("V=%d chunk=%d: lp %v ent %v, want %v %v", V, chunk, gotLP, total.Entropy(), lp[0], ent[0])
			}
		}
	}
}

// emulateTokenLoss is the token_loss kernel (kernels/trajflow.cu) in Go:
// from the behavior logits of every position it computes the per-token
// outputs with the online log-sum-exp and the kernel's formulas.
func emulateTokenLoss(beh []float32, V int, buf []byte, st *Staged, opts objective.Options, out *TokenOut) {
	l := st.Layout
	T := l.T
	out.Resize(T)
	tgt, mask := l.Int32s(buf, ColTargets), l.ColumnBytes(buf, ColMask)
	old, ref, adv := l.Float32s(buf, ColOld), l.Float32s(buf, ColRef), l.Float32s(buf, ColAdv)
	lo, hi := 1-opts.ClipLow, 1+opts.ClipHigh
	for i := 0; i < T; i++ {
		out.Logprob[i], out.Ratio[i], out.Surrogate[i], out.KL[i], out.Entropy[i], out.Flags[i] = 0, 0, 0, 0, 0, 0
		y := tgt[i]
		if y < 0 {
			continue
		}
		var s LSE
		for v := 0; v < V; v++ {
			s = s.Add(float64(beh[i*V+v]))
		}
		cur := float32(float64(beh[i*V+int(y)]) - s.LogZ())
		out.Logprob[i] = cur
		if mask[i] != 1 {
			continue
		}
		out.Entropy[i] = s.Entropy()
		lr := float64(cur) - float64(old[i])
		if M := opts.MaxLogRatio; M > 0 && (lr > M || lr < -M) {
			lr = math.Max(-M, math.Min(M, lr))
			out.Flags[i] |= FlagLRClamped
		}
		r := math.Exp(lr)
		a := float64(adv[i])
		sur := r * a
		if a > 0 && r > hi {
			sur, out.Flags[i] = hi*a, out.Flags[i]|FlagClipped
		} else if a < 0 && r < lo {
			sur, out.Flags[i] = lo*a, out.Flags[i]|FlagClipped
		}
		out.Ratio[i], out.Surrogate[i] = r, sur
		if st.HasRef && opts.KLEstimator != "" {
			logr := float64(ref[i]) - float64(cur)
			switch opts.KLEstimator {
			case objective.K1:
				out.KL[i] = -logr
			case objective.K2:
				out.KL[i] = logr * logr / 2
			default:
				out.KL[i] = math.Exp(logr) - 1 - logr
			}
		}
	}
}

// TestReduceStatsMatchesReference: staged batch + per-token outputs (the
// kernel's formulas, emulated) + ReduceStats give the Stats that the CPU
// reference computes row by row with objective.ComputeInto and Merge, for
// every normalization and KL setting.
func TestReduceStatsMatchesReference(t *testing.T) {
	cfg := model.Config{Vocab: 24, Window: 4, Embed: 5, Hidden: 7}
	m, err := model.New(cfg, 5)
	if err != nil {
		t.Fatal(err)
	}
	beh := model.Behavior{Temperature: 0.8}
	rng := rand.New(rand.NewPCG(31, 32))
	for _, tc := range []objective.Options{
		{ClipLow: 0.2, ClipHigh: 0.28, Normalization: objective.TokenMean, KLPlacement: objective.KLNone, EntropyCoef: 0.05},
		{ClipLow: 0.1, ClipHigh: 0.1, Normalization: objective.SeqMeanTokenSum, KLPlacement: objective.KLLoss, KLEstimator: objective.K3, KLCoef: 0.2},
		{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.SeqMeanTokenMean, KLPlacement: objective.KLLoss, KLEstimator: objective.K2, KLCoef: 0.1, MaxLogRatio: 1},
		{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.TokenMean, KLPlacement: objective.KLReward, KLEstimator: objective.K1, EntropyCoef: 0.01},
		{ClipLow: 0.2, ClipHigh: 0.28, Normalization: objective.TokenSum, NormTokens: 64, KLPlacement: objective.KLNone, EntropyCoef: 0.1},
	} {
		withRef := tc.KLEstimator != ""
		b := randomBatch(rng, 3, 50, cfg.Vocab, withRef, 1)
		buf, st := stageOK(t, b, cfg.Vocab, tc)
		// Behavior logits of every position, all rows concatenated.
		T := st.Layout.T
		logits := make([]float32, T*cfg.Vocab)
		var want objective.Stats
		for r, row := range b.Rows {
			n := len(row.InputIDs)
			raw := make([]float32, n*cfg.Vocab)
			bl := logits[st.RowStart[r]*cfg.Vocab : (st.RowStart[r]+n)*cfg.Vocab]
			if err := m.BehaviorLogits(beh, row.InputIDs, row.PositionIDs, nil, nil, raw, bl); err != nil {
				t.Fatal(err)
			}
			in, err := objective.InputsFromRow(row, bl, cfg.Vocab)
			if err != nil {
				t.Fatal(err)
			}
			res, err := objective.Compute(in, tc, st.Den)
			if err != nil {
				t.Fatal(err)
			}
			if r == 0 {
				want = res.Stats
			} else {
				want = want.Merge(res.Stats)
			}
		}
		var out TokenOut
		emulateTokenLoss(logits, cfg.Vocab, buf, st, tc, &out)
		got, err := ReduceStats(&out, st, buf, tc)
		if err != nil {
			t.Fatal(err)
		}
		if err := StatsClose(got, want, 1e-5); err != nil {
			t.Fatalf("%s/%s: %v", tc.Normalization, tc.KLEstimator, err)
		}
		if got.Tokens != want.Tokens || got.Sequences != want.Sequences || got.ClippedPos != want.ClippedPos ||
			got.ClippedNeg != want.ClippedNeg || got.LogRatioClamped != want.LogRatioClamped {
			t.Fatalf("counts %+v, want %+v", got, want)
		}
	}
	_ = schemas.PackedBatch{}
}

func TestReduceStatsRejectsFlags(t *testing.T) {
	b := randomBatch(rand.New(rand.NewPCG(1, 1)), 1, 30, 16, false, 0)
	opts := objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.TokenMean, KLPlacement: objective.KLNone}
	buf, st := stageOK(t, b, 16, opts)
	var out TokenOut
	out.Resize(st.Layout.T)
	mask := st.Layout.ColumnBytes(buf, ColMask)
	for i, m := range mask {
		if m == 1 {
			out.Flags[i] = FlagNonFinite
			break
		}
	}
	if _, err := ReduceStats(&out, st, buf, opts); err == nil {
		t.Fatal("non-finite flag accepted")
	}
	out.Resize(st.Layout.T - 1)
	if _, err := ReduceStats(&out, st, buf, opts); err == nil {
		t.Fatal("short outputs accepted")
	}
}

// A masked token whose surrogate (or KL term) overflowed on the device is
// refused as the CPU reference refuses it: objective.ErrNonFinite (an
// objective.ErrInput), before any parameter changes.
func TestReduceStatsRejectsNonFiniteTerms(t *testing.T) {
	b := randomBatch(rand.New(rand.NewPCG(1, 1)), 1, 30, 16, false, 0)
	opts := objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.TokenMean, KLPlacement: objective.KLNone}
	buf, st := stageOK(t, b, 16, opts)
	mask := st.Layout.ColumnBytes(buf, ColMask)
	first := -1
	for i, m := range mask {
		if m == 1 {
			first = i
			break
		}
	}
	for _, tt := range []struct {
		name string
		set  func(o *TokenOut)
	}{
		{"surrogate -Inf", func(o *TokenOut) { o.Surrogate[first] = math.Inf(-1) }},
		{"surrogate NaN", func(o *TokenOut) { o.Surrogate[first] = math.NaN() }},
		{"ratio +Inf", func(o *TokenOut) { o.Ratio[first] = math.Inf(1) }},
	} {
		var out TokenOut
		out.Resize(st.Layout.T)
		for i := range out.Ratio {
			out.Ratio[i] = 1
		}
		tt.set(&out)
		if _, err := ReduceStats(&out, st, buf, opts); !errors.Is(err, objective.ErrNonFinite) || !errors.Is(err, objective.ErrInput) {
			t.Errorf("%s: got %v, want objective.ErrNonFinite", tt.name, err)
		}
	}
}
