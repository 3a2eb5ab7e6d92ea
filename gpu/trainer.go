// Package gpu is the trainer consumer (docs/PIPELINE.md §12–§14): it turns
// packed batches into updates of the policy. This file is the CPU backend
// for the built-in policy (gpu/model): current log-probs on the exact
// stored tokens, the objective of gpu/objective, backpropagation, Adam with
// global gradient-norm clipping, and immutable policy versions.
package gpu

import (
	"errors"
	"fmt"
	"math"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

// Errors of the trainer.
var (
	// ErrBatch: a packed row is malformed (lengths, position ids) or the
	// batch has no trained token.
	ErrBatch = errors.New("gpu: bad batch")
	// ErrOptim: optimizer options are not usable.
	ErrOptim = errors.New("gpu: bad optimizer options")
)

// AdamOptions declares the optimizer (docs/PIPELINE.md §14).
type AdamOptions struct {
	LR          float64 `json:"lr" yaml:"lr"`                       // > 0
	Beta1       float64 `json:"beta1" yaml:"beta1"`                 // [0, 1)
	Beta2       float64 `json:"beta2" yaml:"beta2"`                 // [0, 1)
	Eps         float64 `json:"eps" yaml:"eps"`                     // > 0
	WeightDecay float64 `json:"weight_decay" yaml:"weight_decay"`   // decoupled (AdamW), >= 0
	MaxGradNorm float64 `json:"max_grad_norm" yaml:"max_grad_norm"` // clip the global L2 norm to this; 0 = off
}

// DefaultAdam is the demo's optimizer.
func DefaultAdam() AdamOptions {
	return AdamOptions{LR: 0.01, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, MaxGradNorm: 1}
}

// Validate reports whether o is usable (ErrOptim).
func (o AdamOptions) Validate() error {
	ok := func(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }
	switch {
	case !ok(o.LR) || o.LR <= 0:
		return fmt.Errorf("%w: lr %v", ErrOptim, o.LR)
	case !ok(o.Beta1) || o.Beta1 < 0 || o.Beta1 >= 1, !ok(o.Beta2) || o.Beta2 < 0 || o.Beta2 >= 1:
		return fmt.Errorf("%w: betas %v %v", ErrOptim, o.Beta1, o.Beta2)
	case !ok(o.Eps) || o.Eps <= 0:
		return fmt.Errorf("%w: eps %v", ErrOptim, o.Eps)
	case !ok(o.WeightDecay) || o.WeightDecay < 0, !ok(o.MaxGradNorm) || o.MaxGradNorm < 0:
		return fmt.Errorf("%w: weight decay %v, max grad norm %v", ErrOptim, o.WeightDecay, o.MaxGradNorm)
	}
	return nil
}

// Trainer holds the policy being trained, its Adam state and its version.
// It is not safe for concurrent use.
type Trainer struct {
	m        *model.Model
	behavior model.Behavior
	version  int64
	steps    int64
	m1, m2   []float64
	grad     []float32
	tape     model.Tape
	res      objective.Result
	// prox holds, for the decoupled objective, the proximal log-probs of
	// every row of batch proxBatch: the current log-probs of the first Step
	// on it since the last Update began (the policy at the start of the
	// update).
	prox      [][]float32
	proxBatch string
	proxOK    bool
}

// NewTrainer starts training m (copied) at policy version `version`. b is
// the behavior distribution the rollouts sample from (temperature,
// grammar, top-k/top-p): the trainer optimizes that same distribution, so
// that current and behavior log-probs agree exactly before the first
// update (see model.Behavior).
func NewTrainer(m *model.Model, b model.Behavior, version int64) (*Trainer, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	if err := b.Validate(); err != nil {
		return nil, err
	}
	n := m.Config.NumParams()
	return &Trainer{
		m: m.Clone(), behavior: b, version: version,
		m1: make([]float64, n), m2: make([]float64, n), grad: make([]float32, n),
	}, nil
}

// Version is the current policy version (incremented by every Step).
func (t *Trainer) Version() int64 { return t.version }

// Steps is the number of optimizer steps taken.
func (t *Trainer) Steps() int64 { return t.steps }

// Model returns a copy of the current model.
func (t *Trainer) Model() *model.Model { return t.m.Clone() }

// Policy returns an immutable sampling snapshot of the current version.
func (t *Trainer) Policy() *model.Policy { return model.NewPolicy(t.m, t.version) }

// Behavior is the behavior distribution the trainer optimizes.
func (t *Trainer) Behavior() model.Behavior { return t.behavior }

// Metrics of one update (docs/PIPELINE.md §13, §14, §20): schemas.UpdateMetrics.
type Metrics = schemas.UpdateMetrics

// CheckRow validates the shapes of one packed row (ErrBatch): every
// per-token column as long as the input ids, none empty, and positions
// that restart at 0 at every segment. Step checks every row with it.
func CheckRow(r *schemas.PackedRow) error {
	n := len(r.InputIDs)
	if n == 0 {
		return fmt.Errorf("%w: empty row", ErrBatch)
	}
	for _, c := range []struct {
		name string
		l    int
	}{
		{"position_ids", len(r.PositionIDs)}, {"segment_ids", len(r.SegmentIDs)}, {"action_mask", len(r.ActionMask)},
		{"old_logprobs", len(r.OldLogprobs)}, {"advantages", len(r.Advantages)}, {"policy_versions", len(r.PolicyVersions)},
	} {
		if c.l != n {
			return fmt.Errorf("%w: %d %s for %d input ids", ErrBatch, c.l, c.name, n)
		}
	}
	if r.RefLogprobs != nil && len(r.RefLogprobs) != n {
		return fmt.Errorf("%w: %d ref_logprobs for %d input ids", ErrBatch, len(r.RefLogprobs), n)
	}
	if err := model.CheckPositions(r.PositionIDs, r.SegmentIDs); err != nil {
		return fmt.Errorf("%w: %w", ErrBatch, err)
	}
	return nil
}

// Step performs one update on a packed batch (docs/PIPELINE.md §12–§14):
//
//  1. the global denominators of all rows (objective.GlobalDenominators);
//  2. per row: the behavior logits of the current model on the exact stored
//     tokens, with the window restarting at every segment start (position
//     ids), computed at trained positions only; objective.ComputeInto with
//     the global denominators; backpropagation through the behavior
//     transform and the model, accumulating one gradient in row order;
//  3. the global gradient norm, clipping to MaxGradNorm, one Adam step
//     (bias-corrected, decoupled weight decay);
//  4. the policy version increments.
//
// On error nothing is updated. The computation is sequential and in a fixed
// order, so the same batch from the same state gives the same parameters
// bit for bit.
//
// With the decoupled objective (objective.OffPolicyDecoupled) the
// proximal policy is the policy of the first Step on a batch id since the
// last Update began: Update's epochs share it; a Step on another batch
// takes a new one.
func (t *Trainer) Step(batch schemas.PackedBatch, opts objective.Options, adam AdamOptions) (Metrics, error) {
	if err := opts.Validate(); err != nil {
		return Metrics{}, fmt.Errorf("gpu: step: %w", err)
	}
	if err := adam.Validate(); err != nil {
		return Metrics{}, err
	}
	for i := range batch.Rows {
		if err := CheckRow(&batch.Rows[i]); err != nil {
			return Metrics{}, fmt.Errorf("gpu: batch %s row %d: %w", batch.BatchID, i, err)
		}
	}
	den, err := objective.GlobalDenominators(batch.Rows...)
	if err != nil {
		return Metrics{}, fmt.Errorf("gpu: batch %s: %w: %w", batch.BatchID, ErrBatch, err)
	}
	if den.Tokens == 0 {
		return Metrics{}, fmt.Errorf("%w: batch %s has no trained token", ErrBatch, batch.BatchID)
	}
	met := Metrics{Rows: len(batch.Rows), FromVersion: t.version}
	clear(t.grad)
	// The decoupled objective clips against the proximal policy: the
	// first step on a batch takes the current log-probs as proximal (its
	// clipped ratio is exactly 1) and keeps them for the next epochs.
	decoupled := opts.OffPolicy == objective.OffPolicyDecoupled
	takeProx := decoupled && (!t.proxOK || t.proxBatch != batch.BatchID || len(t.prox) != len(batch.Rows))
	if takeProx {
		t.prox, t.proxOK = make([][]float32, len(batch.Rows)), false
	}
	ok := false
	defer func() {
		if takeProx && ok {
			t.proxBatch, t.proxOK = batch.BatchID, true
		} else if takeProx {
			t.prox, t.proxOK = nil, false
		}
	}()
	V := t.m.Config.Vocab
	var lags [][]objective.LagStat
	first := true
	for ri := range batch.Rows {
		row := &batch.Rows[ri]
		n := len(row.InputIDs)
		met.Segments += len(row.SegLengths)
		met.InputTokens += int64(n)
		need := make([]bool, n)
		for i, mk := range row.ActionMask {
			need[i] = mk == 1
		}
		raw := make([]float32, n*V)
		beh := make([]float32, n*V)
		if err := t.m.BehaviorLogits(t.behavior, row.InputIDs, row.PositionIDs, need, &t.tape, raw, beh); err != nil {
			return Metrics{}, fmt.Errorf("gpu: batch %s row %d: %w", batch.BatchID, ri, err)
		}
		in, err := objective.InputsFromRow(*row, beh, V)
		if err != nil {
			return Metrics{}, fmt.Errorf("gpu: batch %s row %d: %w", batch.BatchID, ri, err)
		}
		if decoupled && !takeProx {
			in.ProxLogprobs = t.prox[ri]
		}
		if err := objective.ComputeInto(in, opts, den, &t.res); err != nil {
			return Metrics{}, fmt.Errorf("gpu: batch %s row %d: %w", batch.BatchID, ri, err)
		}
		if takeProx {
			t.prox[ri] = append([]float32(nil), t.res.CurLogprobs...)
		}
		if first {
			met.ObjectiveStats, first = t.res.Stats, false
		} else {
			met.ObjectiveStats = met.ObjectiveStats.Merge(t.res.Stats)
		}
		ls, err := objective.LagStats(t.res.CurLogprobs, row.OldLogprobs, row.PolicyVersions, row.ActionMask, t.version)
		if err != nil {
			return Metrics{}, fmt.Errorf("gpu: batch %s row %d: %w", batch.BatchID, ri, err)
		}
		lags = append(lags, ls)
		d := t.res.DLogits
		for i := 0; i < n; i++ {
			if need[i] {
				if err := t.behavior.BackpropBehavior(beh[i*V:(i+1)*V], d[i*V:(i+1)*V]); err != nil {
					return Metrics{}, err
				}
			}
		}
		if err := t.m.Backward(&t.tape, d, t.grad); err != nil {
			return Metrics{}, fmt.Errorf("gpu: batch %s row %d: %w", batch.BatchID, ri, err)
		}
	}
	met.Lag = objective.MergeLagStats(lags...)

	var sq float64
	for _, g := range t.grad {
		sq += float64(g) * float64(g)
	}
	met.GradNorm = math.Sqrt(sq)
	if math.IsNaN(met.GradNorm) || math.IsInf(met.GradNorm, 0) {
		return Metrics{}, fmt.Errorf("%w: batch %s: gradient norm %v", ErrBatch, batch.BatchID, met.GradNorm)
	}
	met.GradScale = 1
	if adam.MaxGradNorm > 0 && met.GradNorm > adam.MaxGradNorm {
		met.GradScale = adam.MaxGradNorm / met.GradNorm
	}
	t.steps++
	c1 := 1 - math.Pow(adam.Beta1, float64(t.steps))
	c2 := 1 - math.Pow(adam.Beta2, float64(t.steps))
	for i, g32 := range t.grad {
		g := float64(g32) * met.GradScale
		t.m1[i] = adam.Beta1*t.m1[i] + (1-adam.Beta1)*g
		t.m2[i] = adam.Beta2*t.m2[i] + (1-adam.Beta2)*g*g
		p := float64(t.m.Params[i])
		p -= adam.LR * (t.m1[i] / c1) / (math.Sqrt(t.m2[i]/c2) + adam.Eps)
		p -= adam.LR * adam.WeightDecay * float64(t.m.Params[i])
		t.m.Params[i] = float32(p)
	}
	t.version++
	met.Version = t.version
	ok = true
	return met, nil
}

// DefaultObjective is the trainer tests' loss: token-mean clipped
// surrogate with asymmetric clip [0.8, 1.28], no KL term, entropy bonus
// 0.05, log ratios clamped to ±objective.DefaultMaxLogRatio. The demo's
// loss is the contract's (contract.Default: the same with entropy bonus
// 0.1 and the decoupled objective).
func DefaultObjective() objective.Options {
	return objective.Options{
		ClipLow: 0.2, ClipHigh: 0.28, Normalization: objective.TokenMean,
		KLPlacement: objective.KLNone, EntropyCoef: 0.05, MaxLogRatio: objective.DefaultMaxLogRatio,
	}
}
