// Package gate holds the statistics of the evaluation plane and the
// decision gate of a run (docs/PIPELINE.md §16, §17): Wilson score intervals for
// rates, the unbiased pass@k estimator, percentile bootstrap intervals for
// statistics without a closed form (p95 turns), and Decide, which applies
// the learning contract's objective and stop rules to one evaluation and
// answers promote, continue, rollback or stop with its evidence.
//
// The package is pure: no I/O, no clock, no global state; every random
// stream is seeded by the caller.
package gate

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
)

// Z95 is the standard normal quantile of a two-sided 95% interval.
const Z95 = 1.959963984540054

// Wilson is the Wilson score interval of a rate with k successes in n
// trials at normal quantile z: [lo, hi], clamped to [0, 1]. The interval
// always holds the observed rate k/n, exactly: at k = n its upper end is 1
// and at k = 0 its lower end 0, whatever the rounding of the closed form.
// n must be >= 1 and 0 <= k <= n.
func Wilson(k, n int, z float64) (lo, hi float64, err error) {
	if n < 1 || k < 0 || k > n {
		return 0, 0, fmt.Errorf("gate: wilson interval of %d successes in %d trials: want 0 <= k <= n, n >= 1", k, n)
	}
	if !(z > 0) || math.IsInf(z, 0) {
		return 0, 0, fmt.Errorf("gate: wilson interval: quantile z %v must be finite and > 0", z)
	}
	nf, p := float64(n), float64(k)/float64(n)
	z2 := z * z
	denom := 1 + z2/nf
	center := (p + z2/(2*nf)) / denom
	half := z * math.Sqrt(p*(1-p)/nf+z2/(4*nf*nf)) / denom
	return math.Min(p, math.Max(0, center-half)), math.Max(p, math.Min(1, center+half)), nil
}

// PassAtK is the unbiased estimator of pass@k for one task with c correct
// samples among n (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), computed as
// a product without large binomials. It needs 1 <= k <= n, 0 <= c <= n.
func PassAtK(n, c, k int) (float64, error) {
	if n < 1 || k < 1 || k > n || c < 0 || c > n {
		return 0, fmt.Errorf("gate: pass@%d of %d correct in %d samples: want 1 <= k <= n, 0 <= c <= n", k, c, n)
	}
	if n-c < k {
		return 1, nil
	}
	q := 1.0 // C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
	for i := n - c + 1; i <= n; i++ {
		q *= 1 - float64(k)/float64(i)
	}
	return 1 - q, nil
}

// MeanPassAtK is the mean pass@k over tasks, each with n[i] samples of
// which c[i] are correct.
func MeanPassAtK(n, c []int, k int) (float64, error) {
	if len(n) == 0 || len(n) != len(c) {
		return 0, fmt.Errorf("gate: pass@%d over %d tasks with %d counts: want one count per task, at least one task", k, len(n), len(c))
	}
	s := 0.0
	for i := range n {
		p, err := PassAtK(n[i], c[i], k)
		if err != nil {
			return 0, fmt.Errorf("task %d: %w", i, err)
		}
		s += p
	}
	return s / float64(len(n)), nil
}

// Quantile is the q-quantile (q in [0, 1]) of xs by the nearest-rank
// method: the smallest x with at least ceil(q*n) values <= x (q 0 is the
// minimum). xs is not modified.
func Quantile(xs []float64, q float64) (float64, error) {
	if len(xs) == 0 {
		return 0, errors.New("gate: quantile of no values")
	}
	if !(q >= 0 && q <= 1) {
		return 0, fmt.Errorf("gate: quantile %v: want q in [0, 1]", q)
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	r := int(math.Ceil(q * float64(len(s))))
	return s[max(r, 1)-1], nil
}

// Bootstrap is the percentile bootstrap interval of stat over xs: stat of
// b resamples with replacement drawn from a PCG stream seeded by seed, and
// the (1-level)/2 and (1+level)/2 quantiles of the b values. The same seed
// gives the same interval.
func Bootstrap(xs []float64, stat func([]float64) float64, b int, level float64, seed uint64) (lo, hi float64, err error) {
	if len(xs) == 0 {
		return 0, 0, errors.New("gate: bootstrap of no values")
	}
	if b < 1 || !(level > 0 && level < 1) {
		return 0, 0, fmt.Errorf("gate: bootstrap with %d resamples at level %v: want b >= 1, level in (0, 1)", b, level)
	}
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	vals := make([]float64, b)
	res := make([]float64, len(xs))
	for i := range vals {
		for j := range res {
			res[j] = xs[rng.IntN(len(xs))]
		}
		vals[i] = stat(res)
	}
	if lo, err = Quantile(vals, (1-level)/2); err != nil {
		return 0, 0, err
	}
	hi, err = Quantile(vals, (1+level)/2)
	return lo, hi, err
}

// K3 is the k3 estimator of KL(p || q) for one token sampled from p with
// logr = log q - log p: exp(logr) - 1 - logr, unbiased and >= 0.
func K3(logr float64) float64 { return math.Expm1(logr) - logr }
