package model

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math"
	"slices"
	"strconv"

	"github.com/trajflow/trajflow/gpu/objective"
)

// Grammar is a constrained-decoding token mask (docs/PIPELINE.md §5). Allow must be
// a pure function of the segment prefix: given every token of the segment
// up to and including the current position, it sets allowed[v] = true for
// each token v that may follow (allowed arrives all false). Because it
// depends on the stored tokens only, the trainer recomputes exactly the
// mask the sampler used. A grammar must allow at least one token for every
// prefix, and must allow every token outside the spans it constrains (the
// trainer evaluates it at every position).
type Grammar interface {
	Allow(prefix []int32, allowed []bool)
	// ID names the grammar and its version; it enters Behavior.ID.
	ID() string
}

// Behavior is the behavior distribution of the built-in sampler (pipeline
// §5), in this order: the policy's logits z are scaled to z/Temperature;
// tokens the Grammar forbids are removed; top-k keeps the K most likely of
// the rest; top-p keeps the smallest most-likely prefix of those whose
// renormalized mass reaches TopP; min-p keeps those whose probability is
// at least MinP times the largest probability; the result is renormalized.
// Min-p compares probabilities with the most likely token, which every
// earlier filter keeps, so its threshold is the same whether it is measured
// on the masked distribution or after top-k/top-p: min-p keeps exactly the
// tokens v with p(v) >= MinP · max p of the temperature-scaled,
// grammar-masked distribution that top-k and top-p kept. (Applying min-p
// last matters only for top-p, whose cumulative mass it does not change.)
//
// The training contract of this package is that the trainer optimizes this
// same distribution: it applies Transform to the current logits on the
// exact stored tokens, so that before the first update the recomputed
// log-probs equal the behavior log-probs bit for bit (ratio exactly 1,
// docs/PIPELINE.md §21 "Ratio is not one before first update"). Top-k, top-p and
// min-p sets are recomputed from the current logits and treated as
// constant masks by the gradient. A consequence: once the parameters move,
// a stored token can fall outside the current kept set, where its log-prob
// is -Inf and the objective rejects the batch; contracts with top-k, top-p
// or min-p must therefore train on-policy (one optimizer step per batch,
// max_lag 0). The demo contract uses Temperature 1 and none of them, and
// may train off-policy.
type Behavior struct {
	Temperature float64 `json:"temperature"` // > 0
	TopK        int     `json:"top_k"`       // keep the K most likely tokens; 0 = off
	TopP        float64 `json:"top_p"`       // keep the smallest prefix of mass >= TopP; 0 or 1 = off
	MinP        float64 `json:"min_p"`       // keep tokens of probability >= MinP · the largest; 0 = off
	Grammar     Grammar `json:"-"`           // nil = unconstrained
}

// MinTemperature is the smallest temperature a Behavior takes: float32
// logits divided by less can overflow to infinity (greedy decoding is
// TopK 1 at temperature 1).
const MinTemperature = 1e-6

// Validate reports whether b is usable (ErrConfig).
func (b Behavior) Validate() error {
	if !(b.Temperature > 0) || math.IsInf(b.Temperature, 0) {
		return fmt.Errorf("%w: temperature %v must be positive and finite", ErrConfig, b.Temperature)
	}
	if b.Temperature < MinTemperature {
		return fmt.Errorf("%w: temperature %v is below %v: logits divided by it overflow float32 (greedy decoding is top_k 1 at temperature 1)", ErrConfig, b.Temperature, MinTemperature)
	}
	if b.TopK < 0 {
		return fmt.Errorf("%w: top_k %d must not be negative", ErrConfig, b.TopK)
	}
	if !(b.TopP >= 0 && b.TopP <= 1) {
		return fmt.Errorf("%w: top_p %v must be in [0, 1]", ErrConfig, b.TopP)
	}
	if !(b.MinP >= 0 && b.MinP < 1) {
		return fmt.Errorf("%w: min_p %v must be in [0, 1)", ErrConfig, b.MinP)
	}
	return nil
}

// ID is "sha256:<hex>" of the resolved behavior (temperature, top-k,
// top-p, grammar id, and min-p when it is on). A behavior without min-p
// has the id it had before min-p existed, so the ids recorded by earlier
// runs stay valid; the part list is length-prefixed, so an id with min-p
// never equals one without.
func (b Behavior) ID() string {
	g := ""
	if b.Grammar != nil {
		g = b.Grammar.ID()
	}
	parts := []string{"behavior/v1", strconv.FormatFloat(b.Temperature, 'g', -1, 64),
		strconv.Itoa(b.TopK), strconv.FormatFloat(b.TopP, 'g', -1, 64), g}
	if b.MinP != 0 {
		parts = append(parts, "min_p="+strconv.FormatFloat(b.MinP, 'g', -1, 64))
	}
	return hashStrings(parts...)
}

