package train_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/gputest"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/operators/train"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

type fixture struct {
	t      testing.TB
	loop   *gputest.Loop
	topics pipeline.Topics
	cfg    train.StageConfig
	m0     *model.Model
}

func newFixture(t testing.TB) *fixture {
	t.Helper()
	loop, err := gputest.Small()
	if err != nil {
		t.Fatal(err)
	}
	topics, _ := pipeline.TopicsFor(loop.RunID)
	cfg := train.StageConfig{
		Topics: topics, RunID: loop.RunID, ContractHash: "contract", Behavior: loop.Settings.Behavior,
		Model: model.DefaultConfig(), ModelSeed: 7, Objective: gpu.DefaultObjective(), Adam: gpu.DefaultAdam(), Epochs: 2,
		Lag: train.LagRule{MaxLag: 1, Policy: pack.StaleDrop},
	}
	m0, err := gpu.InitialModel(cfg.Model, cfg.ModelSeed)
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{t: t, loop: loop, topics: topics, cfg: cfg, m0: m0}
}

// batch is a batch sampled by the initial policy at version v.
func (f *fixture) batch(index int64, v int64) schemas.PackedBatch {
	f.t.Helper()
	b, err := f.loop.Batch(context.Background(), model.NewPolicy(f.m0, v), index)
	if err != nil {
		f.t.Fatal(err)
	}
	b.BatchID = schemas.BatchID(f.loop.RunID, index)
	return b
}

func (f *fixture) msg(b schemas.PackedBatch, offset int64) pipeline.Message {
	f.t.Helper()
	v, err := schemas.PackedBatches.Encode(nil, b)
	if err != nil {
		f.t.Fatal(err)
	}
	return pipeline.Message{Ref: pipeline.Ref{Topic: f.topics.Batches, Offset: offset}, Key: []byte(b.BatchID), Value: v}
}

