package dashboard

import (
	"math"
	"slices"
)

// z95 is the standard normal quantile of a two-sided 95% interval.
const z95 = 1.959963984540054

// Wilson returns the Wilson score interval of c successes in n trials at
// 95% confidence; it always holds c/n, exactly (at c = n the upper end is
// 1 whatever the rounding). With no trials nothing is known: [0, 1].
func Wilson(c, n int) (lo, hi float64) {
	if n <= 0 {
		return 0, 1
	}
	p := float64(c) / float64(n)
	nn := float64(n)
	z2 := z95 * z95
	den := 1 + z2/nn
	center := (p + z2/(2*nn)) / den
	half := z95 / den * math.Sqrt(p*(1-p)/nn+z2/(4*nn*nn))
	return math.Min(p, math.Max(0, center-half)), math.Max(p, math.Min(1, center+half))
}

// PassAtK is the unbiased estimator of pass@k from n samples of which c
// passed: 1 - C(n-c, k) / C(n, k), the probability that at least one of k
// samples drawn without replacement passes. It is computed as the product
// 1 - Π_{i=n-c+1..n} (1 - k/i), which equals the ratio of binomial
// coefficients and never overflows. k > n is undefined: NaN.
func PassAtK(n, c, k int) float64 {
	switch {
	case k < 1 || n < 1 || k > n || c < 0 || c > n:
		return math.NaN()
	case n-c < k:
		return 1
	}
	prod := 1.0
	for i := n - c + 1; i <= n; i++ {
		prod *= 1 - float64(k)/float64(i)
	}
	return 1 - prod
}

// Dist summarizes a sample: n, mean and quantiles.
type Dist struct {
	N    int     `json:"n"`
	Mean float64 `json:"mean"`
	Min  float64 `json:"min"`
	P10  float64 `json:"p10"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	Max  float64 `json:"max"`
}

// Summarize returns the Dist of v (v is sorted in place).
func Summarize(v []float64) Dist {
	if len(v) == 0 {
		return Dist{}
	}
	slices.Sort(v)
	var sum float64
	for _, x := range v {
		sum += x
	}
	q := func(p float64) float64 {
		return v[min(len(v)-1, int(math.Floor(p*float64(len(v)))))]
	}
	return Dist{N: len(v), Mean: sum / float64(len(v)), Min: v[0], P10: q(0.1), P50: q(0.5), P90: q(0.9), Max: v[len(v)-1]}
}

// finite replaces NaN and infinities (which JSON cannot carry) by 0.
func finite(x float64) float64 {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return 0
	}
	return x
}
