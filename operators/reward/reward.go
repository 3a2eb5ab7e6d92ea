// Package reward is the reward stage (docs/PIPELINE.md §8): it runs the
// evaluators the learning contract declares on a finalized, validated
// trajectory and records every reward component separately, versioned,
// with its raw score, weight, transform, scope, evidence, evaluator
// version, error and uncertainty.
//
// The stage is the pure function Score. Evaluators are looked up by name in
// a Registry; the built-in evaluators (invalid_action, length, turn_count)
// know nothing of any environment. Environment-specific validators (task
// success, process quality, judges) implement Evaluator and are registered
// beside them.
//
// A failing evaluator yields a component with Error set, not a zero: the
// reward of that component is unknown, which is an infrastructure failure
// and never an agent failure (docs/PIPELINE.md §8 "Distinguish validator failure
// from agent failure"). The validate stage quarantines such records
// ("reward_unavailable") so the attempt is retried.
package reward

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"

	"github.com/trajflow/trajflow/schemas"
)

// Evaluator computes one reward component of a trajectory.
//
// Evaluate returns the component's terms before weighting: for each term
// Raw, Scope (schemas.Scope*; "" means trajectory), Turn, SpanStart and
// SpanEnd (turn and span scopes), Evidence (what the evaluator looked at,
// e.g. JSON), Uncertainty (>= 0) and optionally EvaluatorVersion (the
// model or validator build behind Version, e.g. a judge checkpoint hash;
// Version() is used when empty). Name may be left empty; if set it must be
// Name(). Every other field is filled by Score. A trajectory-scoped
// evaluator returns exactly one term; a turn- or span-scoped one returns
// one term per place it scores, and must return at least one term (a raw 0
// when nothing happened), so that "nothing to report" and "unavailable"
// stay distinguishable.
//
// Evaluate must not modify t and must be deterministic for a given
// trajectory and version. An error means the evaluator could not judge
// (service down, sandbox crash, timeout); it must not be used to express a
// bad trajectory, which is a low Raw.
type Evaluator interface {
	Name() string
	Version() string
	Evaluate(ctx context.Context, t *schemas.Trajectory) ([]schemas.RewardComponent, error)
}

// Errors of the reward stage's configuration. They are returned by Score
// (wrapped with context) before any evaluator runs; they are never turned
// into component errors.
var (
	ErrUnknownEvaluator = errors.New("reward: no evaluator registered under this name")
	ErrVersionMismatch  = errors.New("reward: declared component version differs from the evaluator's")
	ErrInvalidComponent = errors.New("reward: invalid component declaration")
	ErrRegister         = errors.New("reward: cannot register evaluator")
)

// Registry maps evaluator names to evaluators. It is safe for concurrent
// use; the zero value is an empty registry.
type Registry struct {
	mu    sync.RWMutex
	evals map[string]Evaluator
}

