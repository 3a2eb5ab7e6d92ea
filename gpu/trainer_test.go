package gpu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/internal/pipetest"
	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// smallLoop is a quick loop configuration for unit tests: every group kept
// (zero-variance groups train with advantage 0), so batches are never empty.
func smallLoop() loopConfig {
	c := demoLoopConfig()
	c.Registry.Train, c.Registry.Eval = 16, 8
	c.GroupSize, c.TasksPerStep = 4, 8
	c.Advantage.ZeroVariance = advantage.ZeroVarKeep
	return c
}

// batchFor collects one packed batch at the trainer's current version.
func batchFor(t *testing.T, h *harness, update int) schemas.PackedBatch {
	t.Helper()
	train := h.reg.Train()
	groups, _, err := h.collect(context.Background(), train[:h.cfg.TasksPerStep], int64(update*100), h.cfg.GroupSize)
	if err != nil {
		t.Fatal(err)
	}
	w, err := pack.NewWindow(h.cfg.Pack, h.tr.Version())
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range groups {
		for _, s := range g {
			if _, err := w.Add(s); err != nil {
				t.Fatal(err)
			}
		}
	}
	b, _ := w.Close(int64(update), h.runID, "contract", h.tr.Version())
	if len(b.Rows) == 0 {
		t.Fatal("empty batch")
	}
	return b
}

// TestRatioOneBeforeFirstUpdate: the trainer's recomputed log-probs on the
// exact stored tokens equal the behavior log-probs bit for bit, so the
// ratio is exactly 1 and the KL to the behavior policy exactly 0 before any
// update (docs/PIPELINE.md §21 "Ratio is not one before first update"), for the
// demo sampler and for one with temperature, top-k and top-p.
func TestRatioOneBeforeFirstUpdate(t *testing.T) {
	for _, tc := range []struct {
		name string
		b    model.Behavior
	}{
		{"demo", model.Behavior{Temperature: 1}},
		{"temperature-topk-topp", model.Behavior{Temperature: 0.7, TopK: 4, TopP: 0.9}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := smallLoop()
			cfg.Settings.Behavior.Temperature = tc.b.Temperature
			cfg.Settings.TopK, cfg.Settings.TopP = tc.b.TopK, tc.b.TopP
			h := newHarness(t, cfg)
			// The batch crosses the wire format the trainer consumes (Arrow
			// IPC) before the step.
			mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
			defer mem.AssertSize(t, 0)
			wire, err := schemas.PackedBatches.Encode(mem, batchFor(t, h, 0))
			if err != nil {
				t.Fatal(err)
			}
			batch, err := schemas.PackedBatches.Decode(mem, wire)
			if err != nil {
				t.Fatal(err)
			}
			m := h.tr.Model()
			trained := 0
			for ri, row := range batch.Rows {
				lp, err := m.LogprobsForTraining(h.tr.Behavior(), row.InputIDs, row.PositionIDs, row.SegmentIDs)
				if err != nil {
					t.Fatal(err)
				}
				for i, mk := range row.ActionMask {
					if mk == 1 {
						trained++
						if math.Float32bits(lp[i]) != math.Float32bits(row.OldLogprobs[i]) {
							t.Fatalf("row %d position %d: recomputed %v, behavior %v", ri, i, lp[i], row.OldLogprobs[i])
						}
					}
				}
			}
			met, err := h.tr.Step(batch, cfg.Objective, cfg.Adam)
			if err != nil {
				t.Fatal(err)
			}
			if met.RatioMin != 1 || met.RatioMax != 1 || met.RatioMean != 1 || met.ApproxKLOld != 0 {
				t.Fatalf("ratio [%v %v] mean %v, approx KL %v before the first update", met.RatioMin, met.RatioMax, met.RatioMean, met.ApproxKLOld)
			}
			if met.ClippedPos+met.ClippedNeg != 0 || int(met.Tokens) != trained {
				t.Fatalf("metrics %+v, %d trained tokens", met.ObjectiveStats, trained)
			}
			if len(met.Lag) != 1 || met.Lag[0].Lag != 0 || met.Lag[0].K3 != 0 || met.Lag[0].Tokens != met.Tokens {
				t.Fatalf("lag stats %+v", met.Lag)
			}
			if met.FromVersion != 0 || met.Version != 1 || h.tr.Version() != 1 {
				t.Fatalf("versions %d -> %d", met.FromVersion, met.Version)
			}
			if tc.b.TopK != 0 || tc.b.TopP != 0 {
				return // off-policy steps under top-k/top-p: see model.Behavior
			}
			// A second epoch on the same batch is off-policy by one version.
			met2, err := h.tr.Step(batch, cfg.Objective, cfg.Adam)
			if err != nil {
				t.Fatal(err)
			}
			if met2.RatioMin == 1 && met2.RatioMax == 1 {
				t.Fatal("ratio still exactly 1 after an update")
			}
			if len(met2.Lag) != 1 || met2.Lag[0].Lag != 1 {
				t.Fatalf("second epoch lag stats %+v", met2.Lag)
			}
		})
	}
}

