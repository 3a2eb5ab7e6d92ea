package objective

import (
	"fmt"
	"math"
	"sort"

	"github.com/trajflow/trajflow/schemas"
)

// LagStat summarizes the masked tokens sampled Lag policy versions before
// the trainer's version (docs/PIPELINE.md §13: "log ... the ratio distribution by
// policy lag"). The ratio is r = exp(cur - old), unclamped below
// exp(MaxReportedLogRatio), where it saturates.
type LagStat = schemas.LagStat

// MaxReportedLogRatio is where the ratios LagStats reports saturate: a
// log ratio above 600 counts as 600 in RatioMean, RatioMin, RatioMax and
// K3 (ApproxKL keeps the log ratio itself: float32 log-probs bound its
// square far inside float64). exp(600) is about 4e260, so the sums and
// means stay finite for any count of tokens below 1e47, and an update
// record (JSON, which has no infinity) carries them; an unclamped log
// ratio of 710 would make a ratio of +Inf. Such a ratio means a behavior
// log-prob hundreds of nats below the current policy's (a corrupted or
// clamped log-prob, or a token the behavior policy all but excluded); the
// loss clamps far lower (Options.MaxLogRatio, 20 by default) and counts
// the tokens it clamped.
const MaxReportedLogRatio = 600

// LagStats groups the masked tokens of one row (or of Concat'ed rows) by
// policy lag = trainerVersion - versions[i] and returns one LagStat per lag
// present, in increasing lag order. curLogprobs is Result.CurLogprobs,
// old the behavior log-probs, versions schemas.PackedRow.PolicyVersions
// (aligned to targets). Accumulation is float64 in position order.
//
// Errors: length mismatch (ErrShape); a mask value other than 0/1, a masked
// token with a negative version or a version newer than trainerVersion, or
// a non-finite masked log-prob (ErrInput).
func LagStats(curLogprobs, old []float32, versions []int32, mask []uint8, trainerVersion int64) ([]LagStat, error) {
	T := len(mask)
	if len(curLogprobs) != T || len(old) != T || len(versions) != T {
		return nil, fmt.Errorf("objective: lag stats: %d cur, %d old, %d versions for %d mask entries: %w",
			len(curLogprobs), len(old), len(versions), T, ErrShape)
	}
	type acc struct {
		n                 int64
		rSum, kSum, k3Sum float64
		rMin, rMax        float64
	}
	byLag := map[int64]*acc{}
	for i, m := range mask {
		switch m {
		case 0:
			continue
		case 1:
		default:
			return nil, fmt.Errorf("objective: lag stats: action mask %d at position %d: %w", m, i, ErrInput)
		}
		v := int64(versions[i])
		if v < 0 || v > trainerVersion {
			return nil, fmt.Errorf("objective: lag stats: version %d at position %d, trainer version %d: %w",
				v, i, trainerVersion, ErrInput)
		}
		lr := float64(curLogprobs[i]) - float64(old[i])
		if !finite(lr) {
			return nil, fmt.Errorf("objective: lag stats: log ratio %v at position %d: %w", lr, i, ErrInput)
		}
		a := byLag[trainerVersion-v]
		if a == nil {
			a = &acc{rMin: math.Inf(1), rMax: math.Inf(-1)}
			byLag[trainerVersion-v] = a
		}
		sat := min(lr, MaxReportedLogRatio)
		r := math.Exp(sat)
		a.n++
		a.rSum += r
		a.kSum += 0.5 * lr * lr
		a.k3Sum += r - 1 - sat
		a.rMin = math.Min(a.rMin, r)
		a.rMax = math.Max(a.rMax, r)
	}
	out := make([]LagStat, 0, len(byLag))
	for lag, a := range byLag {
		n := float64(a.n)
		out = append(out, LagStat{
			Lag: lag, Tokens: a.n,
			RatioMean: a.rSum / n, RatioMin: a.rMin, RatioMax: a.rMax,
			ApproxKL: a.kSum / n, K3: a.k3Sum / n,
		})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Lag < out[j].Lag })
	return out, nil
}

// MergeLagStats combines the LagStats of disjoint token sets: entries of
// equal Lag are merged (means re-weighted by Tokens, min/max combined); the
// result is in increasing lag order.
func MergeLagStats(parts ...[]LagStat) []LagStat {
	byLag := map[int64]LagStat{}
	for _, p := range parts {
		for _, s := range p {
			if s.Tokens == 0 {
				continue
			}
			t, ok := byLag[s.Lag]
			if !ok {
				byLag[s.Lag] = s
				continue
			}
			nt, ns := float64(t.Tokens), float64(s.Tokens)
			n := nt + ns
			t.RatioMean = (t.RatioMean*nt + s.RatioMean*ns) / n
			t.ApproxKL = (t.ApproxKL*nt + s.ApproxKL*ns) / n
			t.K3 = (t.K3*nt + s.K3*ns) / n
			t.RatioMin = math.Min(t.RatioMin, s.RatioMin)
			t.RatioMax = math.Max(t.RatioMax, s.RatioMax)
			t.Tokens += s.Tokens
			byLag[s.Lag] = t
		}
	}
	out := make([]LagStat, 0, len(byLag))
	for _, s := range byLag {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Lag < out[j].Lag })
	return out
}
