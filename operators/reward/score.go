package reward

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/trajflow/trajflow/schemas"
)

// Score is the reward stage: it runs the evaluator of every declared
// component on t and returns the rewarded trajectory.
//
// Contract:
//   - Configuration errors come back as an error and no evaluator runs: a
//     nil t or reg, an invalid declaration (ErrInvalidComponent), a
//     component with no registered evaluator (ErrUnknownEvaluator), or a
//     declared version that differs from the evaluator's Version()
//     (ErrVersionMismatch).
//   - Evaluators run one after another in declaration order. Rewards holds
//     their terms in that order, each evaluator's terms in the order it
//     returned them, so the output is a deterministic function of t.
//   - Each term records Name and Version (declared), Raw, Weight, the
//     transform label (Component.TransformLabel), Value = Weight *
//     transform(Raw), Scope, Turn (-1 for trajectory scope), span, Evidence,
//     EvaluatorVersion, Uncertainty and TrajectoryID = t.RecordID.
//   - An evaluator that returns an error, panics, or returns no or invalid
//     terms (wrong name, unknown scope, a turn or span outside t, non-finite
//     raw, negative or non-finite uncertainty, duplicated place, non-finite
//     value) yields one trajectory-scoped term with Error set and Raw =
//     Value = 0. Such a term is unavailable, not zero: RewardTotal sums the
//     values of available terms only, in output order.
//   - If ctx is done, Score returns ctx's error (wrapped) instead of a
//     result, also when an evaluator fails after ctx ended: a stage
//     shutting down must not record evaluator failures. Per-evaluator
//     deadlines belong inside the evaluator and, when they expire, are
//     evaluator failures.
//
// The returned Rewarded embeds a shallow copy of *t (it shares the turn
// slices); t itself is not modified.
func Score(ctx context.Context, t *schemas.Trajectory, comps []Component, reg *Registry) (schemas.Rewarded, error) {
	if t == nil {
		return schemas.Rewarded{}, errors.New("reward: nil trajectory")
	}
	if reg == nil {
		return schemas.Rewarded{}, errors.New("reward: nil registry")
	}
	if err := ValidateComponents(comps); err != nil {
		return schemas.Rewarded{}, fmt.Errorf("reward: trajectory %s: %w", t.RecordID, err)
	}
	evals := make([]Evaluator, len(comps))
	for i, c := range comps {
		e, ok := reg.Lookup(c.Name)
		if !ok {
			return schemas.Rewarded{}, fmt.Errorf("%w: component %q", ErrUnknownEvaluator, c.Name)
		}
		if v := e.Version(); v != c.Version {
			return schemas.Rewarded{}, fmt.Errorf("%w: component %q declared version %q, evaluator version %q", ErrVersionMismatch, c.Name, c.Version, v)
		}
		evals[i] = e
	}

	out := schemas.Rewarded{Trajectory: *t, Rewards: make([]schemas.RewardComponent, 0, len(comps))}
	for i, c := range comps {
		if err := ctx.Err(); err != nil {
			return schemas.Rewarded{}, fmt.Errorf("reward: trajectory %s: %w", t.RecordID, err)
		}
		terms, err := evaluate(ctx, evals[i], t)
		if err == nil {
			terms, err = finish(terms, c, evals[i], t)
		}
		if err != nil {
			if cerr := ctx.Err(); cerr != nil {
				return schemas.Rewarded{}, fmt.Errorf("reward: trajectory %s: component %q: %w", t.RecordID, c.Name, cerr)
			}
			out.Rewards = append(out.Rewards, failed(c, evals[i], t, err))
			continue
		}
		out.Rewards = append(out.Rewards, terms...)
	}
	for i := range out.Rewards {
		if out.Rewards[i].Error == "" {
			out.RewardTotal += out.Rewards[i].Value
		}
	}
	return out, nil
}