// TestStepDirection: an update on one batch raises the log-probability of
// tokens with positive advantage and lowers it for negative advantage
// (docs/PIPELINE.md §18 Gate A "observe expected direction").
func TestStepDirection(t *testing.T) {
	cfg := smallLoop()
	cfg.Objective.EntropyCoef = 0
	cfg.GroupSize, cfg.TasksPerStep = 16, 16 // enough successes for both signs
	h := newHarness(t, cfg)
	batch := batchFor(t, h, 0)
	before := h.tr.Model()
	if _, err := h.tr.Step(batch, cfg.Objective, AdamOptions{LR: 0.003, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8}); err != nil {
		t.Fatal(err)
	}
	after := h.tr.Model()
	var up, down float64
	var nPos, nNeg int
	for _, row := range batch.Rows {
		lb, err := before.LogprobsForTraining(h.tr.Behavior(), row.InputIDs, row.PositionIDs, row.SegmentIDs)
		if err != nil {
			t.Fatal(err)
		}
		la, err := after.LogprobsForTraining(h.tr.Behavior(), row.InputIDs, row.PositionIDs, row.SegmentIDs)
		if err != nil {
			t.Fatal(err)
		}
		for i, mk := range row.ActionMask {
			if mk != 1 {
				continue
			}
			d := float64(la[i] - lb[i])
			switch a := row.Advantages[i]; {
			case a > 0:
				up += d
				nPos++
			case a < 0:
				down += d
				nNeg++
			}
		}
	}
	if nPos == 0 || nNeg == 0 {
		t.Fatalf("batch has %d positive and %d negative tokens", nPos, nNeg)
	}
	if up/float64(nPos) <= 0 || down/float64(nNeg) >= 0 {
		t.Fatalf("mean log-prob change %+.4g on A>0 tokens, %+.4g on A<0 tokens", up/float64(nPos), down/float64(nNeg))
	}
}

// TestStepDeterministic: the same batch from the same state gives the same
// parameters bit for bit.
func TestStepDeterministic(t *testing.T) {
	cfg := smallLoop()
	h := newHarness(t, cfg)
	batch := batchFor(t, h, 0)
	t2, err := NewTrainer(h.tr.Model(), h.tr.Behavior(), 0)
	if err != nil {
		t.Fatal(err)
	}
	m1, err := h.tr.Step(batch, cfg.Objective, cfg.Adam)
	if err != nil {
		t.Fatal(err)
	}
	m2, err := t2.Step(batch, cfg.Objective, cfg.Adam)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(h.tr.Model().Params, t2.Model().Params) || m1.Loss != m2.Loss || m1.GradNorm != m2.GradNorm {
		t.Fatal("two identical steps differ")
	}
	if m1.GradScale <= 0 || m1.GradScale > 1 || m1.Segments == 0 || m1.InputTokens == 0 {
		t.Fatalf("metrics %+v", m1)
	}
}

