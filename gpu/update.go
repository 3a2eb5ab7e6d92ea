package gpu

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
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

// RefusedName is the file name of the cost of the batches a trainer
// refused whole after version v (docs/SYSTEMS.md §17): the next update
// record's ledger carries it, and a restarted trainer reads it back.
func RefusedName(v int64) string { return fmt.Sprintf("policy-v%08d.refused.json", v) }

// OptimName is the file name of the optimizer state after version v.
func OptimName(v int64) string { return fmt.Sprintf("policy-v%08d.optim", v) }

const optimMagic = "trajflow-adam/v1"

// OptimState encodes the Adam state (EncodeOptimState). It is written
// beside every release, so a restarted trainer continues exactly where the
// release left off.
func (t *Trainer) OptimState() []byte { return EncodeOptimState(t.steps, t.m1, t.m2) }

// SetOptimState restores the Adam state written by OptimState.
func (t *Trainer) SetOptimState(b []byte) error {
	steps, err := DecodeOptimState(b, t.m1, t.m2)
	if err != nil {
		return err
	}
	t.steps = steps
	return nil
}

// EncodeOptimState is the optimizer state format of every backend: magic,
// steps, n, m1[n], m2[n] (little-endian float64), then the SHA-256 of
// everything before it. A run may therefore switch backends (device)
// between restarts.
func EncodeOptimState(steps int64, m1, m2 []float64) []byte {
	n := len(m1)
	b := make([]byte, 0, len(optimMagic)+16+16*n+sha256.Size)
	b = append(b, optimMagic...)
	b = binary.LittleEndian.AppendUint64(b, uint64(steps))
	b = binary.LittleEndian.AppendUint64(b, uint64(n))
	for _, v := range m1 {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
	}
	for _, v := range m2 {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
	}
	h := sha256.Sum256(b)
	return append(b, h[:]...)
}

// DecodeOptimState checks b (length, magic, checksum, model size
// len(m1) == len(m2)) and only then decodes its moments into m1 and m2 and
// returns its step count. On error m1 and m2 are unchanged.
func DecodeOptimState(b []byte, m1, m2 []float64) (int64, error) {
	n := len(m1)
	if len(m2) != n {
		return 0, fmt.Errorf("%w: optimizer state into %d and %d moments", ErrRelease, n, len(m2))
	}
	want := len(optimMagic) + 16 + 16*n + sha256.Size
	if len(b) != want || string(b[:min(len(b), len(optimMagic))]) != optimMagic {
		return 0, fmt.Errorf("%w: optimizer state of %d bytes, want %d", ErrRelease, len(b), want)
	}
	body := b[:len(b)-sha256.Size]
	if h := sha256.Sum256(body); string(h[:]) != string(b[len(body):]) {
		return 0, fmt.Errorf("%w: optimizer state checksum mismatch", ErrRelease)
	}
	p := body[len(optimMagic):]
	steps := int64(binary.LittleEndian.Uint64(p))
	if int(binary.LittleEndian.Uint64(p[8:])) != n {
		return 0, fmt.Errorf("%w: optimizer state for another model size", ErrRelease)
	}
	p = p[16:]
	for i := range m1 {
		m1[i] = math.Float64frombits(binary.LittleEndian.Uint64(p[8*i:]))
		m2[i] = math.Float64frombits(binary.LittleEndian.Uint64(p[8*(n+i):]))
	}
	return steps, nil
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
	t.proxOK = false // the proximal policy is the policy at the start of this update
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

// MinibatchUpdater is a backend that splits each epoch into minibatches
// (loss.optimizer.minibatches > 1): one optimizer step per minibatch in a
// declared order. *Trainer implements it; a backend that does not refuses
// minibatches > 1 (the train stage says so at start).
type MinibatchUpdater interface {
	UpdateMinibatches(batch schemas.PackedBatch, opts objective.Options, adam AdamOptions, order [][][]int) (Metrics, objective.Stats, error)
}

// MinibatchOrder is the seeded order of a batch of rows rows for epochs
// epochs in m minibatches: per epoch a permutation of the row indexes
// drawn from a PCG stream seeded by schemas.SeedFor(seed, "<batch
// id>/epoch/<e>", "minibatch"), cut into min(m, rows) contiguous
// minibatches whose sizes differ by at most one. The same seed and batch
// give the same order; it is recorded with the update.
func MinibatchOrder(rows, m, epochs int, seed int64, batchID string) ([][][]int, error) {
	if rows < 1 || m < 1 || epochs < 1 {
		return nil, fmt.Errorf("%w: %d rows in %d minibatches over %d epochs", ErrBatch, rows, m, epochs)
	}
	m = min(m, rows)
	order := make([][][]int, epochs)
	for e := range order {
		s := schemas.SeedFor(seed, fmt.Sprintf("%s/epoch/%d", batchID, e), "minibatch")
		perm := rand.New(rand.NewPCG(s, s^0x6a09e667f3bcc909)).Perm(rows)
		order[e] = make([][]int, m)
		for k := range m {
			order[e][k] = perm[k*rows/m : (k+1)*rows/m]
		}
	}
	return order, nil
}

// UpdateMinibatches takes one optimizer step per minibatch of order (per
// epoch, the row indexes of each minibatch, MinibatchOrder) and makes them
// one policy version. It returns the metrics of the first step and the
// objective statistics of the last; on error nothing changed.
//
// With the decoupled objective the proximal policy of every minibatch is
// the policy at the start of the update, as with one minibatch: its
// log-probs of every row are taken first (a step on the whole batch whose
// parameter change is undone), and each minibatch clips against its rows'.
func (t *Trainer) UpdateMinibatches(batch schemas.PackedBatch, opts objective.Options, adam AdamOptions, order [][][]int) (Metrics, objective.Stats, error) {
	from, steps := t.version, t.steps
	params := slices.Clone(t.m.Params)
	m1, m2 := slices.Clone(t.m1), slices.Clone(t.m2)
	restore := func() {
		copy(t.m.Params, params)
		copy(t.m1, m1)
		copy(t.m2, m2)
		t.version, t.steps = from, steps
	}
	var prox [][]float32
	if opts.OffPolicy == objective.OffPolicyDecoupled {
		t.proxOK = false
		if _, err := t.Step(batch, opts, adam); err != nil {
			restore()
			return Metrics{}, objective.Stats{}, fmt.Errorf("proximal log-probs: %w", err)
		}
		prox = t.prox
		restore()
	}
	var first Metrics
	var last objective.Stats
	n := 0
	for e, mbs := range order {
		for k, idx := range mbs {
			sub := batch
			sub.Rows = make([]schemas.PackedRow, len(idx))
			var subProx [][]float32
			for j, i := range idx {
				if i < 0 || i >= len(batch.Rows) {
					restore()
					return Metrics{}, objective.Stats{}, fmt.Errorf("%w: minibatch order names row %d of %d", ErrBatch, i, len(batch.Rows))
				}
				sub.Rows[j] = batch.Rows[i]
				if prox != nil {
					subProx = append(subProx, prox[i])
				}
			}
			if prox != nil {
				t.prox, t.proxBatch, t.proxOK = subProx, batch.BatchID, true
			}
			met, err := t.Step(sub, opts, adam)
			if err != nil {
				restore()
				return Metrics{}, objective.Stats{}, fmt.Errorf("epoch %d minibatch %d: %w", e, k, err)
			}
			if n == 0 {
				first = met
			}
			last = met.ObjectiveStats
			n++
		}
	}
	if n == 0 {
		return Metrics{}, objective.Stats{}, fmt.Errorf("%w: empty minibatch order", ErrBatch)
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
