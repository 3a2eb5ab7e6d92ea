package gate

import (
	"math"
	"testing"
)

func near(a, b, tol float64) bool { return math.Abs(a-b) <= tol }

// The Wilson intervals below are computed by hand at z = 1.96:
// center = (p + z²/2n) / (1 + z²/n), half = z·sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n).
// 8/10: denom 1.38416, center 0.99208/1.38416 = 0.716737,
// half 1.96·sqrt(0.016 + 0.009604)/1.38416 = 0.226582 -> [0.490155, 0.943319].
// 0/10: center = half = 0.19208/1.38416 = 0.138770 -> [0, 0.277540].
func TestWilsonHandComputed(t *testing.T) {
	for _, c := range []struct {
		k, n   int
		lo, hi float64
	}{
		{8, 10, 0.490155, 0.943319},
		{0, 10, 0, 0.277540},
		{10, 10, 0.722460, 1},
		// 128/256: p 0.5, denom 1.0150062, center 0.5,
		// half 1.96·sqrt(0.000976563 + 0.0000146546)/1.0150062
		// = 1.96·0.0314835/1.0150062 = 0.060795.
		{128, 256, 0.439205, 0.560795},
	} {
		lo, hi, err := Wilson(c.k, c.n, 1.96)
		if err != nil {
			t.Fatal(err)
		}
		if !near(lo, c.lo, 2e-6) || !near(hi, c.hi, 2e-6) {
			t.Errorf("Wilson(%d, %d) = [%.6f, %.6f], want [%.6f, %.6f]", c.k, c.n, lo, hi, c.lo, c.hi)
		}
	}
	for _, bad := range [][2]int{{1, 0}, {-1, 4}, {5, 4}} {
		if _, _, err := Wilson(bad[0], bad[1], 1.96); err == nil {
			t.Errorf("Wilson(%d, %d): no error", bad[0], bad[1])
		}
	}
	if _, _, err := Wilson(1, 2, 0); err == nil {
		t.Error("Wilson with z 0: no error")
	}
	// All or nothing: the closed form rounds (center+half at 256/256 is
	// 0.9999999999999999 in float64), the interval must still hold the
	// observed rate exactly.
	for n := 1; n <= 1024; n++ {
		for _, k := range []int{0, n} {
			lo, hi, err := Wilson(k, n, Z95)
			p := float64(k) / float64(n)
			if err != nil || lo > p || hi < p {
				t.Fatalf("Wilson(%d, %d) = [%v, %v] %v: does not hold %v", k, n, lo, hi, err, p)
			}
		}
	}
}

// pass@k = 1 - C(n-c, k)/C(n, k), by hand.
func TestPassAtKHandComputed(t *testing.T) {
	for _, c := range []struct {
		n, c, k int
		want    float64
	}{
		{4, 1, 2, 1 - 3.0/6},     // C(3,2)=3, C(4,2)=6
		{5, 2, 2, 1 - 3.0/10},    // C(3,2)=3, C(5,2)=10
		{10, 3, 5, 1 - 21.0/252}, // C(7,5)=21, C(10,5)=252
		{10, 3, 1, 0.3},          // pass@1 is c/n
		{3, 0, 1, 0},
		{3, 2, 2, 1}, // n-c < k: every draw of 2 holds a correct one
		{16, 16, 16, 1},
	} {
		got, err := PassAtK(c.n, c.c, c.k)
		if err != nil {
			t.Fatal(err)
		}
		if !near(got, c.want, 1e-12) {
			t.Errorf("PassAtK(%d, %d, %d) = %v, want %v", c.n, c.c, c.k, got, c.want)
		}
	}
	if _, err := PassAtK(4, 1, 5); err == nil {
		t.Error("k > n: no error")
	}
	if _, err := PassAtK(4, 5, 1); err == nil {
		t.Error("c > n: no error")
	}
	m, err := MeanPassAtK([]int{4, 5}, []int{1, 2}, 2)
	if err != nil || !near(m, (0.5+0.7)/2, 1e-12) {
		t.Errorf("MeanPassAtK = %v, %v; want 0.6", m, err)
	}
	if _, err := MeanPassAtK([]int{4}, []int{1, 2}, 2); err == nil {
		t.Error("mismatched counts: no error")
	}
}

func TestQuantileNearestRank(t *testing.T) {
	xs := make([]float64, 20)
	for i := range xs {
		xs[i] = float64(20 - i) // 20..1, unsorted
	}
	for _, c := range []struct{ q, want float64 }{{0.95, 19}, {1, 20}, {0, 1}, {0.5, 10}, {0.51, 11}} {
		got, err := Quantile(xs, c.q)
		if err != nil || got != c.want {
			t.Errorf("Quantile(1..20, %v) = %v, %v; want %v", c.q, got, err, c.want)
		}
	}
	if xs[0] != 20 {
		t.Error("Quantile sorted its input")
	}
	if _, err := Quantile(nil, 0.5); err == nil {
		t.Error("no values: no error")
	}
	if _, err := Quantile(xs, 1.5); err == nil {
		t.Error("q 1.5: no error")
	}
}

func TestBootstrap(t *testing.T) {
	mean := func(xs []float64) float64 {
		s := 0.0
		for _, x := range xs {
			s += x
		}
		return s / float64(len(xs))
	}
	lo, hi, err := Bootstrap([]float64{3, 3, 3}, mean, 200, 0.95, 1)
	if err != nil || lo != 3 || hi != 3 {
		t.Fatalf("constant sample: [%v, %v], %v; want [3, 3]", lo, hi, err)
	}
	xs := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	lo, hi, err = Bootstrap(xs, mean, 2000, 0.95, 7)
	if err != nil {
		t.Fatal(err)
	}
	// The mean 5.5 with sd/sqrt(n) = 0.908: a 95% interval roughly
	// [3.7, 7.3]; it must hold the mean and lie inside the data's range.
	if !(lo < 5.5 && hi > 5.5 && lo > 2.5 && hi < 8.5) {
		t.Errorf("bootstrap of the mean of 1..10: [%v, %v]", lo, hi)
	}
	lo2, hi2, _ := Bootstrap(xs, mean, 2000, 0.95, 7)
	if lo2 != lo || hi2 != hi {
		t.Errorf("same seed, different interval: [%v, %v] vs [%v, %v]", lo, hi, lo2, hi2)
	}
	if _, _, err := Bootstrap(xs, mean, 0, 0.95, 1); err == nil {
		t.Error("b 0: no error")
	}
	if _, _, err := Bootstrap(nil, mean, 10, 0.95, 1); err == nil {
		t.Error("no values: no error")
	}
}

// k3(ln 2) = 2 - 1 - 0.693147 = 0.306853; k3(-ln 2) = 0.5 - 1 + 0.693147.
func TestK3HandComputed(t *testing.T) {
	for _, c := range []struct{ logr, want float64 }{{0, 0}, {math.Ln2, 0.306853}, {-math.Ln2, 0.193147}} {
		if got := K3(c.logr); !near(got, c.want, 1e-6) {
			t.Errorf("K3(%v) = %v, want %v", c.logr, got, c.want)
		}
	}
}
