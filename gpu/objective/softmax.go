package objective

import (
	"errors"
	"fmt"
	"math"
)

// Sentinel errors. Every error returned by this package wraps one of them
// (test with errors.Is) and adds the offending position or length.
var (
	// ErrShape: a slice has the wrong length, or T/V are not positive.
	ErrShape = errors.New("objective: shape mismatch")
	// ErrTarget: a target id is outside [0, V), or a masked position has no
	// target.
	ErrTarget = errors.New("objective: bad target")
	// ErrInput: a value is not usable (NaN or +Inf logit, a row with no
	// finite logit, a non-finite masked old/ref log-prob or advantage, a mask
	// value other than 0/1, a segment id outside [0, T), denominators smaller
	// than the local counts).
	ErrInput = errors.New("objective: bad input")
	// ErrOptions: Options.Validate failed.
	ErrOptions = errors.New("objective: bad options")
	// ErrNonFinite wraps ErrInput: finite inputs gave a non-finite loss or
	// gradient (a log ratio or KL argument whose exp overflows), so the
	// batch cannot be trained and must be refused, never applied.
	ErrNonFinite = fmt.Errorf("%w: non-finite loss or gradient", ErrInput)
)

// NoTarget is the target id of a position that predicts nothing (the last
// position of a row, and the last position of every packed segment).
const NoTarget int32 = -1

// ShiftTargets returns the next-token targets of a row (docs/PIPELINE.md §11, §12:
// logits at position i predict input_ids[i+1]):
//
//	targets[i] = inputIDs[i+1]  when i+1 < len and segment i == segment i+1
//	targets[i] = NoTarget       otherwise
//
// segmentIDs may be nil (one sequence); otherwise it must have the length of
// inputIDs. Marking segment ends with NoTarget keeps a packed row from ever
// training a prediction across two trajectories; the packer masks those
// positions anyway.
func ShiftTargets(inputIDs, segmentIDs []int32) ([]int32, error) {
	if segmentIDs != nil && len(segmentIDs) != len(inputIDs) {
		return nil, fmt.Errorf("objective: shift targets: %d segment ids for %d input ids: %w",
			len(segmentIDs), len(inputIDs), ErrShape)
	}
	out := make([]int32, len(inputIDs))
	for i := range inputIDs {
		switch {
		case i+1 >= len(inputIDs):
			out[i] = NoTarget
		case segmentIDs != nil && segmentIDs[i] != segmentIDs[i+1]:
			out[i] = NoTarget
		default:
			out[i] = inputIDs[i+1]
		}
	}
	return out, nil
}

// checkTV validates the logits shape.
func checkTV(nLogits, T, V int) error {
	if T < 0 || V <= 0 {
		return fmt.Errorf("objective: T=%d V=%d: %w", T, V, ErrShape)
	}
	if T > 0 && V > math.MaxInt/T || nLogits != T*V {
		return fmt.Errorf("objective: %d logits for T=%d V=%d: %w", nLogits, T, V, ErrShape)
	}
	return nil
}

// rowMax returns the largest logit of one position. NaN and +Inf are
// rejected; -Inf is allowed (a vocabulary entry masked out) as long as one
// logit is finite.
func rowMax[F float32 | float64](z []F, pos int) (float64, error) {
	m := math.Inf(-1)
	for v, x := range z {
		f := float64(x)
		if f != f || math.IsInf(f, 1) {
			return 0, fmt.Errorf("objective: logit %v at position %d vocab %d: %w", f, pos, v, ErrInput)
		}
		if f > m {
			m = f
		}
	}
	if math.IsInf(m, -1) {
		return 0, fmt.Errorf("objective: position %d has no finite logit: %w", pos, ErrInput)
	}
	return m, nil
}

