package cuda

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/gputest"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// emuDevice is an emulated device for the backend factory: every open
// returns a fresh emulation; its close frees the staging slots (as
// Device.Close does) and is counted.
type emuDevice struct {
	opened, closed int
	last           *emu
	wrap           func(*emu) backend // nil: the emulation itself
}

func (o *emuDevice) open() (backend, func() error, error) {
	o.opened++
	e := newEmu()
	o.last = e
	var b backend = e
	if o.wrap != nil {
		b = o.wrap(e)
	}
	return b, func() error {
		o.closed++
		for s := range e.dev {
			if e.dev[s] != 0 {
				e.Free(e.dev[s])
				e.dev[s] = 0
			}
		}
		return nil
	}, nil
}

func (o *emuDevice) factory() gpu.BackendFactory { return backendFactory(o.open, TrainerOptions{}) }

// backendLoop is the built-in loop with a temperature-only sampler (the
// device step implements no grammar).
func backendLoop(t *testing.T, temperature float64) *gputest.Loop {
	t.Helper()
	loop, err := gputest.Small()
	if err != nil {
		t.Fatal(err)
	}
	loop.Settings.Behavior = model.Behavior{Temperature: temperature}
	return loop
}

// moments decodes an optimizer state (gpu.DecodeOptimState).
func moments(t *testing.T, b []byte, n int) (int64, []float64, []float64) {
	t.Helper()
	m1, m2 := make([]float64, n), make([]float64, n)
	steps, err := gpu.DecodeOptimState(b, m1, m2)
	if err != nil {
		t.Fatal(err)
	}
	return steps, m1, m2
}

// relL2 is ‖got − want‖ / ‖want‖.
func relL2(got, want []float64) float64 {
	var num, den float64
	for i := range want {
		d := got[i] - want[i]
		num += d * d
		den += want[i] * want[i]
	}
	return math.Sqrt(num / den)
}

// compareState requires the device backend's parameters and optimizer
// state to be within the documented tolerances of the CPU trainer's
// (gpu/README.md: parameters relative L2 1e-5; Adam moments relative L2
// 1e-4, since they are sums of raw gradients, whose float32
// accumulation-order differences the parameters' O(1) magnitude does not
// hide), with equal versions and step counts.
func compareState(t *testing.T, what string, dev gpu.Backend, cpu *gpu.Trainer) {
	t.Helper()
	if dev.Version() != cpu.Version() || dev.Steps() != cpu.Steps() {
		t.Fatalf("%s: version %d steps %d, cpu %d %d", what, dev.Version(), dev.Steps(), cpu.Version(), cpu.Steps())
	}
	dm, err := dev.(*Backend).Model()
	if err != nil {
		t.Fatal(err)
	}
	prel, maxAbs, ok := paramsClose(dm.Params, cpu.Model().Params, 1e-5)
	n := len(dm.Params)
	ds, d1, d2 := moments(t, dev.OptimState(), n)
	cs, c1, c2 := moments(t, cpu.OptimState(), n)
	r1, r2 := relL2(d1, c1), relL2(d2, c2)
	t.Logf("%s: params rel L2 %.3g (max |diff| %.3g), Adam m1 rel L2 %.3g, m2 rel L2 %.3g", what, prel, maxAbs, r1, r2)
	if !ok || r1 > 1e-4 || r2 > 1e-4 || ds != cs {
		t.Fatalf("%s: params rel L2 %.3g, m1 %.3g, m2 %.3g, steps %d vs %d", what, prel, r1, r2, ds, cs)
	}
}

// TestBackendParity: the device backend's Update (two epochs per batch,
// on the CPU emulation of the kernels) gives the CPU trainer's metrics,
// statistics of the last epoch, parameters and Adam state within the
// documented tolerances over several real batches of the built-in loop,
// each sampled by the current policy.
func TestBackendParity(t *testing.T) {
	var o emuDevice
	checkBackendParity(t, o.factory())
}