func hashStrings(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(strconv.Itoa(len(p))))
		h.Write([]byte{':'})
		h.Write([]byte(p))
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

// transformer holds the scratch buffers of Transform.
type transformer struct {
	allowed []bool
	order   []int32
	e       []float64
}

// Transform writes into out the behavior logits of one position: out[v] =
// float32(raw[v] / Temperature) for kept tokens and -Inf for tokens the
// grammar, top-k, top-p or min-p remove. prefix is the segment up to and including
// the position. The log-softmax of out is the behavior log-probability
// (objective.LogSoftmaxGather computes it the same way in sampler and
// trainer).
func (b Behavior) Transform(raw []float32, prefix []int32, out []float32) error {
	var t transformer
	return b.transform(&t, raw, prefix, out)
}

func (b Behavior) transform(t *transformer, raw []float32, prefix []int32, out []float32) error {
	V := len(raw)
	if len(out) != V {
		return fmt.Errorf("%w: transform into %d logits, have %d", ErrShape, len(out), V)
	}
	inv := b.Temperature
	for v, z := range raw {
		out[v] = float32(float64(z) / inv)
	}
	ninf := float32(math.Inf(-1))
	if b.Grammar != nil {
		t.allowed = grow(t.allowed, V)
		clear(t.allowed)
		b.Grammar.Allow(prefix, t.allowed)
		any := false
		for v, ok := range t.allowed {
			if !ok {
				out[v] = ninf
			} else {
				any = true
			}
		}
		if !any {
			return fmt.Errorf("%w: grammar %s allows no token after a prefix of %d tokens", ErrConfig, b.Grammar.ID(), len(prefix))
		}
	}
	topP := b.TopP > 0 && b.TopP < 1
	if (b.TopK <= 0 || b.TopK >= V) && !topP && b.MinP <= 0 {
		return nil
	}
	// Order the finite tokens by decreasing logit, ties by increasing id.
	t.order = t.order[:0]
	for v, z := range out {
		if !math.IsInf(float64(z), -1) {
			t.order = append(t.order, int32(v))
		}
	}
	slices.SortFunc(t.order, func(a, c int32) int {
		za, zc := out[a], out[c]
		switch {
		case za > zc:
			return -1
		case za < zc:
			return 1
		}
		return int(a - c)
	})
	keep := len(t.order)
	if b.TopK > 0 && b.TopK < keep {
		keep = b.TopK
	}
	if topP {
		// Probabilities over the top-k survivors, float64 in order.
		m := float64(out[t.order[0]])
		var s float64
		t.e = grow(t.e, keep)
		for j := 0; j < keep; j++ {
			t.e[j] = math.Exp(float64(out[t.order[j]]) - m)
			s += t.e[j]
		}
		var cum float64
		for j := 0; j < keep; j++ {
			cum += t.e[j] / s
			if cum >= b.TopP {
				keep = j + 1
				break
			}
		}
	}
	if b.MinP > 0 {
		// p(v) / p(top) = e^(z_v - z_top) (the normalizer cancels), float64;
		// decreasing along the order, so the kept tokens are a prefix. The
		// most likely token always stays (its ratio is 1 > MinP).
		m := float64(out[t.order[0]])
		for j := 1; j < keep; j++ {
			if math.Exp(float64(out[t.order[j]])-m) < b.MinP {
				keep = j
				break
			}
		}
	}
	for _, v := range t.order[keep:] {
		out[v] = ninf
	}
	return nil
}

// BehaviorLogits computes the behavior logits of every position of a row
// (tokens with position ids; nil positions mean one segment): Forward, then
// Transform per position with the segment prefix. raw receives the model
// logits and out the behavior logits (both [n*Vocab]); need and tape as in
// Forward (rows not needed are left 0 in both).
func (m *Model) BehaviorLogits(b Behavior, tokens, positions []int32, need []bool, tape *Tape, raw, out []float32) error {
	if err := b.Validate(); err != nil {
		return err
	}
	if err := m.Forward(tokens, positions, need, tape, raw); err != nil {
		return err
	}
	if len(out) != len(raw) {
		return fmt.Errorf("%w: %d behavior logits for %d logits", ErrShape, len(out), len(raw))
	}
	V := m.Config.Vocab
	var t transformer
	for i := range tokens {
		row := out[i*V : (i+1)*V]
		if need != nil && !need[i] {
			clear(row)
			continue
		}
		start := 0 // the segment's first position
		if positions != nil {
			start = i - int(positions[i])
		}
		if err := b.transform(&t, raw[i*V:(i+1)*V], tokens[start:i+1], row); err != nil {
			return fmt.Errorf("position %d: %w", i, err)
		}
	}
	return nil
}