// softmaxRow computes, for one position, e[v] = exp(z[v] - max) into e (when
// e is non-nil) and returns the max, s = Σ e[v] and log s. Accumulation is
// float64 in vocabulary order, so the result is deterministic.
func softmaxRow[F float32 | float64](z []F, e []float64, pos int) (m, s, logS float64, err error) {
	m, err = rowMax(z, pos)
	if err != nil {
		return 0, 0, 0, err
	}
	for v, x := range z {
		ev := math.Exp(float64(x) - m)
		if e != nil {
			e[v] = ev
		}
		s += ev
	}
	return m, s, math.Log(s), nil
}

// softmaxEntropyRow is softmaxRow that also returns the entropy
// H = -Σ p log p of the position, accumulated in the same pass. H is
// evaluated as log s - Σ e·(z-m) / s: both terms are non-negative, so there
// is no cancellation; entries with e = 0 (logit -Inf or far below the max)
// contribute exactly 0.
func softmaxEntropyRow[F float32 | float64](z []F, e []float64, pos int) (m, s, logS, h float64, err error) {
	m, err = rowMax(z, pos)
	if err != nil {
		return 0, 0, 0, 0, err
	}
	var acc float64
	for v, x := range z {
		d := float64(x) - m
		ev := math.Exp(d)
		e[v] = ev
		s += ev
		if ev != 0 {
			acc += ev * d
		}
	}
	logS = math.Log(s)
	return m, s, logS, logS - acc/s, nil
}

// LogSoftmaxGather writes out[i] = log_softmax(logits[i*V:(i+1)*V])[targets[i]]
// for every position i in [0, T) (docs/PIPELINE.md §12). The log-sum-exp subtracts
// the row maximum and accumulates in float64 in vocabulary order; the result
// is rounded once to float32. Positions whose target is negative (NoTarget)
// get out[i] = 0 and are otherwise ignored (their logits are not read).
//
// Errors: len(logits) != T*V, len(targets) or len(out) != T (ErrShape); a
// target >= V (ErrTarget); a NaN or +Inf logit, or a position whose logits
// are all -Inf (ErrInput).
func LogSoftmaxGather(logits []float32, T, V int, targets []int32, out []float32) error {
	if err := checkTV(len(logits), T, V); err != nil {
		return fmt.Errorf("log-softmax gather: %w", err)
	}
	if len(targets) != T || len(out) != T {
		return fmt.Errorf("objective: log-softmax gather: %d targets, %d outputs for T=%d: %w",
			len(targets), len(out), T, ErrShape)
	}
	for i := 0; i < T; i++ {
		y := targets[i]
		if y < 0 {
			out[i] = 0
			continue
		}
		if int(y) >= V {
			return fmt.Errorf("objective: log-softmax gather: target %d at position %d, V=%d: %w", y, i, V, ErrTarget)
		}
		z := logits[i*V : (i+1)*V]
		m, _, logS, err := softmaxRow(z, nil, i)
		if err != nil {
			return fmt.Errorf("log-softmax gather: %w", err)
		}
		out[i] = float32(float64(z[y]) - m - logS)
	}
	return nil
}

// Entropy writes out[i] = -Σ_v p_v log p_v of the softmax of every position
// i in [0, T) (in nats), accumulated in float64 in vocabulary order and
// rounded once to float32. Errors as for LogSoftmaxGather.
func Entropy(logits []float32, T, V int, out []float32) error {
	if err := checkTV(len(logits), T, V); err != nil {
		return fmt.Errorf("entropy: %w", err)
	}
	if len(out) != T {
		return fmt.Errorf("objective: entropy: %d outputs for T=%d: %w", len(out), T, ErrShape)
	}
	e := make([]float64, V)
	for i := 0; i < T; i++ {
		z := logits[i*V : (i+1)*V]
		_, _, _, h, err := softmaxEntropyRow(z, e, i)
		if err != nil {
			return fmt.Errorf("entropy: %w", err)
		}
		out[i] = float32(h)
	}
	return nil
}