// checkBackendParity compares the backends of f with the CPU trainer
// (TestBackendParity, TestDeviceBackend).
func checkBackendParity(t *testing.T, f gpu.BackendFactory) {
	for _, temp := range []float64{1, 0.7} {
		t.Run(fmt.Sprint("temperature-", temp), func(t *testing.T) {
			loop := backendLoop(t, temp)
			m, err := gpu.InitialModel(model.DefaultConfig(), 11)
			if err != nil {
				t.Fatal(err)
			}
			beh := loop.Settings.Behavior
			cpu, err := gpu.NewTrainer(m, beh, 0)
			if err != nil {
				t.Fatal(err)
			}
			dev, err := f(m, beh, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := dev.Close(); err != nil {
					t.Error(err)
				}
			}()
			adam := gpu.DefaultAdam()
			adam.WeightDecay = 0.01
			opts := gpu.DefaultObjective()
			for k := int64(0); k < 4; k++ {
				batch, err := loop.Batch(context.Background(), cpu.Policy(), k)
				if err != nil {
					t.Fatal(err)
				}
				want, wantLast, err := cpu.Update(batch, opts, adam, 2)
				if err != nil {
					t.Fatal(err)
				}
				got, gotLast, err := dev.Update(batch, opts, adam, 2)
				if err != nil {
					t.Fatal(err)
				}
				if err := metricsClose(got, want, 1e-5); err != nil {
					t.Fatalf("batch %d first epoch: %v", k, err)
				}
				if err := StatsClose(gotLast, wantLast, 1e-5); err != nil {
					t.Fatalf("batch %d last epoch: %v", k, err)
				}
				t.Logf("batch %d: %d rows, %d tokens; loss %.8g (cpu %.8g), last loss %.8g (cpu %.8g), grad norm %.8g (cpu %.8g)",
					k, got.Rows, got.Tokens, got.Loss, want.Loss, gotLast.Loss, wantLast.Loss, got.GradNorm, want.GradNorm)
				compareState(t, fmt.Sprintf("batch %d", k), dev, cpu)
			}
		})
	}
}

