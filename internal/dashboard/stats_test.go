package dashboard

import (
	"math"
	"math/big"
	"testing"
)

func near(a, b, tol float64) bool { return math.Abs(a-b) <= tol }

// TestWilson checks intervals computed by hand from the formula
// (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n), z = 1.95996.
func TestWilson(t *testing.T) {
	for _, tc := range []struct {
		c, n   int
		lo, hi float64
	}{
		{5, 10, 0.236593, 0.763407},   // center 0.5, half 0.263407
		{0, 10, 0, 0.277533},          // 2·(z²/2n)/(1+z²/n) = 0.384146/1.384146
		{10, 10, 0.722467, 1},         // mirror of 0/10
		{1, 4, 0.045587, 0.699358},    // p = 0.25
		{50, 256, 0.151404, 0.248230}, // p = 0.1953
	} {
		lo, hi := Wilson(tc.c, tc.n)
		if !near(lo, tc.lo, 1e-5) || !near(hi, tc.hi, 1e-5) {
			t.Errorf("Wilson(%d, %d) = [%.6f, %.6f], want [%.6f, %.6f]", tc.c, tc.n, lo, hi, tc.lo, tc.hi)
		}
	}
	if lo, hi := Wilson(0, 0); lo != 0 || hi != 1 {
		t.Errorf("Wilson(0, 0) = [%v, %v], want [0, 1]", lo, hi)
	}
	for n := 1; n <= 1024; n++ { // all or nothing: the interval holds the rate exactly
		if _, hi := Wilson(n, n); hi != 1 {
			t.Fatalf("Wilson(%d, %d) ends at %v, want 1", n, n, hi)
		}
		if lo, _ := Wilson(0, n); lo != 0 {
			t.Fatalf("Wilson(0, %d) starts at %v, want 0", n, lo)
		}
	}
}

// binom is C(n, k) exactly.
func binom(n, k int) *big.Int { return new(big.Int).Binomial(int64(n), int64(k)) }

// TestPassAtK checks hand-computed values and, for every n <= 16, c, k,
// the product form against 1 - C(n-c, k)/C(n, k) in exact arithmetic.
func TestPassAtK(t *testing.T) {
	for _, tc := range []struct {
		n, c, k int
		want    float64
	}{
		{5, 2, 2, 0.7},           // 1 - C(3,2)/C(5,2) = 1 - 3/10
		{16, 1, 4, 0.25},         // 1 - C(15,4)/C(16,4) = 1 - 1365/1820
		{16, 4, 1, 0.25},         // pass@1 is c/n
		{4, 0, 2, 0},             // nothing passed
		{4, 3, 2, 1},             // n-c < k: any 2 include a pass
		{10, 3, 5, 1 - 21.0/252}, // 1 - C(7,5)/C(10,5)
	} {
		if got := PassAtK(tc.n, tc.c, tc.k); !near(got, tc.want, 1e-12) {
			t.Errorf("PassAtK(%d, %d, %d) = %v, want %v", tc.n, tc.c, tc.k, got, tc.want)
		}
	}
	for n := 1; n <= 16; n++ {
		for c := 0; c <= n; c++ {
			for k := 1; k <= n; k++ {
				r := new(big.Rat).SetFrac(binom(n-c, k), binom(n, k))
				f, _ := r.Float64()
				if got := PassAtK(n, c, k); !near(got, 1-f, 1e-12) {
					t.Fatalf("PassAtK(%d, %d, %d) = %v, exact %v", n, c, k, got, 1-f)
				}
			}
		}
	}
	if !math.IsNaN(PassAtK(4, 1, 5)) {
		t.Errorf("PassAtK with k > n must be NaN")
	}
}

func TestSummarize(t *testing.T) {
	d := Summarize([]float64{5, 1, 4, 2, 3, 6, 7, 8, 9, 10})
	if d.N != 10 || d.Mean != 5.5 || d.Min != 1 || d.Max != 10 || d.P10 != 2 || d.P50 != 6 || d.P90 != 10 || d.P99 != 10 {
		t.Fatalf("Summarize = %+v", d)
	}
	var v []float64
	for x := 200.0; x >= 1; x-- {
		v = append(v, x)
	}
	if d := Summarize(v); d.P99 != 199 || d.P90 != 181 || d.Max != 200 { // v[floor(0.99·200)] of 1..200
		t.Fatalf("Summarize(1..200) = %+v", d)
	}
	if (Summarize(nil) != Dist{}) {
		t.Fatal("empty sample")
	}
}