// evaluate runs e, turning a panic into an error.
func evaluate(ctx context.Context, e Evaluator, t *schemas.Trajectory) (terms []schemas.RewardComponent, err error) {
	defer func() {
		if p := recover(); p != nil {
			terms, err = nil, fmt.Errorf("evaluator panicked: %v", p)
		}
	}()
	return e.Evaluate(ctx, t)
}

// finish checks the evaluator's terms and returns a copy with the declared
// fields filled; the evaluator's slice is not modified. It reports the first
// invalid term.
func finish(in []schemas.RewardComponent, c Component, e Evaluator, t *schemas.Trajectory) ([]schemas.RewardComponent, error) {
	if len(in) == 0 {
		return nil, errors.New("evaluator returned no terms")
	}
	terms := slices.Clone(in)
	type place struct{ scope, turn, start, end int32 }
	seen := make(map[place]bool, len(terms))
	label := c.TransformLabel()
	for i := range terms {
		p := &terms[i]
		if p.Name != "" && p.Name != c.Name {
			return nil, fmt.Errorf("term %d: name %q, want %q", i, p.Name, c.Name)
		}
		key := place{turn: p.Turn, start: p.SpanStart, end: p.SpanEnd}
		switch p.Scope {
		case "", schemas.ScopeTrajectory:
			p.Scope, p.Turn, p.SpanStart, p.SpanEnd = schemas.ScopeTrajectory, -1, 0, 0
			key = place{scope: 0}
		case schemas.ScopeTurn:
			if p.Turn < 0 || int(p.Turn) >= len(t.Turns) {
				return nil, fmt.Errorf("term %d: turn %d of %d", i, p.Turn, len(t.Turns))
			}
			p.SpanStart, p.SpanEnd = 0, 0
			key = place{scope: 1, turn: p.Turn}
		case schemas.ScopeSpan:
			if p.Turn < 0 || int(p.Turn) >= len(t.Turns) {
				return nil, fmt.Errorf("term %d: turn %d of %d", i, p.Turn, len(t.Turns))
			}
			if n := int32(len(t.Turns[p.Turn].ActionIDs)); p.SpanStart < 0 || p.SpanStart >= p.SpanEnd || p.SpanEnd > n {
				return nil, fmt.Errorf("term %d: span [%d,%d) of turn %d with %d action tokens", i, p.SpanStart, p.SpanEnd, p.Turn, n)
			}
			key.scope = 2
		default:
			return nil, fmt.Errorf("term %d: scope %q", i, p.Scope)
		}
		if seen[key] {
			return nil, fmt.Errorf("term %d: %s scope, turn %d scored twice", i, p.Scope, p.Turn)
		}
		seen[key] = true
		if !finite(p.Raw) {
			return nil, fmt.Errorf("term %d: raw %v", i, p.Raw)
		}
		if !finite(p.Uncertainty) || p.Uncertainty < 0 {
			return nil, fmt.Errorf("term %d: uncertainty %v", i, p.Uncertainty)
		}
		p.TrajectoryID = t.RecordID
		p.Name, p.Version = c.Name, c.Version
		p.Weight, p.Transform = c.Weight, label
		p.Value = c.Value(p.Raw)
		if !finite(p.Value) {
			return nil, fmt.Errorf("term %d: value %v (raw %v, weight %v)", i, p.Value, p.Raw, c.Weight)
		}
		if p.EvaluatorVersion == "" {
			p.EvaluatorVersion = e.Version()
		}
		p.Error = ""
	}
	return terms, nil
}

// failed is the unavailable term recorded for an evaluator failure.
func failed(c Component, e Evaluator, t *schemas.Trajectory, err error) schemas.RewardComponent {
	msg := err.Error()
	if msg == "" {
		msg = "evaluator failed"
	}
	return schemas.RewardComponent{
		TrajectoryID:     t.RecordID,
		Name:             c.Name,
		Version:          c.Version,
		Weight:           c.Weight,
		Transform:        c.TransformLabel(),
		Scope:            schemas.ScopeTrajectory,
		Turn:             -1,
		EvaluatorVersion: e.Version(),
		Error:            msg,
	}
}
