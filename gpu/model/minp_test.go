package model

import (
	"context"
	"errors"
	"math"
	"testing"
)

// TestMinPHandChecked pins min-p on a 4-token vocabulary whose logits are
// the same at every position (W2 = 0, so the logits are exactly the output
// bias b2 = [2, 1.5, 0, -1]).
//
// With temperature 0.5 the scaled logits are z = b2 / 0.5 = [4, 3, 0, -2]
// (exact in float32). Min-p compares p(v) / p(max) = e^(z_v - 4):
//
//	token 0: e^0  = 1
//	token 1: e^-1 = 0.36787944
//	token 2: e^-4 = 0.01831564
//	token 3: e^-6 = 0.00247875
//
// so min_p 0.5 keeps {0}; 0.2 keeps {0, 1}; 0.01 keeps {0, 1, 2}; 0 (off)
// keeps all four. The log-probs of the kept, renormalized distribution are
// z_v - log Σ_kept e^z:
//
//	{0}:          log p0 = 0
//	{0, 1}:       log(e^4 + e^3) = 4 + log(1 + e^-1) = 4.313261688,
//	              log p = [-0.313261688, -1.313261688]
//	{0, 1, 2}:    4 + log(1 + e^-1 + e^-4) = 4.326562641,
//	              log p = [-0.326562641, -1.326562641, -4.326562641]
//	{0, 1, 2, 3}: 4 + log(1 + e^-1 + e^-4 + e^-6) = 4.328349214,
//	              log p = [-0.328349214, -1.328349214, -4.328349214, -6.328349214]
//
// The test requires the transform to keep exactly those sets, every
// sampled token to be in the kept set with its hand-computed log-prob
// (within float32 rounding), every kept token to be sampled, and the
// trainer's recomputation on the sampled sequences to equal the sampler's
// log-probs bit for bit.
func TestMinPHandChecked(t *testing.T) {
	cfg := Config{Vocab: 4, Window: 2, Embed: 2, Hidden: 3}
	m := testModel(t, cfg, 5)
	v := m.Views()
	clear(v.W2)
	raw := []float32{2, 1.5, 0, -1}
	copy(v.B2, raw)
	pol := NewPolicy(m, 0)
	for _, tc := range []struct {
		minP float64
		lp   []float64 // hand log-probs of the kept tokens 0..len-1
	}{
		{0.5, []float64{0}},
		{0.2, []float64{-0.313261688, -1.313261688}},
		{0.01, []float64{-0.326562641, -1.326562641, -4.326562641}},
		{0, []float64{-0.328349214, -1.328349214, -4.328349214, -6.328349214}},
	} {
		b := Behavior{Temperature: 0.5, MinP: tc.minP}
		out := make([]float32, 4)
		if err := b.Transform(raw, []int32{1}, out); err != nil {
			t.Fatal(err)
		}
		for tok, z := range out {
			kept := tok < len(tc.lp)
			if kept != !math.IsInf(float64(z), -1) || (kept && z != raw[tok]/0.5) {
				t.Fatalf("min_p %v: behavior logits %v, want the first %d of [4 3 0 -2]", tc.minP, out, len(tc.lp))
			}
		}
		s := Settings{Behavior: b, MaxTokens: 16}
		reqs := make([]Request, 256)
		for i := range reqs {
			reqs[i] = Request{Context: []int32{1, 2}, Settings: s, Seed: uint64(i)}
		}
		samples, err := pol.Generate(context.Background(), reqs)
		if err != nil {
			t.Fatal(err)
		}
		seen := make([]int, len(tc.lp))
		for _, smp := range samples {
			for j, tok := range smp.Tokens {
				if int(tok) >= len(tc.lp) {
					t.Fatalf("min_p %v: sampled token %d outside the kept set", tc.minP, tok)
				}
				seen[tok]++
				if d := math.Abs(float64(smp.Logprobs[j]) - tc.lp[tok]); d > 1e-6 {
					t.Fatalf("min_p %v token %d: log-prob %.9f, by hand %.9f", tc.minP, tok, smp.Logprobs[j], tc.lp[tok])
				}
			}
		}
		for tok, n := range seen {
			if n == 0 {
				t.Fatalf("min_p %v: kept token %d never sampled in %d tokens", tc.minP, tok, 16*len(reqs))
			}
		}
		t.Logf("min_p %v: token counts %v", tc.minP, seen)
		checkTrainerMatchesSampler(t, m, b, reqs, samples)
	}
}

// TestMinPInTopKTopPOrder: min-p applies after top-k and top-p (the order
// of Behavior): with z = [4, 3, 0, -2], top_k 1 leaves {0} whatever min_p;
// min-p then cuts {0, 1, 2} (top_k 3) to {0, 1}.
func TestMinPInTopKTopPOrder(t *testing.T) {
	raw := []float32{4, 3, 0, -2}
	for _, tc := range []struct {
		b    Behavior
		kept int
	}{
		{Behavior{Temperature: 1, TopK: 1, MinP: 0.01}, 1},
		{Behavior{Temperature: 1, TopK: 3, MinP: 0.2}, 2},
		{Behavior{Temperature: 1, TopK: 3, MinP: 0.01}, 3},
		{Behavior{Temperature: 1, TopP: 0.9, MinP: 0.01}, 2}, // top-p: 0.7201 < 0.9 <= 0.9850
	} {
		out := make([]float32, 4)
		if err := tc.b.Transform(raw, []int32{1}, out); err != nil {
			t.Fatal(err)
		}
		for tok, z := range out {
			if (tok < tc.kept) == math.IsInf(float64(z), -1) {
				t.Fatalf("%+v: behavior logits %v, want %d kept", tc.b, out, tc.kept)
			}
		}
	}
}

// TestMinPIdentity: the behavior and sampler ids of a behavior without
// min-p are those recorded before min-p existed (golden values); min-p
// changes them, and different min-p values differ.
func TestMinPIdentity(t *testing.T) {
	for _, g := range []struct {
		b  Behavior
		id string
	}{
		{Behavior{Temperature: 1}, "sha256:0935d1db41990c53ae883474f781c010869fcbead94f12b63d1c18ca3714b225"},
		{Behavior{Temperature: 0.7, TopK: 4, TopP: 0.9}, "sha256:82aaec462990949a52e27ff8d11f58ca58a9a65218bd6d04df34aacdb1571c7c"},
		{Behavior{Temperature: 1.3, TopK: 4, Grammar: evenOdd{}}, "sha256:b60443d55562ac9012b542b69254796883914713c9264239b54439db3b64284c"},
	} {
		if id := g.b.ID(); id != g.id {
			t.Errorf("%+v: id %s, recorded %s", g.b, id, g.id)
		}
		with := g.b
		with.MinP = 0.1
		other := g.b
		other.MinP = 0.2
		if with.ID() == g.id || with.ID() == other.ID() {
			t.Errorf("%+v: min_p does not enter the id", g.b)
		}
	}
	s := Settings{Behavior: Behavior{Temperature: 1}, MaxTokens: 3, Stop: []int32{2}}
	if id := s.ID(); id != "sha256:e38c640d1864b2666d3152a431b373c00e5383e215b13e625a148c0066d8cbfd" {
		t.Errorf("sampler id %s changed", id)
	}
	for _, p := range []float64{-0.1, 1, 1.5, math.NaN()} {
		if err := (Behavior{Temperature: 1, MinP: p}).Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("min_p %v: %v", p, err)
		}
	}
}
