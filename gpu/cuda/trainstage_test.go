package cuda

import (
	"context"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/operators/train"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// TestTrainStageSwitchesBackend: the train operator runs on the device
// backend (emulated kernels) and a run switches device across a restart.
// A CPU run trains batch 0 (releases 0 and 1, optimizer state beside
// them); then the same state is restarted twice, once on the CPU and once
// on the device backend, and both train batch 1 into release 2: same
// version and training step, parameters and optimizer state within the
// documented tolerances, and the device release loads as a policy. The
// device stage then trains batch 2, sampled from its own release 2, on
// policy (ratio 1 within the tolerance).
func TestTrainStageSwitchesBackend(t *testing.T) {
	ctx := context.Background()
	loop := backendLoop(t, 1)
	topics, err := pipeline.TopicsFor(loop.RunID)
	if err != nil {
		t.Fatal(err)
	}
	cfg := train.StageConfig{
		Topics: topics, RunID: loop.RunID, ContractHash: "contract", Behavior: loop.Settings.Behavior,
		Model: model.DefaultConfig(), ModelSeed: 7, Objective: gpu.DefaultObjective(), Adam: gpu.DefaultAdam(), Epochs: 2,
		Lag: train.LagRule{MaxLag: 1 << 20, Policy: pack.StaleDrop},
	}
	msg := func(b schemas.PackedBatch, off int64) pipeline.Message {
		v, err := schemas.PackedBatches.Encode(nil, b)
		if err != nil {
			t.Fatal(err)
		}
		return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Batches, Offset: off}, Key: []byte(b.BatchID), Value: v}
	}
	batch := func(pol *model.Policy, k int64) schemas.PackedBatch {
		b, err := loop.Batch(ctx, pol, k)
		if err != nil {
			t.Fatal(err)
		}
		b.BatchID = schemas.BatchID(loop.RunID, k)
		return b
	}
	drive := func(backend gpu.BackendFactory, files pipeline.ReleaseStore, scan pipeline.MemScanner, in ...pipeline.Message) *pipeline.Driven {
		c := cfg
		c.Backend = backend
		st, err := train.NewStage(c)
		if err != nil {
			t.Fatal(err)
		}
		d, err := pipeline.Drive(ctx, st, in, pipeline.DriveConfig{
			QuarantineTopic: topics.Quarantine, Env: pipeline.EnvConfig{Scanner: scan, Releases: files},
		})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	release := func(d *pipeline.Driven, v int64) schemas.PolicyRelease {
		for _, o := range d.On(topics.Policy) {
			r, err := schemas.DecodeRelease(o.Value)
			if err != nil {
				t.Fatal(err)
			}
			if r.PolicyVersion == v {
				return r
			}
		}
		t.Fatalf("no release %d", v)
		return schemas.PolicyRelease{}
	}
	m0, err := gpu.InitialModel(cfg.Model, cfg.ModelSeed)
	if err != nil {
		t.Fatal(err)
	}
	cpuDir := t.TempDir()
	cpuFiles, err := pipeline.NewDirReleases(cpuDir)
	if err != nil {
		t.Fatal(err)
	}
	b0 := batch(model.NewPolicy(m0, 0), 0)
	d0 := drive(gpu.CPUBackend, cpuFiles, pipeline.MemScanner{}, msg(b0, 0))
	rel1 := release(d0, 1)
	pol1, err := gpu.LoadRelease(rel1)
	if err != nil {
		t.Fatal(err)
	}
	b1 := batch(pol1, 1)

	// The same state in a second store for the device run.
	devDir := t.TempDir()
	entries, err := os.ReadDir(cpuDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(cpuDir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(devDir, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	devFiles, err := pipeline.NewDirReleases(devDir)
	if err != nil {
		t.Fatal(err)
	}
	scan := func() pipeline.MemScanner {
		return pipeline.MemScanner{topics.Policy: d0.Messages(topics.Policy), topics.Batches: []pipeline.Message{msg(b0, 0)}}
	}
	var o emuDevice
	dc := drive(gpu.CPUBackend, cpuFiles, scan(), msg(b1, 1))
	dd := drive(o.factory(), devFiles, scan(), msg(b1, 1))
	if o.opened != 1 || o.closed != 1 {
		t.Fatalf("device opened %d, closed %d times", o.opened, o.closed)
	}
	rc, rd := release(dc, 2), release(dd, 2)
	if rc.TrainingStep != 4 || rd.TrainingStep != rc.TrainingStep || len(dd.On(topics.Policy)) != 1 {
		t.Fatalf("releases: cpu %+v, device %+v", rc, rd)
	}
	cm, err := readModel(cpuFiles, rc)
	if err != nil {
		t.Fatal(err)
	}
	dm, err := readModel(devFiles, rd)
	if err != nil {
		t.Fatal(err)
	}
	prel, _, ok := paramsClose(dm.Params, cm.Params, 1e-5)
	n := cfg.Model.NumParams()
	read := func(f pipeline.ReleaseStore) []byte {
		b, err := f.Read(gpu.OptimName(2))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	cs, c1, c2 := moments(t, read(cpuFiles), n)
	ds, d1, d2 := moments(t, read(devFiles), n)
	r1, r2 := relL2(d1, c1), relL2(d2, c2)
	t.Logf("release 2, device vs cpu: params rel L2 %.3g, Adam m1 %.3g, m2 %.3g", prel, r1, r2)
	if !ok || r1 > 1e-4 || r2 > 1e-4 || cs != ds || cs != 4 {
		t.Fatalf("release 2: params rel L2 %.3g, m1 %.3g, m2 %.3g, steps %d / %d", prel, r1, r2, ds, cs)
	}
	uc, err := gpu.ReadUpdate(cpuFiles, 2)
	if err != nil {
		t.Fatal(err)
	}
	ud, err := gpu.ReadUpdate(devFiles, 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := metricsClose(ud.Metrics, uc.Metrics, 1e-5); err != nil {
		t.Fatalf("update record 2: %v", err)
	}

	// The device run goes on from its own release.
	pol2, err := gpu.LoadRelease(rd)
	if err != nil {
		t.Fatal(err)
	}
	b2 := batch(pol2, 2)
	scan2 := pipeline.MemScanner{topics.Policy: append(d0.Messages(topics.Policy), dd.Messages(topics.Policy)...),
		topics.Batches: []pipeline.Message{msg(b0, 0), msg(b1, 1)}}
	d3 := drive(o.factory(), devFiles, scan2, msg(b2, 2))
	if r := release(d3, 3); r.TrainingStep != 6 {
		t.Fatalf("release 3: %+v", r)
	}
	// On policy the device's ratio is 1 up to the float32 rounding of its
	// log-probs (its log-sum-exp runs in another order than the sampler's;
	// only the CPU trainer is bit-exact), inside the documented 1e-5.
	u3, err := gpu.ReadUpdate(devFiles, 3)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("update 3 on the device, first step on policy: ratio [%.9g, %.9g], approx KL %.3g", u3.Metrics.RatioMin, u3.Metrics.RatioMax, u3.Metrics.ApproxKLOld)
	if u3.Metrics.FromVersion != 2 || math.Abs(u3.Metrics.RatioMin-1) > 1e-5 || math.Abs(u3.Metrics.RatioMax-1) > 1e-5 {
		t.Fatalf("update 3 on the device: %+v", u3.Metrics.ObjectiveStats)
	}
}

func readModel(f pipeline.ReleaseStore, rel schemas.PolicyRelease) (*model.Model, error) {
	b, err := f.Read(rel.CheckpointURI)
	if err != nil {
		return nil, err
	}
	return gpu.ModelFromRelease(rel, b)
}
