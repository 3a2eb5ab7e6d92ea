// Package model is trajflow's tiny built-in policy: a fixed-window MLP
// language model small enough to train on a CPU in seconds, with a
// hand-written backward pass, deterministic initialization, a checkpoint
// format, and the exact behavior sampler of the built-in policy server
// (docs/PIPELINE.md §5, §12; docs/SYSTEMS.md §8, §9).
//
// Architecture. For position i of a segment, the input is the window of the
// last Window tokens ending at i (token i in the last slot). Slots that fall
// before the start of the segment hold PadID, so a packed row never lets one
// segment see another's tokens (docs/PIPELINE.md §11: "attention structure that
// prevents cross-example leakage when packed"). With x the concatenation of
// the slots' embeddings:
//
//	h      = tanh(W1 x + b1)         (Hidden units)
//	logits = W2 h + b2               (Vocab entries)
//
// logits at position i predict the token at i+1 (docs/PIPELINE.md §11).
//
// Determinism. Every dot product is accumulated in float32 in a fixed order
// and every product is explicitly rounded before it is added, which forbids
// fused multiply-add (Go specification, "Floating-point operators"): the
// logits of a position are bit-identical on every architecture, whichever
// code path (sampler or trainer) computes them, because both call the same
// per-position routine.
package model

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
)

// PadID is the token id that fills window slots before the start of a
// segment. Tokenizers of the built-in policy reserve it.
const PadID int32 = 0

// Errors of this package; every error returned wraps one of them.
var (
	// ErrConfig: a Config or sampler setting is not usable.
	ErrConfig = errors.New("model: bad config")
	// ErrShape: a slice has the wrong length, or position ids are not a
	// run restarting at 0 per segment.
	ErrShape = errors.New("model: shape mismatch")
	// ErrToken: a token id outside [0, Vocab).
	ErrToken = errors.New("model: token out of range")
	// ErrCheckpoint: a checkpoint could not be decoded or does not match
	// its declared hash.
	ErrCheckpoint = errors.New("model: bad checkpoint")
)

// Config is the architecture of the model. All fields must be positive.
type Config struct {
	Vocab  int `json:"vocab" yaml:"vocab"`   // vocabulary size; id 0 is PadID
	Window int `json:"window" yaml:"window"` // tokens of context per prediction
	Embed  int `json:"embed" yaml:"embed"`   // embedding width
	Hidden int `json:"hidden" yaml:"hidden"` // hidden units
}

// DefaultConfig is the configuration of the demo policy.
func DefaultConfig() Config { return Config{Vocab: 32, Window: 12, Embed: 16, Hidden: 64} }

// maxDim bounds every dimension so that parameter counts fit comfortably
// in an int on every platform and a checkpoint header cannot demand an
// absurd allocation.
const maxDim = 1 << 16

// MaxParams bounds a model's parameter count (Config.Validate).
const MaxParams = 1 << 28

// Validate reports whether c is usable (ErrConfig).
func (c Config) Validate() error {
	for _, d := range []struct {
		name string
		v    int
	}{{"vocab", c.Vocab}, {"window", c.Window}, {"embed", c.Embed}, {"hidden", c.Hidden}} {
		if d.v <= 0 || d.v > maxDim {
			return fmt.Errorf("%w: %s %d not in [1, %d]", ErrConfig, d.name, d.v, maxDim)
		}
	}
	if n := c.NumParams(); n > MaxParams {
		return fmt.Errorf("%w: %d parameters (max %d)", ErrConfig, n, MaxParams)
	}
	return nil
}

// In is the input width Window*Embed.
func (c Config) In() int { return c.Window * c.Embed }

// NumParams is the length of the flat parameter vector.
func (c Config) NumParams() int {
	return c.Vocab*c.Embed + c.Hidden*c.In() + c.Hidden + c.Vocab*c.Hidden + c.Vocab
}

