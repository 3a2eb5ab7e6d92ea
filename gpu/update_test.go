package gpu

import (
	"math"
	"slices"
	"testing"

	"github.com/trajflow/trajflow/gpu/objective"
)

// TestUpdateIsOneVersion: the epochs of an update make one policy version;
// the first step of an on-policy batch has ratio exactly 1.
func TestUpdateIsOneVersion(t *testing.T) {
	h := newHarness(t, smallLoop())
	batch := batchFor(t, h, 0)
	met, last, err := h.tr.Update(batch, h.cfg.Objective, h.cfg.Adam, 3)
	if err != nil {
		t.Fatal(err)
	}
	if h.tr.Version() != 1 || met.Version != 1 || met.FromVersion != 0 || h.tr.Steps() != 3 {
		t.Fatalf("version %d (metrics %d from %d), steps %d", h.tr.Version(), met.Version, met.FromVersion, h.tr.Steps())
	}
	if met.RatioMin != 1 || met.RatioMax != 1 || met.ApproxKLOld != 0 || last.ApproxKLOld == 0 {
		t.Fatalf("first step ratio [%v %v] kl %v, last step kl %v", met.RatioMin, met.RatioMax, met.ApproxKLOld, last.ApproxKLOld)
	}
}

// TestOptimStateRoundTrip: a trainer restored from a release and its
// optimizer state takes exactly the step the original takes; a corrupted
// state is refused.
func TestOptimStateRoundTrip(t *testing.T) {
	h := newHarness(t, smallLoop())
	b0, b1 := batchFor(t, h, 0), batchFor(t, h, 1)
	if _, _, err := h.tr.Update(b0, h.cfg.Objective, h.cfg.Adam, 2); err != nil {
		t.Fatal(err)
	}
	state := h.tr.OptimState()
	restored, err := NewTrainer(h.tr.Model(), h.tr.Behavior(), h.tr.Version())
	if err != nil {
		t.Fatal(err)
	}
	if err := restored.SetOptimState(state); err != nil {
		t.Fatal(err)
	}
	for _, tr := range []*Trainer{h.tr, restored} {
		if _, _, err := tr.Update(b1, h.cfg.Objective, h.cfg.Adam, 2); err != nil {
			t.Fatal(err)
		}
	}
	a, b := h.tr.Model().Params, restored.Model().Params
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("parameter %d: %v after restore, %v without", i, b[i], a[i])
		}
	}
	bad := append([]byte(nil), state...)
	bad[len(optimMagic)+20] ^= 1
	for name, b := range map[string][]byte{"flipped bit": bad, "truncated": state[:len(state)-1], "empty": nil} {
		if err := restored.SetOptimState(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// FuzzOptimState: any bytes are refused or restored, never a panic.
func FuzzOptimState(f *testing.F) {
	h := newHarness(f, smallLoop())
	f.Add(h.tr.OptimState())
	f.Add([]byte(optimMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		tr, _ := NewTrainer(h.tr.Model(), h.tr.Behavior(), 0)
		_ = tr.SetOptimState(b)
	})
}

// TestDecoupledOnPolicyIsPlain: on an on-policy batch the decoupled
// objective's proximal policy is the behavior policy, so an update of
// three epochs gives the plain objective's parameters bit for bit (the
// demo contract declares decoupled; its synchronous runs are unchanged).
// An update taken a version later (the same batch, now one version stale)
// clips against different policies: the plain ratio is to the behavior
// policy, the decoupled one to the trainer's own at the start of the
// update (exactly 1 at its first step), the behavior ratio becoming the
// importance weight.
func TestDecoupledOnPolicyIsPlain(t *testing.T) {
	h := newHarness(t, smallLoop())
	batch := batchFor(t, h, 0)
	plain, dec := h.tr, h.tr.clone(t)
	opts := h.cfg.Objective
	dopts := opts
	dopts.OffPolicy = objective.OffPolicyDecoupled
	if _, _, err := plain.Update(batch, opts, h.cfg.Adam, 3); err != nil {
		t.Fatal(err)
	}
	if _, _, err := dec.Update(batch, dopts, h.cfg.Adam, 3); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(plain.m.Params, dec.m.Params) {
		t.Fatal("decoupled on policy differs from the plain objective")
	}
	// Stale now: the proximal policy is version 1, not the behavior.
	pm, _, err := plain.Update(batch, opts, h.cfg.Adam, 2)
	if err != nil {
		t.Fatal(err)
	}
	dm, _, err := dec.Update(batch, dopts, h.cfg.Adam, 2)
	if err != nil {
		t.Fatal(err)
	}
	if pm.RatioMin == 1 && pm.RatioMax == 1 {
		t.Fatal("the stale batch has ratio 1 to its behavior policy")
	}
	if dm.RatioMin != 1 || dm.RatioMax != 1 || math.Abs(dm.ISWeightMean-pm.RatioMean) > 1e-6 || dm.ISWeightMax != pm.RatioMax {
		t.Fatalf("decoupled first step: ratio [%v %v] (want 1), weight mean %v max %v (want the plain ratio's %v %v)",
			dm.RatioMin, dm.RatioMax, dm.ISWeightMean, dm.ISWeightMax, pm.RatioMean, pm.RatioMax)
	}
}

// clone is a copy of t (parameters, moments, version, steps).
func (t *Trainer) clone(tb testing.TB) *Trainer {
	tb.Helper()
	c, err := NewTrainer(t.m, t.behavior, t.version)
	if err != nil {
		tb.Fatal(err)
	}
	copy(c.m1, t.m1)
	copy(c.m2, t.m2)
	c.steps = t.steps
	return c
}