// NewRegistry returns a registry holding evs, or an error wrapping
// ErrRegister if one of them cannot be registered.
func NewRegistry(evs ...Evaluator) (*Registry, error) {
	r := &Registry{}
	for _, e := range evs {
		if err := r.Register(e); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// NewBuiltinRegistry returns a registry holding the built-in evaluators.
func NewBuiltinRegistry() *Registry {
	r, err := NewRegistry(Builtins()...)
	if err != nil {
		panic(err) // the built-ins have distinct, non-empty names
	}
	return r
}

// Register adds e under e.Name(). A nil evaluator, an empty name or version,
// or a name already registered is an error wrapping ErrRegister; an
// existing registration is never replaced.
func (r *Registry) Register(e Evaluator) error {
	if e == nil {
		return fmt.Errorf("%w: nil evaluator", ErrRegister)
	}
	name, version := e.Name(), e.Version()
	if name == "" || version == "" {
		return fmt.Errorf("%w: evaluator name %q version %q must both be non-empty", ErrRegister, name, version)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if old, ok := r.evals[name]; ok {
		return fmt.Errorf("%w: %q already registered (version %s)", ErrRegister, name, old.Version())
	}
	if r.evals == nil {
		r.evals = make(map[string]Evaluator)
	}
	r.evals[name] = e
	return nil
}

// Lookup returns the evaluator registered under name.
func (r *Registry) Lookup(name string) (Evaluator, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	e, ok := r.evals[name]
	return e, ok
}

// Names returns the registered names, sorted.
func (r *Registry) Names() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]string, 0, len(r.evals))
	for n := range r.evals {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// Transform names. A transform maps a raw score before the weight is
// applied: Value = Weight * transform(Raw).
const (
	TransformIdentity = "identity" // x; also the meaning of ""
	TransformClip     = "clip"     // min(max(x, ClipMin), ClipMax)
	TransformTanh     = "tanh"     // tanh(x), squashes to (-1, 1)
	TransformNegate   = "negate"   // -x, for costs declared with a positive weight
)

// Component is one reward term as the learning contract declares it
// (docs/PIPELINE.md §2, §8). Name is both the component's name and the name of the
// evaluator that computes it; Version must equal that evaluator's Version().
// ClipMin and ClipMax are used only by TransformClip. A zero Weight keeps
// the component for analysis without letting it affect the total.
type Component struct {
	Name      string  `yaml:"name" json:"name"`
	Version   string  `yaml:"version" json:"version"`
	Weight    float64 `yaml:"weight" json:"weight"`
	Transform string  `yaml:"transform" json:"transform"`
	ClipMin   float64 `yaml:"clip_min" json:"clip_min"`
	ClipMax   float64 `yaml:"clip_max" json:"clip_max"`
}

// Validate reports a declaration error wrapping ErrInvalidComponent: empty
// name or version, a non-finite weight, an unknown transform, or clip bounds
// that are not finite with ClipMin <= ClipMax.
func (c Component) Validate() error {
	switch {
	case c.Name == "":
		return fmt.Errorf("%w: empty name", ErrInvalidComponent)
	case c.Version == "":
		return fmt.Errorf("%w: component %q has no version", ErrInvalidComponent, c.Name)
	case math.IsNaN(c.Weight) || math.IsInf(c.Weight, 0):
		return fmt.Errorf("%w: component %q weight %v", ErrInvalidComponent, c.Name, c.Weight)
	}
	switch c.Transform {
	case "", TransformIdentity, TransformTanh, TransformNegate:
	case TransformClip:
		if !finite(c.ClipMin) || !finite(c.ClipMax) || c.ClipMin > c.ClipMax {
			return fmt.Errorf("%w: component %q clip bounds [%v, %v]", ErrInvalidComponent, c.Name, c.ClipMin, c.ClipMax)
		}
	default:
		return fmt.Errorf("%w: component %q transform %q (want identity, clip, tanh or negate)", ErrInvalidComponent, c.Name, c.Transform)
	}
	return nil
}

// ValidateComponents validates every declaration and rejects duplicate
// names.
func ValidateComponents(comps []Component) error {
	seen := make(map[string]bool, len(comps))
	for _, c := range comps {
		if err := c.Validate(); err != nil {
			return err
		}
		if seen[c.Name] {
			return fmt.Errorf("%w: component %q declared twice", ErrInvalidComponent, c.Name)
		}
		seen[c.Name] = true
	}
	return nil
}

// Transformed returns transform(raw), before the weight.
func (c Component) Transformed(raw float64) float64 {
	switch c.Transform {
	case TransformClip:
		return min(max(raw, c.ClipMin), c.ClipMax)
	case TransformTanh:
		return math.Tanh(raw)
	case TransformNegate:
		return -raw
	}
	return raw
}

// Value returns Weight * transform(raw), the component's contribution to
// the reward total.
func (c Component) Value(raw float64) float64 { return c.Weight * c.Transformed(raw) }

// TransformLabel is the self-describing transform recorded in each
// component: "identity", "tanh", "negate", or "clip[min,max]" with the
// bounds in shortest round-trip form (e.g. "clip[-1,0.5]").
func (c Component) TransformLabel() string {
	switch c.Transform {
	case "", TransformIdentity:
		return TransformIdentity
	case TransformClip:
		return "clip[" + strconv.FormatFloat(c.ClipMin, 'g', -1, 64) + "," + strconv.FormatFloat(c.ClipMax, 'g', -1, 64) + "]"
	}
	return c.Transform
}

func finite(f float64) bool { return !math.IsNaN(f) && !math.IsInf(f, 0) }
