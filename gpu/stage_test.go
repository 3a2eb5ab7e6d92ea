package gpu

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
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

// TestStageTrainsOnce: a batch is trained once (release, update record,
// census); its redelivery is skipped; a later batch made only of trained
// trajectories is refused.
func TestStageTrainsOnce(t *testing.T) {
	h := newHarness(t, smallLoop())
	topics, _ := pipeline.TopicsFor("run-1")
	dir := t.TempDir()
	st, err := NewStage(StageConfig{
		Topics: topics, RunID: h.runID, ContractHash: "contract", Behavior: h.tr.Behavior(),
		Model: h.cfg.Model, ModelSeed: h.cfg.ModelSeed, Objective: h.cfg.Objective, Adam: h.cfg.Adam,
		Epochs: 2, ReleaseDir: dir,
	})
	if err != nil {
		t.Fatal(err)
	}
	tr, err := NewTrainer(h.tr.Model(), h.tr.Behavior(), 0)
	if err != nil {
		t.Fatal(err)
	}
	st.tr = tr
	st.initial = true
	ctx := context.Background()
	count := func(res pipeline.Result, topic string) int {
		n := 0
		for _, o := range res.Outputs {
			if o.Topic == topic {
				n++
			}
		}
		return n
	}
	res, err := st.Tick(ctx, time.Now())
	if err != nil || count(res, topics.Policy) != 1 {
		t.Fatalf("initial release: %+v %v", res, err)
	}
	if res, _ = st.Tick(ctx, time.Now()); len(res.Outputs) != 0 {
		t.Fatal("initial release published twice")
	}

	batch := batchFor(t, h, 0)
	batch.ContractHash = "contract"
	msg := func(b schemas.PackedBatch) pipeline.Message {
		v, err := schemas.PackedBatches.Encode(nil, b)
		if err != nil {
			t.Fatal(err)
		}
		return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Batches}, Value: v}
	}
	ids := ids2(batch)
	res, err = st.Process(ctx, msg(batch))
	if err != nil || count(res, topics.Policy) != 1 || count(res, topics.Census) != ids || st.Version() != 1 {
		t.Fatalf("train: %d outputs, version %d, err %v", len(res.Outputs), st.Version(), err)
	}
	var rel schemas.PolicyRelease
	for _, o := range res.Outputs {
		if o.Topic == topics.Policy {
			if rel, err = schemas.DecodeRelease(o.Value); err != nil {
				t.Fatal(err)
			}
		}
	}
	pol, err := LoadRelease(rel)
	if err != nil || pol.Version() != 1 {
		t.Fatalf("load release: %v", err)
	}
	u, err := ReadUpdate(dir, 1)
	if err != nil || u.BatchID != batch.BatchID || u.Metrics.RatioMax != 1 {
		t.Fatalf("update record %+v %v", u, err)
	}
	if res, err = st.Process(ctx, msg(batch)); err != nil || len(res.Outputs) != 0 || st.Version() != 1 {
		t.Fatalf("redelivered batch: %+v %v", res, err)
	}
	again := batch
	again.BatchIndex, again.BatchID = 5, schemas.BatchID(h.runID, 5)
	if _, err = st.Process(ctx, msg(again)); err == nil {
		t.Fatal("a batch of trained trajectories was trained again")
	} else if r, ok := pipeline.AsRefusal(err); !ok || r.Reason != "duplicate_batch" {
		t.Fatalf("duplicate batch: %v", err)
	}
	// A batch mixing trained and new trajectories: the trained segments
	// are masked out, counted, and raise an incident.
	mixed := batchFor(t, h, 1)
	mixed.ContractHash, mixed.BatchIndex, mixed.BatchID = "contract", 6, schemas.BatchID(h.runID, 6)
	mixed.Rows = append(mixed.Rows, batch.Rows...)
	res, err = st.Process(ctx, msg(mixed))
	if err != nil || count(res, topics.Incidents) != 1 || count(res, topics.Census) != ids2(mixed)-ids || st.Version() != 2 {
		t.Fatalf("mixed batch: %d outputs, version %d, err %v", len(res.Outputs), st.Version(), err)
	}
	if u, err := ReadUpdate(dir, 2); err != nil || u.Duplicates != ids {
		t.Fatalf("update record %+v %v", u, err)
	}
}

func ids2(b schemas.PackedBatch) int {
	n := 0
	for _, r := range b.Rows {
		n += len(r.SegTrajectoryIDs)
	}
	return n
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
	state := h.tr.optimBytes()
	restored, err := NewTrainer(h.tr.Model(), h.tr.Behavior(), h.tr.Version())
	if err != nil {
		t.Fatal(err)
	}
	if err := restored.setOptim(state); err != nil {
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
		if err := restored.setOptim(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// FuzzOptimState: any bytes are refused or restored, never a panic.
func FuzzOptimState(f *testing.F) {
	h := newHarness(f, smallLoop())
	f.Add(h.tr.optimBytes())
	f.Add([]byte(optimMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		tr, _ := NewTrainer(h.tr.Model(), h.tr.Behavior(), 0)
		_ = tr.setOptim(b)
	})
}

// TestStageQuarantinesUntrainableBatch: a batch holding a token the
// behavior distribution cannot produce (its log-prob is -Inf) is refused
// with reason untrainable_batch — the trainer is unchanged, with no crash
// loop on redelivery — and the next good batch trains.
func TestStageQuarantinesUntrainableBatch(t *testing.T) {
	h := newHarness(t, smallLoop())
	topics, _ := pipeline.TopicsFor("run-1")
	st, err := NewStage(StageConfig{
		Topics: topics, RunID: h.runID, ContractHash: "contract", Behavior: h.tr.Behavior(),
		Model: h.cfg.Model, ModelSeed: h.cfg.ModelSeed, Objective: h.cfg.Objective, Adam: h.cfg.Adam,
		Epochs: 2, ReleaseDir: t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	tr, err := NewTrainer(h.tr.Model(), h.tr.Behavior(), 0)
	if err != nil {
		t.Fatal(err)
	}
	st.tr, st.initial = tr, true
	ctx := context.Background()
	if _, err := st.Tick(ctx, time.Now()); err != nil {
		t.Fatal(err)
	}
	before := slices.Clone(tr.Model().Params)
	msg := func(b schemas.PackedBatch) pipeline.Message {
		v, err := schemas.PackedBatches.Encode(nil, b)
		if err != nil {
			t.Fatal(err)
		}
		return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Batches}, Value: v}
	}
	bad := batchFor(t, h, 0)
	bad.ContractHash = "contract"
	row := &bad.Rows[0]
	for i := range row.ActionMask {
		if row.ActionMask[i] == 1 {
			row.InputIDs[i+1] = 0 // the padding token: never sampled, masked out by the grammar
			break
		}
	}
	for attempt := 0; attempt < 2; attempt++ { // redelivery: refused again, not a crash
		_, err = st.Process(ctx, msg(bad))
		if r, ok := pipeline.AsRefusal(err); !ok || r.Reason != "untrainable_batch" {
			t.Fatalf("bad batch: %v, want refusal untrainable_batch", err)
		}
	}
	if st.Version() != 0 || !slices.Equal(before, tr.Model().Params) {
		t.Fatalf("a refused batch changed the trainer: version %d", st.Version())
	}
	good := batchFor(t, h, 1)
	good.ContractHash = "contract"
	if _, err := st.Process(ctx, msg(good)); err != nil || st.Version() != 1 {
		t.Fatalf("good batch after a refused one: version %d, %v", st.Version(), err)
	}
}