func TestStepErrors(t *testing.T) {
	cfg := smallLoop()
	h := newHarness(t, cfg)
	good := batchFor(t, h, 0)
	mutate := func(f func(r *schemas.PackedRow)) schemas.PackedBatch {
		b := good
		b.Rows = slices.Clone(good.Rows)
		r := b.Rows[0]
		r.InputIDs = slices.Clone(r.InputIDs)
		r.PositionIDs = slices.Clone(r.PositionIDs)
		r.ActionMask = slices.Clone(r.ActionMask)
		r.OldLogprobs = slices.Clone(r.OldLogprobs)
		r.PolicyVersions = slices.Clone(r.PolicyVersions)
		f(&r)
		b.Rows[0] = r
		return b
	}
	for _, tc := range []struct {
		name  string
		batch schemas.PackedBatch
		adam  AdamOptions
		want  error
	}{
		{"short mask", mutate(func(r *schemas.PackedRow) { r.ActionMask = r.ActionMask[1:] }), cfg.Adam, ErrBatch},
		{"positions", mutate(func(r *schemas.PackedRow) { r.PositionIDs[1] = 5 }), cfg.Adam, ErrBatch},
		{"no trained token", mutate(func(r *schemas.PackedRow) { clear(r.ActionMask) }), cfg.Adam, nil},
		{"token outside vocab", mutate(func(r *schemas.PackedRow) { r.InputIDs[2] = 99 }), cfg.Adam, model.ErrToken},
		{"future version", mutate(func(r *schemas.PackedRow) {
			for i := range r.PolicyVersions {
				if r.ActionMask[i] == 1 {
					r.PolicyVersions[i] = 7
				}
			}
		}), cfg.Adam, objective.ErrInput},
		{"nan old logprob", mutate(func(r *schemas.PackedRow) {
			i := slices.Index(r.ActionMask, 1)
			r.OldLogprobs[i] = float32(math.NaN())
		}), cfg.Adam, objective.ErrInput},
		{"bad lr", good, AdamOptions{LR: -1, Beta1: 0.9, Beta2: 0.99, Eps: 1e-8}, ErrOptim},
		{"bad beta", good, AdamOptions{LR: 1, Beta1: 1, Beta2: 0.99, Eps: 1e-8}, ErrOptim},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "no trained token" {
				// Only one row: with no mask left the batch trains nothing.
				tc.batch.Rows = tc.batch.Rows[:1]
				tc.want = ErrBatch
			}
			before := h.tr.Model().Params
			_, err := h.tr.Step(tc.batch, cfg.Objective, tc.adam)
			if !errors.Is(err, tc.want) {
				t.Fatalf("err %v, want %v", err, tc.want)
			}
			if h.tr.Version() != 0 || !slices.Equal(before, h.tr.Model().Params) {
				t.Fatal("a failed step changed the trainer")
			}
		})
	}
}

