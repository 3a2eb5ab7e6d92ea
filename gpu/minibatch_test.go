package gpu

import (
	"github.com/trajflow/trajflow/gpu/objective"
	"slices"
	"testing"
)

// TestMinibatchOrder: per epoch a permutation of the rows cut into
// minibatches whose sizes differ by at most one (5 rows in 2: 2 and 3),
// the same for the same seed and batch, another for another epoch or
// seed; more minibatches than rows is one row each.
func TestMinibatchOrder(t *testing.T) {
	o, err := MinibatchOrder(5, 2, 3, 1, "b")
	if err != nil {
		t.Fatal(err)
	}
	if len(o) != 3 {
		t.Fatalf("%d epochs", len(o))
	}
	for e, mbs := range o {
		if len(mbs) != 2 || len(mbs[0]) != 2 || len(mbs[1]) != 3 {
			t.Fatalf("epoch %d: %v", e, mbs)
		}
		all := slices.Concat(mbs...)
		slices.Sort(all)
		if !slices.Equal(all, []int{0, 1, 2, 3, 4}) {
			t.Fatalf("epoch %d is not a permutation: %v", e, mbs)
		}
	}
	again, _ := MinibatchOrder(5, 2, 3, 1, "b")
	other, _ := MinibatchOrder(5, 2, 3, 2, "b")
	if !slices.EqualFunc(o, again, func(a, b [][]int) bool { return slices.EqualFunc(a, b, slices.Equal) }) {
		t.Fatal("same seed, another order")
	}
	same := func(a, b [][][]int) bool {
		return slices.EqualFunc(a, b, func(x, y [][]int) bool { return slices.EqualFunc(x, y, slices.Equal) })
	}
	if same(o, other) || (slices.Equal(slices.Concat(o[0]...), slices.Concat(o[1]...)) && slices.Equal(slices.Concat(o[1]...), slices.Concat(o[2]...))) {
		t.Fatalf("the order does not depend on the seed or the epoch: %v / %v", o, other)
	}
	one, _ := MinibatchOrder(3, 8, 1, 1, "b")
	if len(one[0]) != 3 || len(one[0][0]) != 1 {
		t.Fatalf("3 rows in 8 minibatches: %v", one)
	}
	if _, err := MinibatchOrder(0, 2, 1, 1, "b"); err == nil {
		t.Fatal("no rows: no error")
	}
}

// TestUpdateMinibatches: one minibatch of every row in batch order per
// epoch is Update exactly; two minibatches take twice the steps, make one
// version, and move the parameters elsewhere; a bad order changes nothing.
func TestUpdateMinibatches(t *testing.T) {
	h := newHarness(t, smallLoop())
	batch := batchFor(t, h, 0)
	if len(batch.Rows) < 2 {
		t.Fatalf("%d rows", len(batch.Rows))
	}
	a, b := freshTrainer(t, h), freshTrainer(t, h)
	rows := allRows(len(batch.Rows))
	if _, _, err := a.Update(batch, h.cfg.Objective, h.cfg.Adam, 2); err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.UpdateMinibatches(batch, h.cfg.Objective, h.cfg.Adam, [][][]int{{rows}, {rows}}); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(a.Model().Params, b.Model().Params) || b.Version() != 1 || b.Steps() != 2 {
		t.Fatal("one whole-batch minibatch per epoch differs from Update")
	}
	order, err := MinibatchOrder(len(batch.Rows), 2, 2, 1, batch.BatchID)
	if err != nil {
		t.Fatal(err)
	}
	c := freshTrainer(t, h)
	met, _, err := c.UpdateMinibatches(batch, h.cfg.Objective, h.cfg.Adam, order)
	if err != nil {
		t.Fatal(err)
	}
	if c.Version() != 1 || met.Version != 1 || c.Steps() != 4 || slices.Equal(c.Model().Params, a.Model().Params) {
		t.Fatalf("2 minibatches x 2 epochs: version %d, steps %d", c.Version(), c.Steps())
	}
	d := freshTrainer(t, h)
	before := d.Model().Params
	if _, _, err := d.UpdateMinibatches(batch, h.cfg.Objective, h.cfg.Adam, [][][]int{{rows}, {{len(rows)}}}); err == nil {
		t.Fatal("an order naming a missing row: no error")
	}
	if d.Version() != 0 || d.Steps() != 0 || !slices.Equal(d.Model().Params, before) {
		t.Fatal("a failed update changed the trainer")
	}
}

// TestUpdateMinibatchesDecoupled: with the decoupled objective the
// proximal policy of every minibatch is the policy at the start of the
// update. One whole-batch minibatch per epoch is Update bit for bit; two
// minibatches train (each row clips against its own proximal log-probs,
// of the right length), and the first step's clipped ratio is exactly 1.
func TestUpdateMinibatchesDecoupled(t *testing.T) {
	h := newHarness(t, smallLoop())
	batch := batchFor(t, h, 0)
	opts := h.cfg.Objective
	opts.OffPolicy = objective.OffPolicyDecoupled
	a, b := freshTrainer(t, h), freshTrainer(t, h)
	rows := allRows(len(batch.Rows))
	if _, _, err := a.Update(batch, opts, h.cfg.Adam, 2); err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.UpdateMinibatches(batch, opts, h.cfg.Adam, [][][]int{{rows}, {rows}}); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(a.Model().Params, b.Model().Params) || b.Steps() != 2 {
		t.Fatal("decoupled: one whole-batch minibatch per epoch differs from Update")
	}
	order, err := MinibatchOrder(len(batch.Rows), 2, 2, 1, batch.BatchID)
	if err != nil {
		t.Fatal(err)
	}
	c := freshTrainer(t, h)
	met, _, err := c.UpdateMinibatches(batch, opts, h.cfg.Adam, order)
	if err != nil {
		t.Fatalf("decoupled, 2 minibatches x 2 epochs: %v", err)
	}
	if c.Version() != 1 || c.Steps() != 4 || met.RatioMin != 1 || met.RatioMax != 1 {
		t.Fatalf("version %d, steps %d, first step ratio [%v, %v]", c.Version(), c.Steps(), met.RatioMin, met.RatioMax)
	}
}

// freshTrainer is a trainer from h's initial model and behavior, version 0.
func freshTrainer(t *testing.T, h *harness) *Trainer {
	t.Helper()
	tr, err := NewTrainer(h.tr.Model(), h.tr.Behavior(), 0)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// allRows is the row indexes 0..n-1.
func allRows(n int) []int {
	rows := make([]int, n)
	for i := range rows {
		rows[i] = i
	}
	return rows
}