// Hash is "sha256:<hex>" of the architecture name and the four dimensions
// (little-endian uint32): the model_config_hash of a policy release
// (docs/SYSTEMS.md §8).
func (c Config) Hash() string {
	h := sha256.New()
	h.Write([]byte("trajflow/model/window-mlp/v1"))
	var b [4]byte
	for _, v := range []int{c.Vocab, c.Window, c.Embed, c.Hidden} {
		binary.LittleEndian.PutUint32(b[:], uint32(v))
		h.Write(b[:])
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

// offsets of the named views inside the flat parameter vector, in this
// order: Emb [Vocab][Embed], W1 [Hidden][In], B1 [Hidden], W2
// [Vocab][Hidden], B2 [Vocab].
func (c Config) offsets() (emb, w1, b1, w2, b2, end int) {
	emb = 0
	w1 = emb + c.Vocab*c.Embed
	b1 = w1 + c.Hidden*c.In()
	w2 = b1 + c.Hidden
	b2 = w2 + c.Vocab*c.Hidden
	end = b2 + c.Vocab
	return
}

// Views are the named parameter tensors, slices of one flat vector
// (row-major).
type Views struct {
	Emb []float32 // [Vocab][Embed]
	W1  []float32 // [Hidden][Window*Embed]
	B1  []float32 // [Hidden]
	W2  []float32 // [Vocab][Hidden]
	B2  []float32 // [Vocab]
}

// ViewsOf returns the named views of a flat vector of c.NumParams() values
// (parameters or gradients). It panics if the length is wrong.
func (c Config) ViewsOf(flat []float32) Views {
	emb, w1, b1, w2, b2, end := c.offsets()
	if len(flat) != end {
		panic(fmt.Sprintf("model: flat vector of %d values, config needs %d", len(flat), end))
	}
	return Views{
		Emb: flat[emb:w1:w1], W1: flat[w1:b1:b1], B1: flat[b1:w2:w2],
		W2: flat[w2:b2:b2], B2: flat[b2:end:end],
	}
}

// Model is a configuration with its flat parameter vector. Params may be
// updated in place by an optimizer; a Model shared with samplers must be
// copied first (Clone), see Policy.
type Model struct {
	Config Config
	Params []float32
}

// New returns a model with deterministic initial parameters drawn from
// seed: embeddings N(0, 1), W1 N(0, 1/In), W2 N(0, 0.01/Hidden) so the
// initial policy is close to uniform (it explores), biases 0. The same seed
// gives the same bytes on every platform (math/rand/v2 PCG and the Go
// normal sampler are specified algorithms).
func New(cfg Config, seed uint64) (*Model, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m := &Model{Config: cfg, Params: make([]float32, cfg.NumParams())}
	r := rand.New(rand.NewPCG(seed, 0x7472616a666c6f77)) // "trajflow"
	v := cfg.ViewsOf(m.Params)
	fill := func(dst []float32, std float64) {
		for i := range dst {
			dst[i] = float32(r.NormFloat64() * std)
		}
	}
	fill(v.Emb, 1)
	fill(v.W1, 1/math.Sqrt(float64(cfg.In())))
	fill(v.W2, 0.1/math.Sqrt(float64(cfg.Hidden)))
	return m, nil
}

// Clone returns a deep copy.
func (m *Model) Clone() *Model {
	return &Model{Config: m.Config, Params: append([]float32(nil), m.Params...)}
}

// Validate reports whether m's config is valid and its parameter vector
// has the length the config needs (ErrShape).
func (m *Model) Validate() error {
	if err := m.Config.Validate(); err != nil {
		return err
	}
	if len(m.Params) != m.Config.NumParams() {
		return fmt.Errorf("%w: %d parameters, config needs %d", ErrShape, len(m.Params), m.Config.NumParams())
	}
	return nil
}

// Views returns the named views of m.Params.
func (m *Model) Views() Views { return m.Config.ViewsOf(m.Params) }

// dot is Σ a[j]*b[j] accumulated in float32 in index order, each product
// rounded before the add (no fused multiply-add).
func dot(a, b []float32) float32 {
	var s float32
	b = b[:len(a)]
	for j, x := range a {
		s += float32(x * b[j])
	}
	return s
}

// positionLogits computes the logits of one position from its window
// (Window token ids, oldest first) into out [Vocab], using x [In] and h
// [Hidden] as the activations it leaves behind for Backward. It is the only
// code that computes logits: the sampler and the trainer both call it.
func (m *Model) positionLogits(v Views, window []int32, x, h, out []float32) {
	c := m.Config
	E, In := c.Embed, c.In()
	for s, tok := range window {
		copy(x[s*E:(s+1)*E], v.Emb[int(tok)*E:int(tok+1)*E])
	}
	for k := range h {
		h[k] = float32(math.Tanh(float64(dot(v.W1[k*In:(k+1)*In], x) + v.B1[k])))
	}
	H := c.Hidden
	for o := range out {
		out[o] = dot(v.W2[o*H:(o+1)*H], h) + v.B2[o]
	}
}

// windowAt fills win [Window] with the tokens of positions i-Window+1 .. i
// of seq, using PadID for slots before the segment start (a position whose
// position id is p sees back to i-p only).
func windowAt(seq []int32, i int, pos int32, win []int32) {
	W := len(win)
	first := i - int(pos) // start of the segment
	for s := 0; s < W; s++ {
		j := i - (W - 1) + s
		if j < first {
			win[s] = PadID
		} else {
			win[s] = seq[j]
		}
	}
}

// Tape holds the activations of one Forward call for Backward. The zero
// value is ready; a Tape is reused across calls (its buffers grow).
type Tape struct {
	n       int
	windows []int32   // [n][Window]
	x       []float32 // [n][In]
	h       []float32 // [n][Hidden]
}

// CheckPositions verifies that positions restart at 0 and then count up by
// one within each run (segment), as schemas.PackedRow.PositionIDs do, and
// that segments (when non-nil) change exactly where positions restart.
// Errors wrap ErrShape.
func CheckPositions(positions, segments []int32) error {
	if segments != nil && len(segments) != len(positions) {
		return fmt.Errorf("%w: %d segment ids for %d positions", ErrShape, len(segments), len(positions))
	}
	for i, p := range positions {
		newSeg := i == 0 || (segments != nil && segments[i] != segments[i-1])
		switch {
		case newSeg && p != 0:
			return fmt.Errorf("%w: segment starts at %d with position id %d, want 0", ErrShape, i, p)
		case newSeg:
		case p == 0 && segments == nil: // a new segment
		case p != positions[i-1]+1:
			return fmt.Errorf("%w: position id %d at %d follows %d", ErrShape, p, i, positions[i-1])
		}
	}
	return nil
}

// Forward computes the logits of every position of tokens into logits
// ([len(tokens)*Vocab], row-major): row i is the prediction of token i+1 of
// the same segment. positions are the position ids (restarting at 0 in
// every segment, see CheckPositions); nil means one segment 0..n-1. When
// need is non-nil, rows with need[i] == false are set to 0 without being
// computed (a trainer skips positions that no loss term reads). tape, when
// non-nil, records the activations for Backward.
func (m *Model) Forward(tokens, positions []int32, need []bool, tape *Tape, logits []float32) error {
	c := m.Config
	n, V := len(tokens), c.Vocab
	if len(logits) != n*V {
		return fmt.Errorf("%w: %d logits for %d tokens x vocab %d", ErrShape, len(logits), n, V)
	}
	if positions != nil {
		if len(positions) != n {
			return fmt.Errorf("%w: %d positions for %d tokens", ErrShape, len(positions), n)
		}
		if err := CheckPositions(positions, nil); err != nil {
			return err
		}
	}
	if need != nil && len(need) != n {
		return fmt.Errorf("%w: %d need flags for %d tokens", ErrShape, len(need), n)
	}
	for i, t := range tokens {
		if t < 0 || int(t) >= V {
			return fmt.Errorf("%w: token %d at position %d, vocab %d", ErrToken, t, i, V)
		}
	}
	var tp Tape
	if tape == nil {
		tape = &tp
	}
	tape.n = n
	tape.windows = grow(tape.windows, n*c.Window)
	tape.x = grow(tape.x, n*c.In())
	tape.h = grow(tape.h, n*c.Hidden)
	v := m.Views()
	for i := 0; i < n; i++ {
		row := logits[i*V : (i+1)*V]
		win := tape.windows[i*c.Window : (i+1)*c.Window]
		if need != nil && !need[i] {
			clear(row)
			for s := range win {
				win[s] = -1 // not computed
			}
			continue
		}
		pos := int32(i)
		if positions != nil {
			pos = positions[i]
		}
		windowAt(tokens, i, pos, win)
		m.positionLogits(v, win, tape.x[i*c.In():(i+1)*c.In()], tape.h[i*c.Hidden:(i+1)*c.Hidden], row)
	}
	return nil
}

// Backward accumulates into grad ([NumParams], the flat layout of Params)
// the gradient of a scalar loss whose derivative with respect to the
// logits of the last Forward recorded in tape is dLogits ([n*Vocab]). Rows
// of dLogits that are entirely 0 are skipped; a non-zero row at a position
// Forward did not compute is an error (ErrShape). Accumulation is
// sequential in position order, so the result is deterministic.
func (m *Model) Backward(tape *Tape, dLogits []float32, grad []float32) error {
	c := m.Config
	n, V, H, In, E, W := tape.n, c.Vocab, c.Hidden, c.In(), c.Embed, c.Window
	if len(dLogits) != n*V {
		return fmt.Errorf("%w: %d logit gradients for %d positions x vocab %d", ErrShape, len(dLogits), n, V)
	}
	if len(grad) != c.NumParams() {
		return fmt.Errorf("%w: gradient of %d values, model has %d", ErrShape, len(grad), c.NumParams())
	}
	v := m.Views()
	g := c.ViewsOf(grad)
	dh := make([]float32, H)
	dx := make([]float32, In)
	for i := 0; i < n; i++ {
		d := dLogits[i*V : (i+1)*V]
		zero := true
		for _, x := range d {
			if x != 0 {
				zero = false
				break
			}
		}
		if zero {
			continue
		}
		win := tape.windows[i*W : (i+1)*W]
		if win[0] < 0 {
			return fmt.Errorf("%w: gradient at position %d whose logits were not computed", ErrShape, i)
		}
		h := tape.h[i*H : (i+1)*H]
		x := tape.x[i*In : (i+1)*In]
		clear(dh)
		for o, do := range d {
			if do == 0 {
				continue
			}
			g.B2[o] += do
			w2 := v.W2[o*H : (o+1)*H]
			gw2 := g.W2[o*H : (o+1)*H]
			for k, hk := range h {
				gw2[k] += float32(do * hk)
				dh[k] += float32(do * w2[k])
			}
		}
		clear(dx)
		for k, hk := range h {
			dpre := float32(dh[k] * float32(1-float32(hk*hk)))
			if dpre == 0 {
				continue
			}
			g.B1[k] += dpre
			w1 := v.W1[k*In : (k+1)*In]
			gw1 := g.W1[k*In : (k+1)*In]
			for j, xj := range x {
				gw1[j] += float32(dpre * xj)
				dx[j] += float32(dpre * w1[j])
			}
		}
		for s, tok := range win {
			ge := g.Emb[int(tok)*E : int(tok+1)*E]
			for e := range ge {
				ge[e] += dx[s*E+e]
			}
		}
	}
	return nil
}

func grow[T any](b []T, n int) []T {
	if cap(b) < n {
		return make([]T, n)
	}
	return b[:n]
}
