package cuda

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

// Backend is the device Trainer as a gpu.Backend, the interface the train
// operator drives (`trajflow run train --device cuda`). It adds what the
// operator needs on top of Stage and Step:
//
//   - Update is atomic from the caller's view. Before the first epoch the
//     parameters and both Adam moments are copied, on the device, into a
//     snapshot (20 bytes per parameter, allocated once); if any epoch, or
//     the final synchronization that surfaces asynchronous kernel errors,
//     fails, the snapshot is copied back and the version and step count
//     are restored. If even that copy fails, the device state is lost:
//     the backend refuses every further call (the train operator then
//     fails, and restarts from the last published release).
//   - Release downloads the parameters and publishes them with
//     gpu.ReleaseModel, the code path of the CPU trainer.
//   - OptimState and SetOptimState use gpu.EncodeOptimState and
//     gpu.DecodeOptimState, the CPU trainer's format, so a run can switch
//     between --device cpu and --device cuda across restarts.
//
// A batch the policy cannot train on (staging or step errors wrapping
// ErrBatch) also wraps gpu.ErrBatch, so gpu.Untrainable classifies it as
// for the CPU trainer. Not safe for concurrent use.
type Backend struct {
	tr       *Trainer
	snap     struct{ params, m1, m2 DevPtr }
	closeDev func() error // closes the device the backend opened; nil if it does not own it
	lost     error        // set once a failed update could not be undone
	closed   bool
}

var _ gpu.Backend = (*Backend)(nil)

// backendFactory is the gpu.BackendFactory of the device step on the
// devices open returns (with the function that closes each). It refuses a
// behavior the device step does not implement (Supported) before opening
// a device.
func backendFactory(open func() (backend, func() error, error), o TrainerOptions) gpu.BackendFactory {
	return func(m *model.Model, b model.Behavior, version int64) (gpu.Backend, error) {
		if err := m.Validate(); err != nil {
			return nil, err
		}
		if err := b.Validate(); err != nil {
			return nil, err
		}
		if err := Supported(b, m.Config.Vocab); err != nil {
			return nil, err
		}
		d, closeDev, err := open()
		if err != nil {
			return nil, err
		}
		be, err := newBackend(d, closeDev, m, b, version, o)
		if err != nil {
			return nil, err
		}
		return be, nil
	}
}

// newBackend starts a Backend on d with m's parameters at version.
// closeDev (nil: none) is called by Close, and here on error.
func newBackend(d backend, closeDev func() error, m *model.Model, b model.Behavior, version int64, o TrainerOptions) (*Backend, error) {
	fail := func(err error) (*Backend, error) {
		if closeDev != nil {
			err = errors.Join(err, closeDev())
		}
		return nil, err
	}
	tr, err := newTrainer(d, m, b, version, o)
	if err != nil {
		return fail(err)
	}
	be := &Backend{tr: tr, closeDev: closeDev}
	done, err := d.Enter()
	if err != nil {
		return fail(errors.Join(err, tr.Close()))
	}
	defer done()
	n := int64(m.Config.NumParams())
	for _, x := range []struct {
		p     *DevPtr
		bytes int64
	}{{&be.snap.params, 4 * n}, {&be.snap.m1, 8 * n}, {&be.snap.m2, 8 * n}} {
		if *x.p, err = d.Alloc(x.bytes); err != nil {
			be.freeSnap()
			return fail(errors.Join(devErr("alloc update snapshot", err), tr.Close()))
		}
	}
	return be, nil
}

func (be *Backend) freeSnap() {
	for _, p := range []*DevPtr{&be.snap.params, &be.snap.m1, &be.snap.m2} {
		if *p != 0 {
			be.tr.d.Free(*p)
			*p = 0
		}
	}
}

// usable is nil while the backend's device state is valid.
func (be *Backend) usable() error {
	switch {
	case be.closed:
		return fmt.Errorf("%w: backend is closed", ErrDevice)
	case be.lost != nil:
		return be.lost
	}
	return nil
}

// Version implements gpu.Backend.
func (be *Backend) Version() int64 { return be.tr.Version() }

// Steps implements gpu.Backend.
func (be *Backend) Steps() int64 { return be.tr.Steps() }