// TestStepHugeLogRatio: stored old log-probs of -1000 with negative
// advantages give finite log ratios of about 1000 whose exp overflows.
// Without a clamp the step is refused by the objective (ErrNonFinite, an
// objective.ErrInput: untrainable) before any parameter changes; with the
// default clamp it trains with a finite loss, the tokens counted as
// clamped.
func TestStepHugeLogRatio(t *testing.T) {
	cfg := smallLoop()
	h := newHarness(t, cfg)
	b := batchFor(t, h, 0)
	b.Rows = slices.Clone(b.Rows)
	r := b.Rows[0]
	r.OldLogprobs, r.Advantages = slices.Clone(r.OldLogprobs), slices.Clone(r.Advantages)
	clamped := int64(0)
	for i, m := range r.ActionMask {
		if m == 1 {
			r.OldLogprobs[i], r.Advantages[i] = -1000, -1
			clamped++
		}
	}
	b.Rows[0] = r
	before := h.tr.Model().Params
	off := cfg.Objective
	off.MaxLogRatio = 0
	if _, err := h.tr.Step(b, off, cfg.Adam); !errors.Is(err, objective.ErrNonFinite) || !errors.Is(err, objective.ErrInput) {
		t.Fatalf("no clamp: err %v, want objective.ErrNonFinite", err)
	}
	if h.tr.Version() != 0 || !slices.Equal(before, h.tr.Model().Params) {
		t.Fatal("a refused step changed the trainer")
	}
	if DefaultObjective().MaxLogRatio != objective.DefaultMaxLogRatio {
		t.Fatalf("DefaultObjective clamps at %v, want %v", DefaultObjective().MaxLogRatio, objective.DefaultMaxLogRatio)
	}
	met, err := h.tr.Step(b, DefaultObjective(), cfg.Adam)
	if err != nil {
		t.Fatalf("default clamp: %v", err)
	}
	if math.IsInf(met.Loss, 0) || math.IsNaN(met.Loss) || met.LogRatioClamped < clamped || met.RatioMax != math.Exp(objective.DefaultMaxLogRatio) {
		t.Fatalf("default clamp: loss %v, %d clamped (want >= %d), ratio max %v", met.Loss, met.LogRatioClamped, clamped, met.RatioMax)
	}
}

