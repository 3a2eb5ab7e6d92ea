package dashboard

import (
	"math"
	"slices"

	"github.com/trajflow/trajflow/internal/gate"
)

// Wilson returns the Wilson score interval of c successes in n trials at
// 95% confidence (gate.Wilson, which always holds c/n exactly). With no
// trials, or counts that are not a rate, nothing is known: [0, 1].
func Wilson(c, n int) (lo, hi float64) {
	lo, hi, err := gate.Wilson(c, n, gate.Z95)
	if err != nil {
		return 0, 1
	}
	return lo, hi
}

// PassAtK is the unbiased estimator of pass@k from n samples of which c
// passed (gate.PassAtK); where it is undefined (k > n, k < 1, c outside
// [0, n]) it is NaN, which the view renders as missing.
func PassAtK(n, c, k int) float64 {
	v, err := gate.PassAtK(n, c, k)
	if err != nil {
		return math.NaN()
	}
	return v
}

// Dist summarizes a sample: n, mean and quantiles.
type Dist struct {
	N    int     `json:"n"`
	Mean float64 `json:"mean"`
	Min  float64 `json:"min"`
	P10  float64 `json:"p10"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
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
	return Dist{N: len(v), Mean: sum / float64(len(v)), Min: v[0], P10: q(0.1), P50: q(0.5), P90: q(0.9), P99: q(0.99), Max: v[len(v)-1]}
}

// finite replaces NaN and infinities (which JSON cannot carry) by 0.
func finite(x float64) float64 {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return 0
	}
	return x
}