// checkBackendUntrainable: an untrainable batch (a non-finite advantage,
// found by the step after the forward and backward passes) is refused as
// gpu.Untrainable and leaves the state bit for bit as before, the device
// restore path included.
func checkBackendUntrainable(t *testing.T, f gpu.BackendFactory) {
	loop := backendLoop(t, 1)
	m, _ := gpu.InitialModel(model.DefaultConfig(), 16)
	dev, err := f(m, loop.Settings.Behavior, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	adam, opts := gpu.DefaultAdam(), gpu.DefaultObjective()
	b0, err := loop.Batch(context.Background(), model.NewPolicy(m, 0), 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := dev.Update(b0, opts, adam, 2); err != nil {
		t.Fatal(err)
	}
	before := stateOf(t, dev)
	nan := b0
	nan.Rows = slices.Clone(b0.Rows)
	r := len(nan.Rows) - 1
	nan.Rows[r].Advantages = slices.Clone(nan.Rows[r].Advantages)
	for i := len(nan.Rows[r].ActionMask) - 1; i >= 0; i-- {
		if nan.Rows[r].ActionMask[i] == 1 {
			nan.Rows[r].Advantages[i] = float32(math.Inf(1))
			break
		}
	}
	if _, _, err := dev.Update(nan, opts, adam, 2); !gpu.Untrainable(err) {
		t.Fatalf("untrainable batch: %v", err)
	}
	sameState(t, "an untrainable batch", stateOf(t, dev), before)
}

// TestBackendUntrainable: checkBackendUntrainable on the emulation.
func TestBackendUntrainable(t *testing.T) {
	var o emuDevice
	checkBackendUntrainable(t, o.factory())
}

// TestBackendOptimStateAcrossDevices: the optimizer state is the CPU
// trainer's format, byte for byte: a device backend restored from a CPU
// release and its state writes the same bytes back and then trains as the
// CPU trainer does; a CPU trainer restored from the device backend's state
// likewise. A corrupted state is refused and changes nothing.
func TestBackendOptimStateAcrossDevices(t *testing.T) {
	loop := backendLoop(t, 1)
	beh := loop.Settings.Behavior
	m, _ := gpu.InitialModel(model.DefaultConfig(), 12)
	cpu, _ := gpu.NewTrainer(m, beh, 0)
	ctx := context.Background()
	adam, opts := gpu.DefaultAdam(), gpu.DefaultObjective()
	batch := func(k int64) schemas.PackedBatch {
		b, err := loop.Batch(ctx, cpu.Policy(), k)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	if _, _, err := cpu.Update(batch(0), opts, adam, 2); err != nil {
		t.Fatal(err)
	}
	// CPU -> device.
	state := cpu.OptimState()
	var o emuDevice
	dev, err := o.factory()(cpu.Model(), beh, cpu.Version())
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	dev.SetSteps(cpu.Steps())
	if err := dev.SetOptimState(state); err != nil {
		t.Fatal(err)
	}
	if got := dev.OptimState(); !slices.Equal(got, state) {
		t.Fatal("device backend's optimizer state differs from the CPU state it was restored from")
	}
	bad := slices.Clone(state)
	bad[30] ^= 1
	for name, b := range map[string][]byte{"flipped bit": bad, "truncated": state[:len(state)-1], "other model": gpu.EncodeOptimState(1, []float64{1}, []float64{1})} {
		if err := dev.SetOptimState(b); !errors.Is(err, gpu.ErrRelease) {
			t.Fatalf("%s: %v", name, err)
		}
	}
	if got := dev.OptimState(); !slices.Equal(got, state) {
		t.Fatal("a refused optimizer state changed the backend")
	}
	b1 := batch(1)
	for _, tr := range []gpu.Backend{cpu, dev} {
		if _, _, err := tr.Update(b1, opts, adam, 2); err != nil {
			t.Fatal(err)
		}
	}
	compareState(t, "device restored from cpu", dev, cpu)
	// Device -> CPU.
	dm, err := dev.(*Backend).Model()
	if err != nil {
		t.Fatal(err)
	}
	cpu2, _ := gpu.NewTrainer(dm, beh, dev.Version())
	cpu2.SetSteps(dev.Steps())
	ds := dev.OptimState()
	if err := cpu2.SetOptimState(ds); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cpu2.OptimState(), ds) {
		t.Fatal("CPU trainer's optimizer state differs from the device state it was restored from")
	}
	b2, err := loop.Batch(ctx, cpu2.Policy(), 2)
	if err != nil {
		t.Fatal(err)
	}
	for _, tr := range []gpu.Backend{cpu2, dev} {
		if _, _, err := tr.Update(b2, opts, adam, 1); err != nil {
			t.Fatal(err)
		}
	}
	compareState(t, "cpu restored from device", dev, cpu2)
}

// memFiles is an in-memory gpu.Files.
type memFiles map[string][]byte

func (f memFiles) Write(name string, data []byte) (string, error) {
	f[name] = slices.Clone(data)
	return "mem://" + name, nil
}

func (f memFiles) Read(name string) ([]byte, error) {
	b, ok := f[strings.TrimPrefix(name, "mem://")]
	if !ok {
		return nil, fmt.Errorf("no file %s", name)
	}
	return b, nil
}

// TestBackendRelease: the device backend publishes exactly the release the
// CPU trainer publishes for the same parameters, version and step count
// (same checkpoint bytes and manifest), through gpu.ReleaseModel.
func TestBackendRelease(t *testing.T) {
	m, _ := gpu.InitialModel(model.DefaultConfig(), 13)
	beh := model.Behavior{Temperature: 1}
	cpu, _ := gpu.NewTrainer(m, beh, 3)
	cpu.SetSteps(5)
	var o emuDevice
	dev, err := o.factory()(m, beh, 3)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	dev.SetSteps(5)
	at := time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)
	meta := gpu.ReleaseMeta{TokenizerHash: "tok", ChatTemplateHash: "tpl", SamplerContract: "sampler", ContractHash: "contract",
		Now: func() time.Time { return at }}
	cf, df := memFiles{}, memFiles{}
	want, err := cpu.Release(cf, meta)
	if err != nil {
		t.Fatal(err)
	}
	got, err := dev.Release(df, meta)
	if err != nil {
		t.Fatal(err)
	}
	if got != want || got.PolicyVersion != 3 || got.TrainingStep != 5 {
		t.Fatalf("release %+v, cpu %+v", got, want)
	}
	if len(df) != 2 || !slices.Equal(df[gpu.CheckpointName(3)], cf[gpu.CheckpointName(3)]) || !slices.Equal(df[gpu.ManifestName(3)], cf[gpu.ManifestName(3)]) {
		t.Fatalf("release files differ: %d files", len(df))
	}
	ckpt, _ := df.Read(got.CheckpointURI)
	if _, err := gpu.PolicyFromRelease(got, ckpt); err != nil {
		t.Fatal(err)
	}
}

// faulty is an emulated device that fails chosen operations: the n-th
// launch of a kernel (after running it, as an asynchronous execution error
// reported late would), the n-th synchronization, or every device copy
// from the n-th on.
type faulty struct {
	*emu
	kernel      string
	kernelAt    int // fail launch number kernelAt (1-based) of kernel
	syncAt      int // fail synchronization number syncAt
	copyFrom    int // fail every Copy from number copyFrom on (0: never)
	nK, nS, nC  int
	injected    int
	failedCalls []string
}

var errInjected = errors.New("injected device fault")

func (f *faulty) Launch(name string, grid, block int, args ...any) error {
	err := f.emu.Launch(name, grid, block, args...)
	if name == f.kernel {
		if f.nK++; f.nK == f.kernelAt {
			f.injected++
			return errInjected
		}
	}
	return err
}

func (f *faulty) Synchronize() error {
	if f.nS++; f.nS == f.syncAt {
		f.injected++
		return errInjected
	}
	return f.emu.Synchronize()
}

func (f *faulty) Copy(dst, src DevPtr, n int64) error {
	if f.nC++; f.copyFrom > 0 && f.nC >= f.copyFrom {
		f.injected++
		return errInjected
	}
	return f.emu.Copy(dst, src, n)
}

// snapshotOf is everything an update may change.
type snapshotOf struct {
	params         []float32
	optim          []byte
	version, steps int64
}

func stateOf(t *testing.T, be gpu.Backend) snapshotOf {
	t.Helper()
	m, err := be.(*Backend).Model()
	if err != nil {
		t.Fatal(err)
	}
	return snapshotOf{params: m.Params, optim: be.OptimState(), version: be.Version(), steps: be.Steps()}
}

func sameState(t *testing.T, what string, got, want snapshotOf) {
	t.Helper()
	if !slices.Equal(got.params, want.params) || !slices.Equal(got.optim, want.optim) || got.version != want.version || got.steps != want.steps {
		t.Fatalf("%s changed the state: version %d steps %d (before %d %d), params equal %v, optimizer state equal %v",
			what, got.version, got.steps, want.version, want.steps, slices.Equal(got.params, want.params), slices.Equal(got.optim, want.optim))
	}
}

// TestBackendUpdateAtomic: a failing Update leaves the parameters, Adam
// moments, step count and version bit for bit as before — for untrainable
// batches (refused at staging, or by the step's non-finite check), which
// gpu.Untrainable recognizes, and for device faults in a later epoch
// (after an epoch changed the parameters) or at the final
// synchronization, which it does not. The backend then trains on as one
// that never saw the failure. A fault while undoing marks it lost.
func TestBackendUpdateAtomic(t *testing.T) {
	loop := backendLoop(t, 1)
	beh := loop.Settings.Behavior
	m, _ := gpu.InitialModel(model.DefaultConfig(), 14)
	ctx := context.Background()
	adam, opts := gpu.DefaultAdam(), gpu.DefaultObjective()
	good0, err := loop.Batch(ctx, model.NewPolicy(m, 0), 0)
	if err != nil {
		t.Fatal(err)
	}
	good1, err := loop.Batch(ctx, model.NewPolicy(m, 1), 1)
	if err != nil {
		t.Fatal(err)
	}
	// The reference: a backend without faults.
	var ro emuDevice
	ref, err := ro.factory()(m, beh, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ref.Close()
	for _, b := range []schemas.PackedBatch{good0, good1} {
		if _, _, err := ref.Update(b, opts, adam, 3); err != nil {
			t.Fatal(err)
		}
	}
	refState := stateOf(t, ref)

	outside := good1
	outside.Rows = slices.Clone(good1.Rows)
	outside.Rows[0].InputIDs = slices.Clone(outside.Rows[0].InputIDs)
	outside.Rows[0].InputIDs[1] = int32(m.Config.Vocab) // a token outside the model
	nan := good1
	nan.Rows = slices.Clone(good1.Rows)
	nan.Rows[0].Advantages = slices.Clone(nan.Rows[0].Advantages)
	for i, mk := range nan.Rows[0].ActionMask {
		if mk == 1 {
			nan.Rows[0].Advantages[i] = float32(math.NaN())
			break
		}
	}

	f := &faulty{}
	o := emuDevice{wrap: func(e *emu) backend { f.emu = e; return f }}
	dev, err := o.factory()(m, beh, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	if _, _, err := dev.Update(good0, opts, adam, 3); err != nil {
		t.Fatal(err)
	}
	before := stateOf(t, dev)
	for _, tc := range []struct {
		name        string
		batch       schemas.PackedBatch
		arm         func()
		untrainable bool
	}{
		{"token outside the vocabulary", outside, func() {}, true},
		{"non-finite advantage", nan, func() {}, true},
		{"fault in the second epoch's Adam step", good1, func() { f.kernel, f.kernelAt, f.nK = "tf_adam", 2, 0 }, false},
		{"fault in the third epoch's loss kernel", good1, func() { f.kernel, f.kernelAt, f.nK = "tf_token_loss", 3, 0 }, false},
		{"fault at the final synchronization", good1, func() { f.syncAt, f.nS = 1, 0 }, false},
	} {
		f.kernel, f.kernelAt, f.syncAt = "", 0, 0
		tc.arm()
		injected := f.injected
		_, _, err := dev.Update(tc.batch, opts, adam, 3)
		if err == nil {
			t.Fatalf("%s: accepted", tc.name)
		}
		if gpu.Untrainable(err) != tc.untrainable {
			t.Fatalf("%s: untrainable %v: %v", tc.name, gpu.Untrainable(err), err)
		}
		if !tc.untrainable && f.injected != injected+1 {
			t.Fatalf("%s: the fault was not injected", tc.name)
		}
		t.Logf("%s: %v", tc.name, err)
		f.kernel, f.kernelAt, f.syncAt = "", 0, 0
		sameState(t, tc.name, stateOf(t, dev), before)
	}
	if _, _, err := dev.Update(good1, opts, adam, 3); err != nil {
		t.Fatal(err)
	}
	sameState(t, "an update after the failures (compared with the reference)", stateOf(t, dev), refState)

	// A fault in the epoch and in the restore: the state is lost.
	f.kernel, f.kernelAt, f.nK = "tf_adam", 1, 0
	f.copyFrom, f.nC = 4, 0 // the three snapshot copies succeed, the restore fails
	_, _, err = dev.Update(good1, opts, adam, 1)
	if !errors.Is(err, ErrDevice) || gpu.Untrainable(err) || !strings.Contains(err.Error(), "lost") {
		t.Fatalf("failed restore: %v", err)
	}
	f.kernel, f.copyFrom = "", 0
	if _, _, err := dev.Update(good1, opts, adam, 1); !errors.Is(err, ErrDevice) {
		t.Fatalf("update of a lost backend: %v", err)
	}
	if _, err := dev.Release(memFiles{}, gpu.ReleaseMeta{}); !errors.Is(err, ErrDevice) {
		t.Fatalf("release of a lost backend: %v", err)
	}
	if dev.OptimState() != nil || dev.SetOptimState(refState.optim) == nil {
		t.Fatal("a lost backend reads or restores an optimizer state")
	}
}

// TestBackendRefusesUnsupported: the factory refuses, before opening a
// device, every behavior the device step does not implement, naming the
// contract fields — the demo's sampler (the task grammar) included.
func TestBackendRefusesUnsupported(t *testing.T) {
	reg, err := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	if err != nil {
		t.Fatal(err)
	}
	m, _ := gpu.InitialModel(model.DefaultConfig(), 1)
	var o emuDevice
	for _, tc := range []struct {
		b    model.Behavior
		want []string
	}{
		{rollout.DefaultSettings(reg).Behavior, []string{"grammar", "artifacts.tool_schemas", "--device cpu"}},
		{model.Behavior{Temperature: 1, TopK: 5}, []string{"sampler.top_k 5"}},
		{model.Behavior{Temperature: 1, TopP: 0.9}, []string{"sampler.top_p 0.9"}},
		{model.Behavior{Temperature: 1, MinP: 0.1}, []string{"sampler.min_p 0.1"}},
		{model.Behavior{Temperature: 0.8, TopK: 3, MinP: 0.2}, []string{"sampler.top_k 3", "sampler.min_p 0.2"}},
	} {
		_, err := o.factory()(m, tc.b, 0)
		if !errors.Is(err, ErrUnsupported) {
			t.Fatalf("%+v: %v", tc.b, err)
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Fatalf("%+v: error %q does not name %q", tc.b, err, w)
			}
		}
	}
	if o.opened != 0 {
		t.Fatalf("a device was opened %d times for unsupported behaviors", o.opened)
	}
	// top-k >= V and top-p 1 restrict nothing.
	be, err := o.factory()(m, model.Behavior{Temperature: 1, TopK: m.Config.Vocab, TopP: 1}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := be.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestBackendRefusesOffPolicyCorrections: the device step implements no
// off-policy correction, so the backend refuses truncated importance
// sampling and the decoupled objective with ErrUnsupported, naming
// loss.off_policy, and the sequence-level ratio, naming loss.ratio — at the check the train stage makes when it starts, and
// in Update — and leaves the parameters untouched; the plain objective
// trains.
func TestBackendRefusesOffPolicyCorrections(t *testing.T) {
	loop := backendLoop(t, 1)
	m, _ := gpu.InitialModel(model.DefaultConfig(), 15)
	var o emuDevice
	be, err := o.factory()(m, loop.Settings.Behavior, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	b, err := loop.Batch(context.Background(), model.NewPolicy(m, 0), 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		off string
		cap float64
	}{{objective.OffPolicyTIS, 2}, {objective.OffPolicyDecoupled, 0}} {
		opts := gpu.DefaultObjective()
		opts.OffPolicy, opts.ISCap = c.off, c.cap
		err := be.(gpu.ObjectiveChecker).CheckObjective(opts)
		if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "loss.off_policy") {
			t.Fatalf("%s: check %v", c.off, err)
		}
		if _, _, err := be.Update(b, opts, gpu.DefaultAdam(), 1); !errors.Is(err, ErrUnsupported) || gpu.Untrainable(err) {
			t.Fatalf("%s: update %v", c.off, err)
		}
		if be.Version() != 0 || be.Steps() != 0 {
			t.Fatalf("%s: refused update moved the backend to version %d, %d steps", c.off, be.Version(), be.Steps())
		}
	}
	seq := gpu.DefaultObjective()
	seq.Ratio = objective.RatioSequence
	if err := be.(gpu.ObjectiveChecker).CheckObjective(seq); !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "loss.ratio") {
		t.Fatalf("sequence ratio: check %v", err)
	}
	if _, _, err := be.Update(b, seq, gpu.DefaultAdam(), 1); !errors.Is(err, ErrUnsupported) || be.Version() != 0 {
		t.Fatalf("sequence ratio: update %v, version %d", err, be.Version())
	}
	if _, _, err := be.Update(b, gpu.DefaultObjective(), gpu.DefaultAdam(), 1); err != nil {
		t.Fatal(err)
	}
}

// TestBackendClose: Close frees every device buffer (trainer, snapshot,
// staging slots) and closes the device the backend opened, once.
func TestBackendClose(t *testing.T) {
	loop := backendLoop(t, 1)
	m, _ := gpu.InitialModel(model.DefaultConfig(), 15)
	var o emuDevice
	be, err := o.factory()(m, loop.Settings.Behavior, 0)
	if err != nil {
		t.Fatal(err)
	}
	b, err := loop.Batch(context.Background(), model.NewPolicy(m, 0), 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := be.Update(b, gpu.DefaultObjective(), gpu.DefaultAdam(), 1); err != nil {
		t.Fatal(err)
	}
	if len(o.last.allocs) == 0 {
		t.Fatal("no device memory in use")
	}
	for i := 0; i < 2; i++ {
		if err := be.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if len(o.last.allocs) != 0 || o.opened != 1 || o.closed != 1 {
		t.Fatalf("after Close: %d allocations, device opened %d closed %d", len(o.last.allocs), o.opened, o.closed)
	}
	if _, _, err := be.Update(b, gpu.DefaultObjective(), gpu.DefaultAdam(), 1); !errors.Is(err, ErrDevice) {
		t.Fatalf("update after Close: %v", err)
	}
}