// NextLogits computes the model's raw logits and the behavior's logits for
// the token that follows tokens: the distribution Policy.Generate draws the
// token at len(tokens) from, bit for bit (the same window, forward pass and
// transform over the whole prefix), without the rest of the sequence's
// positions. raw and out hold Vocab entries each. The tokens of the
// model's window must be in the vocabulary; the caller checked the rest.
func (m *Model) NextLogits(b Behavior, tokens []int32, raw, out []float32) error {
	c := m.Config
	switch {
	case len(tokens) == 0:
		return fmt.Errorf("%w: next logits of an empty sequence", ErrShape)
	case len(raw) != c.Vocab || len(out) != c.Vocab:
		return fmt.Errorf("%w: %d raw and %d behavior logits, vocab %d", ErrShape, len(raw), len(out), c.Vocab)
	}
	if err := b.Validate(); err != nil {
		return err
	}
	i := len(tokens) - 1
	win := make([]int32, c.Window)
	windowAt(tokens, i, int32(i), win)
	for s, t := range win {
		if t != PadID && (t < 0 || int(t) >= c.Vocab) {
			return fmt.Errorf("%w: token %d at position %d, vocab %d", ErrToken, t, i-(c.Window-1)+s, c.Vocab)
		}
	}
	m.positionLogits(m.Views(), win, make([]float32, c.In()), make([]float32, c.Hidden), raw)
	var t transformer
	return b.transform(&t, raw, tokens, out)
}

// BackpropBehavior turns dLoss/d(behavior logits) into dLoss/d(model
// logits) in place: d[v] = d[v] / Temperature for kept tokens and 0 for
// tokens the behavior removed (out[v] == -Inf). The kept set is treated as
// constant (a mask).
func (b Behavior) BackpropBehavior(behaviorLogits, d []float32) error {
	if len(d) != len(behaviorLogits) {
		return fmt.Errorf("%w: %d gradients for %d behavior logits", ErrShape, len(d), len(behaviorLogits))
	}
	for v, z := range behaviorLogits {
		if math.IsInf(float64(z), -1) {
			d[v] = 0
			continue
		}
		if d[v] != 0 {
			d[v] = float32(float64(d[v]) / b.Temperature)
		}
	}
	return nil
}

// LogprobsForTraining is the trainer's recomputation of behavior
// log-probabilities on stored tokens (docs/PIPELINE.md §12): for a packed row
// (inputIDs, positionIDs, segmentIDs as in schemas.PackedRow) it returns,
// aligned to next-token targets, out[i] = log p_behavior(inputIDs[i+1] |
// segment prefix up to i), and 0 where i+1 is outside i's segment
// (objective.ShiftTargets). On the tokens a Policy of the same parameters
// sampled, these equal the sampler's Sample.Logprobs bit for bit.
func (m *Model) LogprobsForTraining(b Behavior, inputIDs, positionIDs, segmentIDs []int32) ([]float32, error) {
	return m.LogprobsAt(b, inputIDs, positionIDs, segmentIDs, nil)
}

// LogprobsAt is LogprobsForTraining at the positions where mask is 1 (nil:
// every position with a target); out is 0 at every other position, and
// only the positions asked are computed. Each value is the one
// LogprobsForTraining gives at its position, bit for bit. The trainer's
// reference log-probs are LogprobsAt of the reference model with a packed
// row's action mask (docs/PIPELINE.md §12).
func (m *Model) LogprobsAt(b Behavior, inputIDs, positionIDs, segmentIDs []int32, mask []uint8) ([]float32, error) {
	if mask != nil && len(mask) != len(inputIDs) {
		return nil, fmt.Errorf("%w: %d mask entries for %d input ids", ErrShape, len(mask), len(inputIDs))
	}
	if err := CheckPositions(positionIDs, segmentIDs); err != nil {
		return nil, err
	}
	if len(positionIDs) != len(inputIDs) {
		return nil, fmt.Errorf("%w: %d position ids for %d input ids", ErrShape, len(positionIDs), len(inputIDs))
	}
	targets, err := objective.ShiftTargets(inputIDs, segmentIDs)
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	n, V := len(inputIDs), m.Config.Vocab
	need := make([]bool, n)
	for i, y := range targets {
		if mask != nil && mask[i] != 1 {
			targets[i] = objective.NoTarget // not gathered: out[i] stays 0
			continue
		}
		need[i] = y >= 0
	}
	raw := make([]float32, n*V)
	beh := make([]float32, n*V)
	if err := m.BehaviorLogits(b, inputIDs, positionIDs, need, nil, raw, beh); err != nil {
		return nil, err
	}
	out := make([]float32, n)
	if err := objective.LogSoftmaxGather(beh, n, V, targets, out); err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	return out, nil
}