// drive runs a new train stage over inputs, with the topics of scan as
// what the stage reads back at start.
func (f *fixture) drive(files pipeline.ReleaseStore, scan pipeline.MemScanner, inputs ...pipeline.Message) *pipeline.Driven {
	f.t.Helper()
	st, err := train.NewStage(f.cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	d, err := pipeline.Drive(context.Background(), st, inputs, pipeline.DriveConfig{
		QuarantineTopic: f.topics.Quarantine, Env: pipeline.EnvConfig{Scanner: scan, Releases: files},
	})
	if err != nil {
		f.t.Fatal(err)
	}
	return d
}

// store is a release store in a fresh directory.
func store(t *testing.T) *pipeline.DirReleases {
	t.Helper()
	files, err := pipeline.NewDirReleases(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return files
}

func segments(b schemas.PackedBatch) int {
	n := 0
	for _, r := range b.Rows {
		n += len(r.SegTrajectoryIDs)
	}
	return n
}

func releases(t *testing.T, outs []pipeline.Output) []schemas.PolicyRelease {
	t.Helper()
	var rels []schemas.PolicyRelease
	for _, o := range outs {
		r, err := schemas.DecodeRelease(o.Value)
		if err != nil {
			t.Fatal(err)
		}
		rels = append(rels, r)
	}
	return rels
}

func reasons(outs []pipeline.Output) []string {
	var rs []string
	for _, o := range outs {
		for _, h := range o.Headers {
			if h.Key == schemas.HeaderReason {
				rs = append(rs, string(h.Value))
			}
		}
	}
	return rs
}

// TestStageTrainsOnce: a batch is trained once (release, update record,
// census); its redelivery is skipped; a later batch made only of trained
// trajectories is refused; a batch mixing trained and new trajectories
// trains the new ones and raises an incident. A restarted stage rebuilds
// its state from the policy and batches topics and the release files.
func TestStageTrainsOnce(t *testing.T) {
	f := newFixture(t)
	files := store(t)
	b0 := f.batch(0, 0)
	again := b0
	again.BatchIndex, again.BatchID = 5, schemas.BatchID(f.loop.RunID, 5)
	d := f.drive(files, pipeline.MemScanner{}, f.msg(b0, 0), f.msg(b0, 1), f.msg(again, 2))

	rels := releases(t, d.On(f.topics.Policy))
	if len(rels) != 2 || rels[0].PolicyVersion != 0 || rels[1].PolicyVersion != 1 {
		t.Fatalf("releases %+v, want versions 0 and 1", rels)
	}
	if n := len(d.On(f.topics.Census)); n != segments(b0) {
		t.Fatalf("%d trained census events, want %d", n, segments(b0))
	}
	if r := reasons(d.On(f.topics.Quarantine)); !slices.Equal(r, []string{"duplicate_batch"}) {
		t.Fatalf("quarantine reasons %v, want [duplicate_batch]", r)
	}
	pol, err := gpu.LoadRelease(rels[1])
	if err != nil || pol.Version() != 1 {
		t.Fatalf("load release: %v", err)
	}
	u, err := gpu.ReadUpdate(files, 1)
	if err != nil || u.BatchID != b0.BatchID || u.Metrics.RatioMax != 1 || u.Metrics.RatioMin != 1 {
		t.Fatalf("update record %+v %v", u, err)
	}

	// Restart: the state comes back from the topics and the release files.
	scan := pipeline.MemScanner{
		f.topics.Policy:  d.Messages(f.topics.Policy),
		f.topics.Batches: []pipeline.Message{f.msg(b0, 0)},
	}
	mixed := f.batch(1, 1)
	mixed.BatchIndex, mixed.BatchID = 6, schemas.BatchID(f.loop.RunID, 6)
	mixed.Rows = append(mixed.Rows, b0.Rows...)
	d = f.drive(files, scan, f.msg(b0, 0), f.msg(mixed, 3))
	rels = releases(t, d.On(f.topics.Policy))
	if len(rels) != 1 || rels[0].PolicyVersion != 2 {
		t.Fatalf("after restart: releases %+v, want version 2 only (b0 skipped)", rels)
	}
	if n, want := len(d.On(f.topics.Census)), segments(mixed)-segments(b0); n != want {
		t.Fatalf("mixed batch: %d trained census events, want %d", n, want)
	}
	if len(d.On(f.topics.Incidents)) != 1 {
		t.Fatalf("mixed batch: %d incidents, want 1", len(d.On(f.topics.Incidents)))
	}
	if u, err := gpu.ReadUpdate(files, 2); err != nil || u.Duplicates != segments(b0) {
		t.Fatalf("update record %+v %v", u, err)
	}
}

// TestStageStartRefusesForeignReleases: restarted with the run's policy
// topic but a releases directory without the release it names (another
// run's, or an empty one), the stage refuses to start with a
// configuration error naming the release and the directory problem — not
// an error its restart loop would retry for ever.
func TestStageStartRefusesForeignReleases(t *testing.T) {
	f := newFixture(t)
	d := f.drive(store(t), pipeline.MemScanner{}, f.msg(f.batch(0, 0), 0))
	scan := pipeline.MemScanner{f.topics.Policy: d.Messages(f.topics.Policy)}
	st, err := train.NewStage(f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = pipeline.Drive(context.Background(), st, nil, pipeline.DriveConfig{
		QuarantineTopic: f.topics.Quarantine, Env: pipeline.EnvConfig{Scanner: scan, Releases: store(t)},
	})
	if !errors.Is(err, pipeline.ErrConfig) || !strings.Contains(err.Error(), "release v1 is on "+f.topics.Policy) ||
		!strings.Contains(err.Error(), "--releases") {
		t.Fatalf("start with another releases directory: %v, want a configuration error naming release v1", err)
	}
}

// TestStageQuarantinesUntrainableBatch: a batch holding a token the
// behavior distribution cannot produce (its log-prob is -Inf) is refused
// with reason untrainable_batch — the trainer is unchanged, with no crash
// loop on redelivery — and the next good batch trains.
func TestStageQuarantinesUntrainableBatch(t *testing.T) {
	f := newFixture(t)
	files := store(t)
	bad := f.batch(0, 0)
	row := &bad.Rows[0]
	for i := range row.ActionMask {
		if row.ActionMask[i] == 1 {
			row.InputIDs[i+1] = 0 // the padding token: never sampled, masked out by the grammar
			break
		}
	}
	good := f.batch(1, 0)
	d := f.drive(files, pipeline.MemScanner{}, f.msg(bad, 0), f.msg(bad, 1), f.msg(good, 2))
	if r := reasons(d.On(f.topics.Quarantine)); !slices.Equal(r, []string{"untrainable_batch", "untrainable_batch"}) {
		t.Fatalf("quarantine reasons %v, want untrainable_batch twice", r)
	}
	rels := releases(t, d.On(f.topics.Policy))
	if len(rels) != 2 || rels[1].PolicyVersion != 1 {
		t.Fatalf("releases %+v, want 0 then 1 (the good batch)", rels)
	}
	u, err := gpu.ReadUpdate(files, 1)
	if err != nil || u.BatchID != good.BatchID || u.Metrics.RatioMax != 1 {
		t.Fatalf("the good batch must train from the untouched initial policy (ratio 1): %+v %v", u, err)
	}
}

// TestStageQuarantinesMalformedBatch: a batch that decodes but whose rows
// break what the duplicate mask and the lag rule index by (a segment id
// outside the row's segments, a column shorter than the input ids) is
// refused as untrainable, naming the row and what is wrong; the trainer is
// unchanged and trains the next batch.
func TestStageQuarantinesMalformedBatch(t *testing.T) {
	for _, tc := range []struct {
		name, detail string
		edit         func(r *schemas.PackedRow)
	}{
		{"segment id past the segments", "segment_ids[3] = ", func(r *schemas.PackedRow) { r.SegmentIDs[3] = int32(len(r.SegTrajectoryIDs)) }},
		{"negative segment id", "segment_ids[0] = -1", func(r *schemas.PackedRow) { r.SegmentIDs[0] = -1 }},
		{"no segment metadata", "the row has 0 segments", func(r *schemas.PackedRow) {
			r.SegTrajectoryIDs, r.SegGroupIDs, r.SegPolicyVersions, r.SegLengths, r.SegWeights, r.SegTruncated = nil, nil, nil, nil, nil, nil
		}},
		{"short action mask", "action_mask for", func(r *schemas.PackedRow) { r.ActionMask = r.ActionMask[:len(r.ActionMask)-1] }},
		{"short policy versions", "policy_versions for", func(r *schemas.PackedRow) { r.PolicyVersions = r.PolicyVersions[:2] }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			files := store(t)
			bad := f.batch(0, 0)
			tc.edit(&bad.Rows[len(bad.Rows)-1])
			good := f.batch(1, 0)
			d := f.drive(files, pipeline.MemScanner{}, f.msg(bad, 0), f.msg(good, 1))
			q := d.On(f.topics.Quarantine)
			if r := reasons(q); !slices.Equal(r, []string{"untrainable_batch"}) {
				t.Fatalf("quarantine reasons %v, want untrainable_batch once", r)
			}
			detail := ""
			for _, h := range q[0].Headers {
				if h.Key == schemas.HeaderDetail {
					detail = string(h.Value)
				}
			}
			want := "row " + strconv.Itoa(len(bad.Rows)-1) + ": "
			if !strings.Contains(detail, want) || !strings.Contains(detail, tc.detail) {
				t.Fatalf("detail %q, want it to name %q and %q", detail, want, tc.detail)
			}
			if rels := releases(t, d.On(f.topics.Policy)); len(rels) != 2 || rels[1].PolicyVersion != 1 {
				t.Fatalf("releases %+v, want 0 then 1 (the good batch)", rels)
			}
		})
	}
}

// TestStageTrainsPastExpRange: a behavior log-prob of -6e29 makes a log
// ratio whose exp is +Inf. The loss clamps it (the default objective) and
// the batch trains; the update record, JSON, carries the lag statistics'
// ratios saturated at e^600 instead of failing to encode (which stopped
// the stage, and again at every redelivery).
func TestStageTrainsPastExpRange(t *testing.T) {
	f := newFixture(t)
	files := store(t)
	b := f.batch(0, 0)
	r := &b.Rows[0]
	r.OldLogprobs[slices.Index(r.ActionMask, 1)] = -6e29
	d := f.drive(files, pipeline.MemScanner{}, f.msg(b, 0))
	if q := d.On(f.topics.Quarantine); len(q) != 0 {
		t.Fatalf("quarantined: %v", reasons(q))
	}
	u, err := gpu.ReadUpdate(files, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(u.Metrics.Lag) != 1 || u.Metrics.Lag[0].RatioMax != math.Exp(objective.MaxReportedLogRatio) || u.Metrics.LogRatioClamped < 1 {
		t.Fatalf("lag statistics %+v, %d clamped: want the ratio max saturated at e^600 and the token clamped in the loss", u.Metrics.Lag, u.Metrics.LogRatioClamped)
	}
}

// TestStageNeedsReleaseStore: without a release store the stage refuses to
// start, naming the flag.
func TestStageNeedsReleaseStore(t *testing.T) {
	f := newFixture(t)
	st, err := train.NewStage(f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = pipeline.Drive(context.Background(), st, nil, pipeline.DriveConfig{Env: pipeline.EnvConfig{Scanner: pipeline.MemScanner{}}})
	if !errors.Is(err, pipeline.ErrNoReleases) {
		t.Fatalf("started without a release store: %v", err)
	}
}

// TestStageUpdateCost: the update record's cost ledger takes the rollout
// and rejected generation from the batch's trajflow-window-cost header
// and adds the update's own optimizer work; a batch without the header
// records no window, and a malformed header is refused, naming it.
func TestStageUpdateCost(t *testing.T) {
	f := newFixture(t)
	files := store(t)
	wc := schemas.WindowCost{Windows: 2,
		Admitted: schemas.EpisodeCost{Episodes: 8, RolloutTokens: 900, GenerationHours: 0.25, EnvironmentHours: 0.5},
		Filtered: schemas.EpisodeCost{Episodes: 3, RolloutTokens: 120, GenerationHours: 0.125, EnvironmentHours: 0.0625}}
	hc, err := schemas.EncodeWindowCost(wc)
	if err != nil {
		t.Fatal(err)
	}
	withCost := func(m pipeline.Message, v []byte) pipeline.Message {
		m.Headers = append(m.Headers, pipeline.Header{Key: schemas.HeaderWindowCost, Value: v})
		return m
	}
	b0, b1, b2 := f.batch(0, 0), f.batch(1, 0), f.batch(2, 0)
	d := f.drive(files, pipeline.MemScanner{},
		withCost(f.msg(b0, 0), hc), f.msg(b1, 1), withCost(f.msg(b2, 2), []byte(`{"windows":1,"admitted":{"rollout_tokens":-4}}`)))
	u, err := gpu.ReadUpdate(files, 1)
	if err != nil || u.Cost == nil {
		t.Fatalf("update 1: %+v %v", u.Cost, err)
	}
	want := schemas.UpdateCost{Windows: 2, Rollout: wc.Admitted, Rejected: wc.Filtered,
		Training: schemas.TrainingCost{OptimizerTokens: u.Metrics.Tokens * 2, AcceleratorHours: u.StepSeconds / 3600}}
	if *u.Cost != want || u.Metrics.Tokens == 0 {
		t.Fatalf("update 1 cost %+v\nwant %+v", *u.Cost, want)
	}
	u, err = gpu.ReadUpdate(files, 2)
	if err != nil || u.Cost == nil || u.Cost.Windows != 0 || u.Cost.Rollout != (schemas.EpisodeCost{}) || u.Cost.Training.OptimizerTokens != u.Metrics.Tokens*2 {
		t.Fatalf("update 2 (no header): cost %+v %v", u.Cost, err)
	}
	q := d.On(f.topics.Quarantine)
	if r := reasons(q); !slices.Equal(r, []string{"header_mismatch"}) {
		t.Fatalf("quarantine reasons %v, want [header_mismatch]", r)
	}
	qm := pipeline.Message{Headers: q[0].Headers}
	if detail := string(qm.Header(schemas.HeaderDetail)); !strings.Contains(detail, "trajflow-window-cost") || !strings.Contains(detail, "rollout_tokens") {
		t.Fatalf("quarantine detail %q does not name the header and field", detail)
	}
}

// TestStageRefusedBatchCost: a batch the trainer refuses whole
// (stale_batch) is in no update of its own; the next update record's
// ledger carries its cost — what it admitted as failed, what it filtered
// as rejected — beside the next batch's own, also across a restart in
// between (the refused cost is stored beside the release), and a refused
// batch redelivered is not carried twice.
func TestStageRefusedBatchCost(t *testing.T) {
	f := newFixture(t)
	files := store(t)
	withCost := func(m pipeline.Message, c schemas.WindowCost) pipeline.Message {
		v, err := schemas.EncodeWindowCost(c)
		if err != nil {
			t.Fatal(err)
		}
		m.Headers = append(m.Headers, pipeline.Header{Key: schemas.HeaderWindowCost, Value: v})
		return m
	}
	staleCost := schemas.WindowCost{Windows: 1,
		Admitted: schemas.EpisodeCost{Episodes: 6, RolloutTokens: 600, GenerationHours: 0.5, EnvironmentHours: 0.25},
		Filtered: schemas.EpisodeCost{Episodes: 2, RolloutTokens: 50},
		Failed:   schemas.EpisodeCost{Episodes: 1, RolloutTokens: 10, EnvironmentHours: 0.125}}
	nextCost := schemas.WindowCost{Windows: 1,
		Admitted: schemas.EpisodeCost{Episodes: 8, RolloutTokens: 800, GenerationHours: 1, EnvironmentHours: 0.5},
		Failed:   schemas.EpisodeCost{RolloutTokens: 0, EnvironmentHours: 0.25}}
	// Versions 0..3 from batches 0..2; batch 3, sampled at version 1, is
	// lag 2 > max_lag 1 at trainer version 3: refused whole.
	first := []pipeline.Message{f.msg(f.batch(0, 0), 0), f.msg(f.batch(1, 1), 1), f.msg(f.batch(2, 2), 2)}
	stale := withCost(f.msg(f.batch(3, 1), 3), staleCost)
	next := withCost(f.msg(f.batch(4, 3), 4), nextCost)
	want := schemas.UpdateCost{Windows: 2,
		Rollout:  nextCost.Admitted,
		Rejected: staleCost.Filtered,
		Failed:   schemas.EpisodeCost{Episodes: 7, RolloutTokens: 610, GenerationHours: 0.5, EnvironmentHours: 0.625}}
	check := func(name string) {
		t.Helper()
		u, err := gpu.ReadUpdate(files, 4)
		if err != nil || u.Cost == nil {
			t.Fatalf("%s: update 4: %+v %v", name, u.Cost, err)
		}
		got := *u.Cost
		got.Training = schemas.TrainingCost{}
		if got != want || u.BatchIndex != 4 {
			t.Fatalf("%s: update 4 (batch %d) cost %+v\nwant %+v", name, u.BatchIndex, got, want)
		}
	}
	// One run, the refused batch delivered twice.
	d := f.drive(files, pipeline.MemScanner{}, append(slices.Clone(first), stale, stale, next)...)
	if r := reasons(d.On(f.topics.Quarantine)); !slices.Equal(r, []string{"stale_batch", "stale_batch"}) {
		t.Fatalf("quarantine %v, want the stale batch twice", r)
	}
	check("one run")

	// A restart between the refusal (committed) and the next update.
	files = store(t)
	d1 := f.drive(files, pipeline.MemScanner{}, append(slices.Clone(first), stale)...)
	scan := pipeline.MemScanner{f.topics.Policy: d1.Messages(f.topics.Policy), f.topics.Batches: append(slices.Clone(first), stale)}
	f.drive(files, scan, next)
	check("after a restart")
}

// TestStageRefusesRowOverTokenBudget: a row longer than packing.token_budget
// is not one pack made; the batch is refused as untrainable, naming the
// row and both lengths, and nothing is trained. At a budget the rows fit,
// the same batch trains.
func TestStageRefusesRowOverTokenBudget(t *testing.T) {
	f := newFixture(t)
	bad := f.batch(0, 0)
	longest, at := 0, 0
	for i, r := range bad.Rows {
		if len(r.InputIDs) > longest {
			longest, at = len(r.InputIDs), i
		}
	}
	f.cfg.TokenBudget = longest - 1
	d := f.drive(store(t), pipeline.MemScanner{}, f.msg(bad, 0))
	q := d.On(f.topics.Quarantine)
	if r := reasons(q); !slices.Equal(r, []string{"untrainable_batch"}) {
		t.Fatalf("quarantine reasons %v, want untrainable_batch once", r)
	}
	want := fmt.Sprintf("row %d: %d tokens, over packing.token_budget %d", at, longest, longest-1)
	detail := ""
	for _, h := range q[0].Headers {
		if h.Key == schemas.HeaderDetail {
			detail = string(h.Value)
		}
	}
	if !strings.Contains(detail, want) {
		t.Fatalf("detail %q, want %q", detail, want)
	}
	if rels := releases(t, d.On(f.topics.Policy)); len(rels) != 1 {
		t.Fatalf("%d releases, want the initial one only", len(rels))
	}
	f.cfg.TokenBudget = longest
	d = f.drive(store(t), pipeline.MemScanner{}, f.msg(bad, 0))
	if q := d.On(f.topics.Quarantine); len(q) != 0 || len(releases(t, d.On(f.topics.Policy))) != 2 {
		t.Fatalf("at budget %d: %d refused, want the batch trained", longest, len(q))
	}
}

// TestStageKLToReference: with kl_placement loss the stage computes every
// row's reference log-probs with the reference model. The reference is
// the initial policy, so the first step of the first update has a KL of
// exactly 0 (reference and current log-probs agree bit for bit), its
// second epoch and the next update a positive one; the term changes what
// is trained (the release of update 1 differs from the same run without
// it). Without a reference model the stage refuses the placement.
func TestStageKLToReference(t *testing.T) {
	run := func(kl bool) ([]schemas.UpdateRecord, []schemas.PolicyRelease) {
		f := newFixture(t)
		if kl {
			f.cfg.Objective.KLPlacement, f.cfg.Objective.KLEstimator, f.cfg.Objective.KLCoef = objective.KLLoss, objective.K3, 0.5
			f.cfg.Reference = f.m0
		}
		files := store(t)
		d := f.drive(files, pipeline.MemScanner{}, f.msg(f.batch(0, 0), 0), f.msg(f.batch(1, 1), 1))
		var us []schemas.UpdateRecord
		for v := int64(1); v <= 2; v++ {
			u, err := gpu.ReadUpdate(files, v)
			if err != nil {
				t.Fatal(err)
			}
			us = append(us, u)
		}
		return us, releases(t, d.On(f.topics.Policy))
	}
	us, rels := run(true)
	if us[0].Metrics.KL != 0 {
		t.Errorf("update 1, first step on the reference itself: KL %v, want exactly 0", us[0].Metrics.KL)
	}
	if !(us[0].Last.KL > 0) || !(us[1].Metrics.KL > 0) {
		t.Errorf("after a step: KL %v (update 1, epoch 2), %v (update 2), want > 0", us[0].Last.KL, us[1].Metrics.KL)
	}
	if want := us[1].Metrics.PolicyLoss + 0.5*us[1].Metrics.KL - 0.05*us[1].Metrics.Entropy; math.Abs(us[1].Metrics.Loss-want) > 1e-12 {
		t.Errorf("update 2: loss %v, want policy loss + 0.5 KL - 0.05 entropy = %v", us[1].Metrics.Loss, want)
	}
	plain, plainRels := run(false)
	if plain[0].Last.KL != 0 || plain[1].Metrics.KL != 0 {
		t.Errorf("without the placement: KL %v, %v, want 0 (no reference computed)", plain[0].Last.KL, plain[1].Metrics.KL)
	}
	if rels[1].CheckpointHash == plainRels[1].CheckpointHash {
		t.Errorf("release 1 is %s with and without the KL term", rels[1].CheckpointHash)
	}

	f := newFixture(t)
	f.cfg.Objective.KLPlacement, f.cfg.Objective.KLEstimator, f.cfg.Objective.KLCoef = objective.KLLoss, objective.K3, 0.5
	if _, err := train.NewStage(f.cfg); err == nil || !strings.Contains(err.Error(), "reference model") {
		t.Errorf("kl_placement loss without a reference: %v", err)
	}
}
