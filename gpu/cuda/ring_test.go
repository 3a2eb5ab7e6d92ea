package cuda

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/trajflow/trajflow/gpu/objective"
)

// simEngine simulates the device side of the ring. A copy is asynchronous:
// CopyAsync only records it, and the bytes are read from the host buffer
// when the copy "executes" — at the next WaitCopied of the slot, or when
// the compute of the slot starts. If the ring overwrote a host buffer
// before its copy executed, the device would see the wrong batch.
type simEngine struct {
	host, dev    [Slots][]byte
	pending      [Slots]int // bytes of a recorded, not yet executed copy; -1 none
	computing    [Slots]bool
	reallocs     int
	copyBeforeOK bool
	err          error
}

func newSim() *simEngine { return &simEngine{pending: [Slots]int{-1, -1}} }

func (s *simEngine) execute(slot int) {
	if n := s.pending[slot]; n >= 0 {
		if s.computing[slot] && s.err == nil {
			s.err = fmt.Errorf("copy into slot %d while its compute runs", slot)
		}
		copy(s.dev[slot], s.host[slot][:n])
		s.pending[slot] = -1
	}
}

func (s *simEngine) Ensure(slot, n int) error {
	s.execute(slot)
	if s.computing[slot] {
		return fmt.Errorf("realloc of slot %d while its compute runs", slot)
	}
	s.host[slot] = alignedBuf(n)
	s.dev[slot] = make([]byte, n)
	s.reallocs++
	return nil
}
func (s *simEngine) Host(slot int) []byte        { return s.host[slot] }
func (s *simEngine) WaitCopied(slot int) error   { s.execute(slot); return nil }
func (s *simEngine) CopyAsync(slot, n int) error { s.pending[slot] = n; return nil }

// compute is the consumer: it waits for the slot's copy, then reads the
// device buffer.
func (s *simEngine) compute(slot, n int) []byte {
	s.execute(slot)
	s.computing[slot] = true
	out := append([]byte(nil), s.dev[slot][:n]...)
	s.computing[slot] = false
	return out
}

// TestRingDoubleBuffer: batch k+1 is staged while batch k is still being
// copied/computed (its compute runs one Put later), every batch reaches the
// device intact, slots alternate, and buffers stop growing once they hold
// the largest batch.
func TestRingDoubleBuffer(t *testing.T) {
	const V = 64
	sim := newSim()
	ring := NewRing(sim, V, Capacity{Quantum: 4096, Factor: 1.5})
	rng := rand.New(rand.NewPCG(11, 12))
	opts := objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.TokenMean, KLPlacement: objective.KLNone}
	type inflight struct {
		slot int
		want []byte
		l    Layout
	}
	var prev *inflight
	growsAt := -1
	for k := 0; k < 60; k++ {
		b := randomBatch(rng, 1+rng.IntN(4), 40+rng.IntN(200), V, k%3 == 0, 1)
		want, _ := stageOK(t, b, V, opts)
		g := ring.Grows()
		slot, st, err := ring.Put(b, opts)
		if err != nil {
			t.Fatal(err)
		}
		if ring.Grows() != g {
			growsAt = k
		}
		if slot != k%Slots {
			t.Fatalf("batch %d in slot %d", k, slot)
		}
		if st.Layout.Bytes != len(want) {
			t.Fatalf("batch %d: layout %d bytes, want %d", k, st.Layout.Bytes, len(want))
		}
		// The previous batch computes only now, after the next was staged.
		if prev != nil {
			got := sim.compute(prev.slot, len(prev.want))
			for c := Column(0); c < numColumns; c++ {
				if !bytes.Equal(prev.l.ColumnBytes(got, c), prev.l.ColumnBytes(prev.want, c)) {
					t.Fatalf("batch %d reached the device corrupted (column %s)", k-1, c)
				}
			}
		}
		prev = &inflight{slot, want, st.Layout}
	}
	if sim.err != nil {
		t.Fatal(sim.err)
	}
	if ring.Grows() != sim.reallocs || sim.reallocs > 8 {
		t.Fatalf("%d ring grows, %d reallocations", ring.Grows(), sim.reallocs)
	}
	if growsAt > 30 {
		t.Logf("last growth at batch %d", growsAt)
	}
}

// TestRingSteadyState: batches of one size never reallocate after the
// first use of each slot.
func TestRingSteadyState(t *testing.T) {
	const V = 32
	sim := newSim()
	ring := NewRing(sim, V, DefaultCapacity())
	rng := rand.New(rand.NewPCG(1, 3))
	b := randomBatch(rng, 3, 100, V, false, 0)
	opts := objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.TokenMean, KLPlacement: objective.KLNone}
	for k := 0; k < 20; k++ {
		slot, st, err := ring.Put(b, opts)
		if err != nil {
			t.Fatal(err)
		}
		sim.compute(slot, st.Layout.Bytes)
	}
	if sim.reallocs != Slots {
		t.Fatalf("%d reallocations for 20 equal batches, want %d", sim.reallocs, Slots)
	}
}
