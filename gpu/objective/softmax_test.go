package objective

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestShiftTargets(t *testing.T) {
	for _, tc := range []struct {
		name string
		ids  []int32
		seg  []int32
		want []int32
	}{
		{"empty", nil, nil, []int32{}},
		{"single", []int32{7}, nil, []int32{-1}},
		// Hand-built shift (docs/PIPELINE.md §11): logits at i predict ids[i+1].
		{"one sequence", []int32{10, 11, 12, 13}, nil, []int32{11, 12, 13, -1}},
		{"two segments", []int32{10, 11, 12, 20, 21}, []int32{0, 0, 0, 1, 1}, []int32{11, 12, -1, 21, -1}},
		{"three segments", []int32{1, 2, 3, 4, 5, 6}, []int32{0, 1, 1, 2, 2, 2}, []int32{-1, 3, -1, 5, 6, -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ShiftTargets(tc.ids, tc.seg)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("ShiftTargets(%v, %v) = %v, want %v", tc.ids, tc.seg, got, tc.want)
			}
		})
	}
	if _, err := ShiftTargets([]int32{1, 2}, []int32{0}); !errors.Is(err, ErrShape) {
		t.Fatalf("mismatched segment ids: err = %v, want ErrShape", err)
	}
}

// TestLogSoftmaxGatherNaive compares with a direct float64 evaluation.
// Tolerance: the output is one float32 rounding of a float64 value, so
// |got - want| <= 1e-6 + 1e-6·|want| (float32 has 2^-24 ≈ 6e-8 relative
// precision; the slack covers summation-order differences).
func TestLogSoftmaxGatherNaive(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		name  string
		T, V  int
		scale float64
	}{
		{"small", 3, 2, 1},
		{"wide", 8, 97, 5},
		{"large logits", 5, 33, 60},
		{"V=1", 4, 1, 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logits := randLogits(rng, tc.T, tc.V, tc.scale)
			targets := make([]int32, tc.T)
			for i := range targets {
				targets[i] = int32(rng.IntN(tc.V))
			}
			targets[tc.T-1] = NoTarget
			out := make([]float32, tc.T)
			for i := range out {
				out[i] = 42 // must be overwritten, including at NoTarget
			}
			if err := LogSoftmaxGather(logits, tc.T, tc.V, targets, out); err != nil {
				t.Fatal(err)
			}
			ent := make([]float32, tc.T)
			if err := Entropy(logits, tc.T, tc.V, ent); err != nil {
				t.Fatal(err)
			}
			for i := 0; i < tc.T; i++ {
				z := logits[i*tc.V : (i+1)*tc.V]
				if h := naiveEntropy(z); !near(float64(ent[i]), h, 1e-6, 1e-6) {
					t.Errorf("entropy[%d] = %v, naive %v", i, ent[i], h)
				}
				if targets[i] < 0 {
					if out[i] != 0 {
						t.Errorf("out[%d] = %v at NoTarget, want 0", i, out[i])
					}
					continue
				}
				want := naiveLogSoftmax(z, int(targets[i]))
				if !near(float64(out[i]), want, 1e-6, 1e-6) {
					t.Errorf("out[%d] = %v, naive %v", i, out[i], want)
				}
				if out[i] > 0 {
					t.Errorf("out[%d] = %v > 0", i, out[i])
				}
			}
		})
	}
}

// TestLogSoftmaxGatherStable checks logits far beyond exp's float64 range
// (the naive form overflows) against the shift invariance
// log_softmax(z + c) == log_softmax(z), and -Inf logits.
func TestLogSoftmaxGatherStable(t *testing.T) {
	base := []float32{0.5, -1, 2, 0.25}
	shifted := make([]float32, len(base))
	for i, x := range base {
		shifted[i] = x + 1e4
	}
	if v := naiveLogSoftmax(shifted, 2); finite(v) {
		t.Fatalf("naive form unexpectedly finite (%v): the test does not exercise stability", v)
	}
	a, b := make([]float32, 1), make([]float32, 1)
	if err := LogSoftmaxGather(base, 1, 4, []int32{2}, a); err != nil {
		t.Fatal(err)
	}
	if err := LogSoftmaxGather(shifted, 1, 4, []int32{2}, b); err != nil {
		t.Fatal(err)
	}
	// 1e4 + x is exact to ~1e-3 in float32, so the values agree to that.
	if !near(float64(a[0]), float64(b[0]), 2e-3, 0) || math.IsNaN(float64(b[0])) {
		t.Fatalf("shifted %v, base %v", b[0], a[0])
	}
	ninf := float32(math.Inf(-1))
	withInf := []float32{0, ninf, 0, ninf}
	out := make([]float32, 2)
	if err := LogSoftmaxGather(append(withInf, withInf...), 2, 4, []int32{0, 1}, out); err != nil {
		t.Fatal(err)
	}
	if float64(out[0]) != -math.Ln2 && !near(float64(out[0]), -math.Ln2, 1e-7, 0) {
		t.Errorf("two equal finite logits: %v, want -ln 2", out[0])
	}
	if !math.IsInf(float64(out[1]), -1) {
		t.Errorf("target with -Inf logit: %v, want -Inf", out[1])
	}
	ent := make([]float32, 1)
	if err := Entropy(withInf, 1, 4, ent); err != nil || !near(float64(ent[0]), math.Ln2, 1e-7, 0) {
		t.Errorf("entropy with -Inf logits: %v %v, want ln 2", ent[0], err)
	}
}

func TestLogSoftmaxGatherErrors(t *testing.T) {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	ninf := float32(math.Inf(-1))
	for _, tc := range []struct {
		name    string
		logits  []float32
		T, V    int
		targets []int32
		nout    int
		want    error
	}{
		{"logits length", make([]float32, 5), 2, 3, []int32{0, 0}, 2, ErrShape},
		{"zero V", nil, 2, 0, []int32{0, 0}, 2, ErrShape},
		{"negative T", nil, -1, 3, nil, 0, ErrShape},
		{"targets length", make([]float32, 6), 2, 3, []int32{0}, 2, ErrShape},
		{"out length", make([]float32, 6), 2, 3, []int32{0, 0}, 1, ErrShape},
		{"target == V", make([]float32, 6), 2, 3, []int32{0, 3}, 2, ErrTarget},
		{"NaN logit", []float32{0, nan, 0}, 1, 3, []int32{0}, 1, ErrInput},
		{"+Inf logit", []float32{0, inf, 0}, 1, 3, []int32{0}, 1, ErrInput},
		{"all -Inf", []float32{ninf, ninf}, 1, 2, []int32{0}, 1, ErrInput},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := LogSoftmaxGather(tc.logits, tc.T, tc.V, tc.targets, make([]float32, tc.nout))
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
	if err := Entropy(make([]float32, 6), 2, 3, make([]float32, 3)); !errors.Is(err, ErrShape) {
		t.Fatalf("entropy out length: err = %v", err)
	}
	if err := Entropy([]float32{float32(math.NaN())}, 1, 1, make([]float32, 1)); !errors.Is(err, ErrInput) {
		t.Fatalf("entropy NaN: err = %v", err)
	}
}
