package gpu

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

// UpdateRecord is the trainer's record of one update (schemas.UpdateRecord),
// written beside every release v >= 1 as UpdateName(v).
type UpdateRecord = schemas.UpdateRecord

// UpdateName is the file name of the update record of version v.
func UpdateName(v int64) string { return fmt.Sprintf("policy-v%08d.update.json", v) }

// ReadUpdate reads the update record of version v from a release store.
func ReadUpdate(files Files, v int64) (UpdateRecord, error) {
	b, err := files.Read(UpdateName(v))
	if err != nil {
		return UpdateRecord{}, fmt.Errorf("%w: %w", ErrRelease, err)
	}
	u, err := schemas.DecodeUpdate(b)
	if err != nil {
		return u, fmt.Errorf("%w: update record %d: %w", ErrRelease, v, err)
	}
	return u, nil
}

// OptimName is the file name of the optimizer state after version v.
func OptimName(v int64) string { return fmt.Sprintf("policy-v%08d.optim", v) }

const optimMagic = "trajflow-adam/v1"

// OptimState encodes the Adam state: magic, steps, n, m1[n], m2[n]
// (little-endian float64), then the SHA-256 of everything before it. It is
// written beside every release, so a restarted trainer continues exactly
// where the release left off.
func (t *Trainer) OptimState() []byte {
	n := len(t.m1)
	b := make([]byte, 0, len(optimMagic)+16+16*n+sha256.Size)
	b = append(b, optimMagic...)
	b = binary.LittleEndian.AppendUint64(b, uint64(t.steps))
	b = binary.LittleEndian.AppendUint64(b, uint64(n))
	for _, v := range t.m1 {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
	}
	for _, v := range t.m2 {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
	}
	h := sha256.Sum256(b)
	return append(b, h[:]...)
}

// SetOptimState restores the Adam state written by OptimState.
func (t *Trainer) SetOptimState(b []byte) error {
	n := len(t.m1)
	want := len(optimMagic) + 16 + 16*n + sha256.Size
	if len(b) != want || string(b[:len(optimMagic)]) != optimMagic {
		return fmt.Errorf("%w: optimizer state of %d bytes, want %d", ErrRelease, len(b), want)
	}
	body := b[:len(b)-sha256.Size]
	if h := sha256.Sum256(body); string(h[:]) != string(b[len(body):]) {
		return fmt.Errorf("%w: optimizer state checksum mismatch", ErrRelease)
	}
	p := body[len(optimMagic):]
	steps := int64(binary.LittleEndian.Uint64(p))
	if int(binary.LittleEndian.Uint64(p[8:])) != n {
		return fmt.Errorf("%w: optimizer state for another model size", ErrRelease)
	}
	p = p[16:]
	for i := range t.m1 {
		t.m1[i] = math.Float64frombits(binary.LittleEndian.Uint64(p[8*i:]))
		t.m2[i] = math.Float64frombits(binary.LittleEndian.Uint64(p[8*(n+i):]))
	}
	t.steps = steps
	return nil
}

// SetSteps sets the optimizer step count (restored from a release's
// training step).
func (t *Trainer) SetSteps(n int64) { t.steps = n }

// InitialModel is the policy of version 0 for cfg and seed.
func InitialModel(cfg model.Config, seed uint64) (*model.Model, error) { return model.New(cfg, seed) }

// Update runs epochs optimizer steps on batch and makes them one policy
// version (FromVersion + 1). It returns the metrics of the first step and
// the objective statistics of the last. It is atomic: on error the
// parameters, optimizer state, step count and version are as before.
func (t *Trainer) Update(batch schemas.PackedBatch, opts objective.Options, adam AdamOptions, epochs int) (Metrics, objective.Stats, error) {
	from, steps := t.version, t.steps
	params := slices.Clone(t.m.Params)
	m1, m2 := slices.Clone(t.m1), slices.Clone(t.m2)
	var first Metrics
	var last objective.Stats
	for e := 0; e < max(1, epochs); e++ {
		met, err := t.Step(batch, opts, adam)
		if err != nil {
			copy(t.m.Params, params)
			copy(t.m1, m1)
			copy(t.m2, m2)
			t.version, t.steps = from, steps
			return Metrics{}, objective.Stats{}, fmt.Errorf("epoch %d: %w", e, err)
		}
		if e == 0 {
			first = met
		}
		last = met.ObjectiveStats
	}
	t.version = from + 1
	first.Version = t.version
	return first, last, nil
}

// Untrainable reports whether err says the batch itself cannot be trained
// (malformed rows, tokens outside the model or its behavior distribution),
// as opposed to a failure of the trainer.
func Untrainable(err error) bool {
	for _, e := range []error{ErrBatch, objective.ErrInput, objective.ErrTarget, objective.ErrShape, model.ErrToken, model.ErrShape} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