// CheckObjective implements gpu.ObjectiveChecker: the device step
// implements the objective without an off-policy correction; truncated
// importance sampling and the decoupled objective (loss.off_policy,
// loss.is_cap), and the sequence-level ratio (loss.ratio), are
// ErrUnsupported.
func (be *Backend) CheckObjective(opts objective.Options) error {
	if opts.Corrected() {
		return fmt.Errorf("%w: the CUDA trainer implements loss.off_policy %q only; this contract has loss.off_policy %q (is_cap %g): train it on the CPU (--device cpu)",
			ErrUnsupported, objective.OffPolicyNone, opts.OffPolicy, opts.ISCap)
	}
	if opts.SequenceRatio() {
		return fmt.Errorf("%w: the CUDA trainer implements loss.ratio %q only; this contract has loss.ratio %q: train it on the CPU (--device cpu)",
			ErrUnsupported, objective.RatioToken, opts.Ratio)
	}
	return nil
}

var _ gpu.ObjectiveChecker = (*Backend)(nil)

// SetSteps implements gpu.Backend.
func (be *Backend) SetSteps(n int64) { be.tr.steps = n }

// Update implements gpu.Backend: the batch is staged once, then epochs
// device steps run on it; they make one policy version. It returns the
// metrics of the first step and the objective statistics of the last. On
// error the parameters, Adam moments, step count and version are as
// before.
func (be *Backend) Update(batch schemas.PackedBatch, opts objective.Options, adam gpu.AdamOptions, epochs int) (gpu.Metrics, objective.Stats, error) {
	if err := be.usable(); err != nil {
		return gpu.Metrics{}, objective.Stats{}, err
	}
	if err := opts.Validate(); err != nil {
		return gpu.Metrics{}, objective.Stats{}, fmt.Errorf("cuda: update: %w", err)
	}
	if err := be.CheckObjective(opts); err != nil {
		return gpu.Metrics{}, objective.Stats{}, err
	}
	if err := adam.Validate(); err != nil {
		return gpu.Metrics{}, objective.Stats{}, err
	}
	h, err := be.tr.Stage(batch, opts)
	if err != nil {
		return gpu.Metrics{}, objective.Stats{}, untrainable(err)
	}
	if err := be.snapshot(); err != nil {
		return gpu.Metrics{}, objective.Stats{}, err
	}
	from, steps := be.tr.version, be.tr.steps
	var first gpu.Metrics
	var last objective.Stats
	for e := 0; e < max(1, epochs); e++ {
		met, err := be.tr.Step(h, opts, adam)
		if err != nil {
			return gpu.Metrics{}, objective.Stats{}, be.undo(from, steps, fmt.Errorf("epoch %d: %w", e, untrainable(err)))
		}
		if e == 0 {
			first = met
		}
		last = met.ObjectiveStats
	}
	// Kernels run asynchronously: an execution error of the last Adam
	// step is reported only by a synchronization.
	if err := be.sync(); err != nil {
		return gpu.Metrics{}, objective.Stats{}, be.undo(from, steps, err)
	}
	be.tr.version = from + 1
	first.Version = be.tr.version
	return first, last, nil
}

// untrainable makes a batch error of the device step (ErrBatch) one that
// gpu.Untrainable recognizes.
func untrainable(err error) error {
	if errors.Is(err, ErrBatch) && !errors.Is(err, gpu.ErrBatch) && !errors.Is(err, ErrDevice) {
		return fmt.Errorf("%w: %w", gpu.ErrBatch, err)
	}
	return err
}

func (be *Backend) sync() error {
	done, err := be.tr.d.Enter()
	if err != nil {
		return err
	}
	defer done()
	if err := be.tr.d.Synchronize(); err != nil {
		return devErr("synchronize", err)
	}
	return nil
}

// snapshot enqueues the copies of the parameters and moments into the
// snapshot buffers (ordered before the update's kernels on the compute
// stream).
func (be *Backend) snapshot() error {
	d := be.tr.d
	done, err := d.Enter()
	if err != nil {
		return err
	}
	defer done()
	n := int64(be.tr.cfg.NumParams())
	for _, c := range []struct {
		dst, src DevPtr
		bytes    int64
	}{{be.snap.params, be.tr.params, 4 * n}, {be.snap.m1, be.tr.m1, 8 * n}, {be.snap.m2, be.tr.m2, 8 * n}} {
		if err := d.Copy(c.dst, c.src, c.bytes); err != nil {
			return fmt.Errorf("cuda: update snapshot: %w", err)
		}
	}
	return nil
}

