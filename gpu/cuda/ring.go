package cuda

import (
	"errors"
	"fmt"

	"github.com/apache/arrow-go/v18/arrow"

	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

// Slots is the number of staging slots: two, so that batch k+1 is packed
// and copied while batch k computes (double buffering).
const Slots = 2

// Engine is the device side of the staging ring: per slot, one pinned host
// buffer and one device buffer of equal capacity, a copy stream, and two
// events — copied(slot), recorded after the slot's last host-to-device
// copy, and computed(slot), recorded by the compute stream after the last
// kernel that reads the slot's device buffer. The CUDA implementation is
// in device.go (build tag cuda); tests use a simulated engine.
type Engine interface {
	// Ensure makes slot's host and device buffers hold at least n bytes.
	// Growing must first wait for copied(slot) and computed(slot), since
	// the old buffers are freed.
	Ensure(slot, n int) error
	// Host returns slot's pinned host buffer (its full capacity).
	Host(slot int) []byte
	// WaitCopied blocks the calling goroutine until copied(slot): the host
	// buffer may then be overwritten.
	WaitCopied(slot int) error
	// CopyAsync enqueues on the copy stream: wait for computed(slot) (the
	// device buffer is free), copy the first n bytes of the host buffer to
	// the device buffer, record copied(slot). It returns without waiting.
	CopyAsync(slot, n int) error
}

// Ring stages batches into the slots of an Engine in turn: batch k uses
// slot k mod Slots. Put packs the batch into the slot's host buffer once
// that buffer's previous copy has completed, grows the buffers with the
// Capacity policy only when a batch does not fit, and enqueues the copy.
// The consumer of slot s must make its compute stream wait for copied(s)
// and record computed(s) after its last kernel reading the slot. A Ring is
// not safe for concurrent use.
type Ring struct {
	eng    Engine
	cap    Capacity
	V      int
	size   [Slots]int
	staged [Slots]Staged
	next   int64
	grows  int
}

// NewRing returns a ring over eng for a model of vocabulary V.
func NewRing(eng Engine, V int, c Capacity) *Ring { return &Ring{eng: eng, cap: c, V: V} }

// Grows is the number of buffer reallocations so far (a steady stream of
// batches of bounded size stops growing after the first few).
func (r *Ring) Grows() int { return r.grows }

// Put stages batch into the next slot and enqueues its copy. It returns the
// slot and its Staged description (valid until the slot is reused, Slots
// calls later).
func (r *Ring) Put(batch schemas.PackedBatch, opts objective.Options) (int, *Staged, error) {
	return r.put(func(dst []byte, st *Staged) error { return StageBatch(batch, r.V, opts, dst, st) })
}

// PutRecord is Put reading an Arrow packed-batch record (StageRecord).
func (r *Ring) PutRecord(rec arrow.RecordBatch, opts objective.Options) (int, *Staged, error) {
	return r.put(func(dst []byte, st *Staged) error { return StageRecord(rec, r.V, opts, dst, st) })
}

func (r *Ring) put(stageInto func([]byte, *Staged) error) (int, *Staged, error) {
	slot := int(r.next % Slots)
	if err := r.eng.WaitCopied(slot); err != nil {
		return 0, nil, err
	}
	st := &r.staged[slot]
	for attempt := 0; ; attempt++ {
		err := stageInto(r.eng.Host(slot)[:r.size[slot]], st)
		if err == nil {
			break
		}
		if attempt > 0 || !errors.Is(err, ErrSmallBuffer) {
			return 0, nil, err
		}
		n, _ := r.cap.Grow(r.size[slot], st.Layout.Bytes)
		if err := r.eng.Ensure(slot, n); err != nil {
			return 0, nil, fmt.Errorf("cuda: grow slot %d to %d bytes: %w", slot, n, err)
		}
		r.size[slot] = n
		r.grows++
	}
	if err := r.eng.CopyAsync(slot, st.Layout.Bytes); err != nil {
		return 0, nil, err
	}
	r.next++
	return slot, st, nil
}