// TestReleaseAndLoad: a release is complete on disk, hashed, atomically
// named, loadable with verification; tampering is detected.
func TestReleaseAndLoad(t *testing.T) {
	cfg := smallLoop()
	h := newHarness(t, cfg)
	if _, err := h.tr.Step(batchFor(t, h, 0), cfg.Objective, cfg.Adam); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	files, err := pipeline.NewDirReleases(dir)
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 11, 30, 8, 0, 0, 0, time.UTC)
	rel, err := h.tr.Release(files, ReleaseMeta{TokenizerHash: "tok", ChatTemplateHash: "tpl", SamplerContract: cfg.Settings.ID(),
		ContractHash: "contract", Now: func() time.Time { return at }})
	if err != nil {
		t.Fatal(err)
	}
	if rel.PolicyVersion != 1 || rel.TrainingStep != 1 || !rel.Ready || rel.CreatedAt != "2026-11-30T08:00:00Z" ||
		rel.ModelConfigHash != cfg.Model.Hash() || !strings.HasPrefix(rel.CheckpointHash, "sha256:") {
		t.Fatalf("release %+v", rel)
	}
	entries, _ := os.ReadDir(dir)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if want := []string{CheckpointName(1), ManifestName(1)}; !slices.Equal(names, want) {
		t.Fatalf("files %v, want %v (no temporary file left)", names, want)
	}
	js, _ := os.ReadFile(filepath.Join(dir, ManifestName(1)))
	var onDisk schemas.PolicyRelease
	if err := json.Unmarshal(js, &onDisk); err != nil || onDisk != rel {
		t.Fatalf("manifest on disk %+v (%v), returned %+v", onDisk, err, rel)
	}
	b, _ := os.ReadFile(filepath.Join(dir, CheckpointName(1)))
	if model.HashBytes(b) != rel.CheckpointHash {
		t.Fatal("checkpoint hash does not match the file")
	}
	pol, err := LoadRelease(rel)
	if err != nil {
		t.Fatal(err)
	}
	// The loaded policy samples exactly as the trainer's own snapshot.
	reqs := []model.Request{{Context: []int32{1, 2, 11, 3}, Settings: cfg.Settings, Seed: 5}}
	reqs[0].Settings.Grammar = h.reg.Grammar()
	a, err := pol.Generate(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := h.tr.Policy().Generate(context.Background(), reqs)
	if pol.Version() != 1 || !slices.Equal(a[0].Tokens, c[0].Tokens) || !slices.Equal(a[0].Logprobs, c[0].Logprobs) {
		t.Fatal("loaded policy differs from the trainer's")
	}

	notReady := rel
	notReady.Ready = false
	wrongCfg := rel
	wrongCfg.ModelConfigHash = "sha256:00"
	missing := rel
	missing.CheckpointURI = "file://" + filepath.Join(dir, "nope.ckpt")
	for name, r := range map[string]schemas.PolicyRelease{"not ready": notReady, "config hash": wrongCfg, "missing": missing} {
		if _, err := LoadRelease(r); !errors.Is(err, ErrRelease) {
			t.Errorf("%s: err %v", name, err)
		}
	}
	// The checkpoint_uri comes from a message: a pipe (or a device such
	// as /dev/zero) there is refused naming it, never read until it ends.
	piped := rel
	pipe := filepath.Join(dir, "pipe.ckpt")
	pipetest.Mkfifo(t, pipe)
	piped.CheckpointURI = "file://" + pipe
	if _, err := LoadRelease(piped); !errors.Is(err, ErrRelease) || !strings.Contains(err.Error(), pipe) || !strings.Contains(err.Error(), "not a regular file (named pipe)") {
		t.Errorf("checkpoint_uri naming a pipe: err %v, want ErrRelease naming %s", err, pipe)
	}
	b[len(b)-1] ^= 0x40
	if err := os.WriteFile(filepath.Join(dir, CheckpointName(1)), b, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadRelease(rel); !errors.Is(err, ErrRelease) || !errors.Is(err, model.ErrCheckpoint) {
		t.Fatalf("tampered checkpoint: err %v", err)
	}
}

// TestOfflineLearning is docs/PIPELINE.md §18 Gate A's learning check: GRPO from
// the initial policy on the train split, through the real reward
// (trusted validator), advantage and pack stages, raises the hidden-eval
// success rate to >= 0.6 and >= 2x its initial value, for three model and
// contract seeds (one in -short mode). It stops each seed as soon as an
// evaluation passes.
func TestOfflineLearning(t *testing.T) {
	seeds := []uint64{1, 2, 3}
	if testing.Short() {
		seeds = seeds[:1]
	}
	for _, seed := range seeds {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			cfg := demoLoopConfig()
			cfg.ModelSeed, cfg.ContractSeed = seed, int64(seed)
			cfg.StopAtSuccess = 0.6
			h := newHarness(t, cfg)
			start := time.Now()
			init, curve := h.run(context.Background(), t)
			final := curve[len(curve)-1].EvalSuccess
			var evals []string
			for _, p := range curve {
				if p.EvalSuccess >= 0 {
					evals = append(evals, fmt.Sprintf("u%d:%.3f(train %.3f)", p.Update+1, p.EvalSuccess, p.Train))
				}
			}
			t.Logf("initial eval success %.3f, %d updates in %v: %s", init, len(curve), time.Since(start).Round(time.Millisecond), strings.Join(evals, " "))
			if final < 0.6 || final < 2*init {
				t.Fatalf("eval success %.3f after %d updates (initial %.3f): want >= 0.6 and >= 2x", final, len(curve), init)
			}
		})
	}
}

func BenchmarkStep(b *testing.B) {
	cfg := smallLoop()
	h := newHarness(b, cfg)
	groups, _, err := h.collect(context.Background(), h.reg.Train()[:8], 0, 4)
	if err != nil {
		b.Fatal(err)
	}
	w, _ := pack.NewWindow(cfg.Pack, 0)
	for _, g := range groups {
		for _, s := range g {
			w.Add(s)
		}
	}
	batch, _ := w.Close(0, "bench", "contract", 0)
	var tokens int64
	for _, r := range batch.Rows {
		tokens += int64(len(r.InputIDs))
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		tr, _ := NewTrainer(h.tr.Model(), h.tr.Behavior(), 0)
		if _, err := tr.Step(batch, cfg.Objective, cfg.Adam); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(tokens*int64(b.N))/b.Elapsed().Seconds(), "tokens/s")
}