// undo restores the state before the update that failed with cause and
// returns cause. If the restore fails, the backend is marked lost and the
// returned error says so (and no longer wraps cause, so the failure is not
// mistaken for an untrainable batch).
func (be *Backend) undo(version, steps int64, cause error) error {
	be.tr.version, be.tr.steps = version, steps
	d := be.tr.d
	restore := func() error {
		done, err := d.Enter()
		if err != nil {
			return err
		}
		defer done()
		n := int64(be.tr.cfg.NumParams())
		for _, c := range []struct {
			dst, src DevPtr
			bytes    int64
		}{{be.tr.params, be.snap.params, 4 * n}, {be.tr.m1, be.snap.m1, 8 * n}, {be.tr.m2, be.snap.m2, 8 * n}} {
			if err := d.Copy(c.dst, c.src, c.bytes); err != nil {
				return err
			}
		}
		return d.Synchronize()
	}
	if err := restore(); err != nil {
		be.lost = fmt.Errorf("%w: the device state is lost: restoring it after a failed update (%v) failed: %w; restart from the last release", ErrDevice, cause, err)
		return be.lost
	}
	return cause
}

// Release implements gpu.Backend: the parameters are downloaded and
// published with gpu.ReleaseModel at the current version and step count.
func (be *Backend) Release(files gpu.Files, meta gpu.ReleaseMeta) (schemas.PolicyRelease, error) {
	m, err := be.Model()
	if err != nil {
		return schemas.PolicyRelease{}, fmt.Errorf("%w: %w", gpu.ErrRelease, err)
	}
	return gpu.ReleaseModel(files, m, be.tr.version, be.tr.steps, meta)
}

// Model downloads the current parameters into a model.
func (be *Backend) Model() (*model.Model, error) {
	if err := be.usable(); err != nil {
		return nil, err
	}
	p, err := be.tr.Params()
	if err != nil {
		return nil, err
	}
	return &model.Model{Config: be.tr.cfg, Params: p}, nil
}

// moments downloads the Adam moments.
func (be *Backend) moments() (m1, m2 []float64, err error) {
	d := be.tr.d
	done, err := d.Enter()
	if err != nil {
		return nil, nil, err
	}
	defer done()
	n := be.tr.cfg.NumParams()
	m1, m2 = make([]float64, n), make([]float64, n)
	if err := d.Download(unsafe.Pointer(&m1[0]), be.tr.m1, int64(8*n)); err != nil {
		return nil, nil, devErr("download moments", err)
	}
	if err := d.Download(unsafe.Pointer(&m2[0]), be.tr.m2, int64(8*n)); err != nil {
		return nil, nil, devErr("download moments", err)
	}
	return m1, m2, nil
}

// OptimState implements gpu.Backend (gpu.EncodeOptimState of the
// downloaded moments). The interface has no error result: if the download
// fails, the backend is marked lost and OptimState returns nil, so the
// next call — the train operator's Release of the same version — fails
// and the version is never published with a bad state beside it.
func (be *Backend) OptimState() []byte {
	if be.usable() != nil {
		return nil
	}
	m1, m2, err := be.moments()
	if err != nil {
		be.lost = fmt.Errorf("%w: the optimizer state could not be read: %w", ErrDevice, err)
		return nil
	}
	return gpu.EncodeOptimState(be.tr.steps, m1, m2)
}

// SetOptimState implements gpu.Backend: b (gpu.EncodeOptimState, as the
// CPU trainer writes it) is checked, then its moments are uploaded and its
// step count restored. A failed upload marks the backend lost.
func (be *Backend) SetOptimState(b []byte) error {
	if err := be.usable(); err != nil {
		return err
	}
	n := be.tr.cfg.NumParams()
	m1, m2 := make([]float64, n), make([]float64, n)
	steps, err := gpu.DecodeOptimState(b, m1, m2)
	if err != nil {
		return err
	}
	d := be.tr.d
	done, err := d.Enter()
	if err != nil {
		return err
	}
	defer done()
	if err := d.Upload(be.tr.m1, unsafe.Pointer(&m1[0]), int64(8*n)); err != nil {
		be.lost = fmt.Errorf("%w: restoring the optimizer state: %w", ErrDevice, err)
		return be.lost
	}
	if err := d.Upload(be.tr.m2, unsafe.Pointer(&m2[0]), int64(8*n)); err != nil {
		be.lost = fmt.Errorf("%w: restoring the optimizer state: %w", ErrDevice, err)
		return be.lost
	}
	be.tr.steps = steps
	return nil
}

// Close implements gpu.Backend: it frees the trainer's and the snapshot's
// device memory and closes the device if the backend opened it. A second
// Close does nothing.
func (be *Backend) Close() error {
	if be.closed {
		return nil
	}
	be.closed = true
	errs := []error{be.tr.Close()} // synchronizes first
	if done, err := be.tr.d.Enter(); err != nil {
		errs = append(errs, err)
	} else {
		be.freeSnap()
		done()
	}
	if be.closeDev != nil {
		errs = append(errs, be.closeDev())
	}
	return errors.Join(errs...)
}
