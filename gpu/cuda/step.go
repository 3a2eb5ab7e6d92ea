package cuda

import (
	"fmt"
	"math"
	"strings"
	"unsafe"

	"github.com/apache/arrow-go/v18/arrow"
	"gonum.org/v1/gonum/blas"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

// DevPtr is a device address.
type DevPtr uintptr

// backend is what the device step needs from a GPU: memory, copies, kernel
// launches, matrix products, and the staging Engine. *Device implements it
// with the CUDA driver and cuBLAS (build tag cuda); the tests implement it
// with a CPU emulation of every kernel (emu_test.go), so the orchestration
// below — buffer offsets, matrix-product conventions, the chunk loops,
// kernel argument lists — is exercised without a GPU.
//
// All operations but Alloc, Free, Upload and Download are asynchronous on
// the compute stream; Download waits for the compute stream.
type backend interface {
	Engine
	// Enter makes the device usable from the calling goroutine until the
	// returned function is called.
	Enter() (func(), error)
	Alloc(bytes int64) (DevPtr, error)
	Free(p DevPtr)
	Upload(dst DevPtr, src unsafe.Pointer, bytes int64) error
	Download(dst unsafe.Pointer, src DevPtr, bytes int64) error
	Zero(p DevPtr, bytes int64) error
	// Copy copies bytes from src to dst on the device, on the compute
	// stream (ordered with the kernels).
	Copy(dst, src DevPtr, bytes int64) error
	Synchronize() error
	// Launch runs a kernel of kernels/trajflow.cu with a 1-D grid; args
	// are DevPtr, int (C int), int64 (long long), float32 or float64.
	Launch(name string, grid, block int, args ...any) error
	// Gemm is column-major C = A·B (op per tA, tB) + beta·C with alpha 1
	// (cublasSgemm).
	Gemm(tA, tB blas.Transpose, m, n, k int, a DevPtr, lda int, b DevPtr, ldb int, beta float32, c DevPtr, ldc int) error
	// SlotPtr is the device address of a staging slot's buffer.
	SlotPtr(slot int) DevPtr
	// ComputeWaitCopied makes the compute stream wait for copied(slot);
	// RecordComputed records computed(slot) on it.
	ComputeWaitCopied(slot int) error
	RecordComputed(slot int) error
}

// TrainerOptions tune the device step.
type TrainerOptions struct {
	// ChunkVocab is the vocabulary chunk of the log-prob gather and of the
	// output layer's backward pass: only a [T][ChunkVocab] logits buffer
	// exists at any time. 0 means min(Vocab, 8192).
	ChunkVocab int
	// Capacity is the growth policy of staging and activation buffers.
	Capacity Capacity
}

// Trainer is the device counterpart of gpu.Trainer: the parameters, the
// gradient and the Adam moments (float64, as the CPU reference) live on
// the GPU. Use Stage to pack and start copying a batch, Step to update on
// a staged batch; staging batch k+1 before stepping batch k overlaps its
// copy with batch k's compute (double buffering):
//
//	h, _ := t.Stage(b0, opts)
//	for k := range batches {
//		next, _ := t.Stage(batches[k+1], opts) // copy runs during Step(h)
//		met, _ := t.Step(h, opts, adam)
//		h = next
//	}
//
// The staging slots belong to the backend (the Device): one Device serves
// one Trainer at a time. Not safe for concurrent use.
type Trainer struct {
	d        backend
	cfg      model.Config
	beh      model.Behavior
	version  int64
	steps    int64
	chunk    int
	capacity Capacity
	ring     *Ring
	gen      int64
	slotGen  [Slots]int64

	params, grad, m1, m2, partial DevPtr
	nParts                        int

	capT int
	act  struct {
		X, H, dH, dX, Z                      DevPtr
		m, s, a, zy, lp, ratio, sur, kl, ent DevPtr
		flags, lse, gw                       DevPtr
	}
	out    TokenOut
	partsH []float64
}

// Handle is a batch staged by Trainer.Stage.
type Handle struct {
	slot int
	gen  int64
	st   *Staged
}

// Supported reports whether the device step implements behavior b for a
// vocabulary of V tokens: it implements temperature-only behaviors. A
// grammar, top-k (below V), top-p (below 1) or min-p (above 0) is
// ErrUnsupported, naming the learning-contract fields that ask for it.
func Supported(b model.Behavior, V int) error {
	var what []string
	if b.Grammar != nil {
		what = append(what, fmt.Sprintf("a constrained-decoding grammar (%s, the tasks' structured-output grammar of artifacts.tool_schemas)", b.Grammar.ID()))
	}
	if b.TopK > 0 && b.TopK < V {
		what = append(what, fmt.Sprintf("sampler.top_k %d", b.TopK))
	}
	if b.TopP > 0 && b.TopP < 1 {
		what = append(what, fmt.Sprintf("sampler.top_p %g", b.TopP))
	}
	if b.MinP > 0 {
		what = append(what, fmt.Sprintf("sampler.min_p %g", b.MinP))
	}
	if len(what) == 0 {
		return nil
	}
	return fmt.Errorf("%w: the CUDA trainer implements temperature-only behaviors (sampler.temperature; sampler.top_k 0, sampler.top_p 1, sampler.min_p 0, no grammar); this behavior has %s: train it on the CPU (--device cpu)",
		ErrUnsupported, strings.Join(what, ", "))
}

// newTrainer uploads m's parameters to d and starts training at version.
// The behavior must be a pure temperature (Supported).
func newTrainer(d backend, m *model.Model, b model.Behavior, version int64, o TrainerOptions) (*Trainer, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	if err := b.Validate(); err != nil {
		return nil, err
	}
	V := m.Config.Vocab
	if err := Supported(b, V); err != nil {
		return nil, err
	}
	if o.ChunkVocab <= 0 {
		o.ChunkVocab = min(V, 8192)
	}
	if o.Capacity.Quantum == 0 {
		o.Capacity = DefaultCapacity()
	}
	t := &Trainer{d: d, cfg: m.Config, beh: b, version: version, chunk: min(o.ChunkVocab, V), capacity: o.Capacity}
	t.ring = NewRing(d, V, o.Capacity)
	done, err := d.Enter()
	if err != nil {
		return nil, err
	}
	defer done()
	n := int64(m.Config.NumParams())
	alloc := func(p *DevPtr, bytes int64) {
		if err == nil {
			*p, err = d.Alloc(bytes)
		}
	}
	t.nParts = 1024
	alloc(&t.params, 4*n)
	alloc(&t.grad, 4*n)
	alloc(&t.m1, 8*n)
	alloc(&t.m2, 8*n)
	alloc(&t.partial, 8*int64(t.nParts))
	fail := func(what string, err error) (*Trainer, error) {
		t.free()
		return nil, devErr(what, err)
	}
	if err != nil {
		return fail("alloc parameters", err)
	}
	if err := d.Upload(t.params, unsafe.Pointer(&m.Params[0]), 4*n); err != nil {
		return fail("upload parameters", err)
	}
	if err := d.Zero(t.m1, 8*n); err != nil {
		return fail("zero moments", err)
	}
	if err := d.Zero(t.m2, 8*n); err != nil {
		return fail("zero moments", err)
	}
	t.partsH = make([]float64, t.nParts)
	return t, nil
}

// Close frees the trainer's device memory (parameters, gradient, moments,
// activations). The Device stays open.
func (t *Trainer) Close() error {
	done, err := t.d.Enter()
	if err != nil {
		return err
	}
	defer done()
	serr := t.d.Synchronize()
	t.free()
	return serr
}

// free frees every device buffer of the trainer (the caller has entered
// the device).
func (t *Trainer) free() {
	a := &t.act
	for _, p := range []*DevPtr{&t.params, &t.grad, &t.m1, &t.m2, &t.partial, &a.X, &a.H, &a.dH, &a.dX, &a.Z,
		&a.m, &a.s, &a.a, &a.zy, &a.lp, &a.ratio, &a.sur, &a.kl, &a.ent, &a.flags, &a.lse, &a.gw} {
		if *p != 0 {
			t.d.Free(*p)
			*p = 0
		}
	}
	t.capT = 0
}

// Version is the current policy version.
func (t *Trainer) Version() int64 { return t.version }

// Steps is the number of optimizer steps taken.
func (t *Trainer) Steps() int64 { return t.steps }

// Params downloads the current parameters.
func (t *Trainer) Params() ([]float32, error) {
	done, err := t.d.Enter()
	if err != nil {
		return nil, err
	}
	defer done()
	p := make([]float32, t.cfg.NumParams())
	if err := t.d.Download(unsafe.Pointer(&p[0]), t.params, int64(4*len(p))); err != nil {
		return nil, devErr("download parameters", err)
	}
	return p, nil
}

// Stage packs batch into the next staging slot and starts its asynchronous
// copy to the device. The handle is valid until Slots further Stage calls.
func (t *Trainer) Stage(batch schemas.PackedBatch, opts objective.Options) (Handle, error) {
	slot, st, err := t.ring.Put(batch, opts)
	if err != nil {
		return Handle{}, err
	}
	t.gen++
	t.slotGen[slot] = t.gen
	return Handle{slot: slot, gen: t.gen, st: st}, nil
}

// StageArrow is Stage reading an Arrow packed-batch record
// (schemas.PackedBatches.ToRecord or a decoded IPC stream) directly into
// the pinned buffer. rec is not retained.
func (t *Trainer) StageArrow(rec arrow.RecordBatch, opts objective.Options) (Handle, error) {
	slot, st, err := t.ring.PutRecord(rec, opts)
	if err != nil {
		return Handle{}, err
	}
	t.gen++
	t.slotGen[slot] = t.gen
	return Handle{slot: slot, gen: t.gen, st: st}, nil
}

// offsets of the parameter views in the flat vector (model.Config.ViewsOf).
func (t *Trainer) offsets() (emb, w1, b1, w2, b2 int64) {
	c := t.cfg
	emb = 0
	w1 = emb + int64(c.Vocab*c.Embed)
	b1 = w1 + int64(c.Hidden*c.In())
	w2 = b1 + int64(c.Hidden)
	b2 = w2 + int64(c.Vocab*c.Hidden)
	return
}

func (t *Trainer) ensureActivations(T int) error {
	if T <= t.capT {
		return nil
	}
	newT, _ := Capacity{Quantum: 1024, Factor: t.capacity.Factor}.Grow(t.capT, T)
	if err := t.d.Synchronize(); err != nil {
		return devErr("synchronize", err)
	}
	a := &t.act
	all := []*DevPtr{&a.X, &a.H, &a.dH, &a.dX, &a.Z, &a.m, &a.s, &a.a, &a.zy, &a.lp, &a.ratio, &a.sur, &a.kl, &a.ent, &a.flags, &a.lse, &a.gw}
	for _, p := range all {
		if *p != 0 {
			t.d.Free(*p)
			*p = 0
		}
	}
	c := t.cfg
	sizes := []int64{int64(c.In()), int64(c.Hidden), int64(c.Hidden), int64(c.In()), int64(t.chunk)}
	for i, p := range all {
		w := int64(2) // per-position outputs: up to 8 bytes each
		if i < len(sizes) {
			w = sizes[i]
		}
		var err error
		if *p, err = t.d.Alloc(4 * w * int64(newT)); err != nil {
			return devErr("alloc activations", err)
		}
	}
	t.capT = newT
	return nil
}

func (t *Trainer) gemm(tA, tB blas.Transpose, m, n, k int, a DevPtr, lda int, b DevPtr, ldb int, beta float32, c DevPtr, ldc int) error {
	return t.d.Gemm(tA, tB, m, n, k, a, lda, b, ldb, beta, c, ldc)
}

// Step performs one update on the staged batch h, with the semantics of
// gpu.Trainer.Step (docs/PIPELINE.md §12–§14): global denominators, behavior
// log-probs of the current model on the stored tokens, the objective and
// its gradient, global gradient-norm clipping, Adam, version + 1. On error
// the parameters and optimizer state are unchanged.
func (t *Trainer) Step(h Handle, opts objective.Options, adam gpu.AdamOptions) (gpu.Metrics, error) {
	if err := opts.Validate(); err != nil {
		return gpu.Metrics{}, fmt.Errorf("cuda: step: %w", err)
	}
	if err := adam.Validate(); err != nil {
		return gpu.Metrics{}, err
	}
	if h.st == nil || t.slotGen[h.slot] != h.gen {
		return gpu.Metrics{}, fmt.Errorf("%w: stale or empty batch handle", ErrBatch)
	}
	st := h.st
	d := t.d
	done, err := d.Enter()
	if err != nil {
		return gpu.Metrics{}, err
	}
	defer done()
	T := st.Layout.T
	if err := t.ensureActivations(T); err != nil {
		return gpu.Metrics{}, err
	}
	c := t.cfg
	V, W, E, H, In := c.Vocab, c.Window, c.Embed, c.Hidden, c.In()
	if err := d.ComputeWaitCopied(h.slot); err != nil {
		return gpu.Metrics{}, devErr("wait copy", err)
	}
	base := d.SlotPtr(h.slot)
	col := func(cl Column) DevPtr { return base + DevPtr(st.Layout.Offset[cl]) }
	tok, pos, tgt := col(ColTokens), col(ColPositions), col(ColTargets)
	w, old, ref, adv, mask := col(ColWeights), col(ColOld), col(ColRef), col(ColAdv), col(ColMask)
	oEmb, oW1, oB1, oW2, oB2 := t.offsets()
	P := func(off int64) DevPtr { return t.params + DevPtr(4*off) }
	G := func(off int64) DevPtr { return t.grad + DevPtr(4*off) }
	a := &t.act
	temp := float32(t.beh.Temperature)
	alpha := float32(opts.EntropyCoef)
	rowsGrid := min(T, 65535)
	var ferr error
	run := func(err error) {
		if ferr == nil {
			ferr = err
		}
	}
	// Forward to the hidden layer.
	run(d.Launch("tf_gather_x", gridFor(int64(T*In)), blockSize, tok, pos, P(oEmb), a.X, T, W, E))
	run(t.gemm(blas.Trans, blas.NoTrans, H, T, In, P(oW1), In, a.X, In, 0, a.H, H))
	run(d.Launch("tf_bias_tanh", gridFor(int64(T*H)), blockSize, a.H, P(oB1), T, H))
	// Log-sum-exp over vocabulary chunks.
	run(d.Launch("tf_lse_init", gridFor(int64(T)), blockSize, a.m, a.s, a.a, a.zy, T))
	for v0 := 0; v0 < V; v0 += t.chunk {
		C := min(t.chunk, V-v0)
		run(t.gemm(blas.Trans, blas.NoTrans, C, T, H, P(oW2+int64(v0*H)), H, a.H, H, 0, a.Z, C))
		run(d.Launch("tf_lse_chunk", rowsGrid, blockSize, a.Z, int64(C), P(oB2), v0, C, temp, tgt, a.m, a.s, a.a, a.zy, T))
	}
	klMode, klCoef := 0, 0.0
	if st.HasRef {
		switch opts.KLEstimator {
		case objective.K1:
			klMode = 1
		case objective.K2:
			klMode = 2
		case objective.K3:
			klMode = 3
		}
	}
	if opts.KLPlacement == objective.KLLoss {
		klCoef = opts.KLCoef
	}
	run(d.Launch("tf_token_loss", gridFor(int64(T)), blockSize, tgt, mask, w, old, ref, adv, a.m, a.s, a.a, a.zy, T,
		opts.ClipLow, opts.ClipHigh, opts.MaxLogRatio, klMode, klCoef,
		a.lp, a.ratio, a.sur, a.kl, a.ent, a.flags, a.lse, a.gw))
	// Backward: output layer chunk by chunk (logits recomputed, never stored whole).
	n := int64(c.NumParams())
	if err := d.Zero(t.grad, 4*n); err != nil {
		run(devErr("zero gradient", err))
	}
	for v0 := 0; v0 < V; v0 += t.chunk {
		C := min(t.chunk, V-v0)
		run(t.gemm(blas.Trans, blas.NoTrans, C, T, H, P(oW2+int64(v0*H)), H, a.H, H, 0, a.Z, C))
		run(d.Launch("tf_dz_chunk", gridFor(int64(T*C)), blockSize, a.Z, int64(C), P(oB2), v0, C, temp, tgt, w, a.gw, a.lse, a.ent, alpha, T))
		run(d.Launch("tf_colsum", gridFor(int64(C)), blockSize, a.Z, T, C, int64(C), G(oB2+int64(v0)), 0))
		run(t.gemm(blas.NoTrans, blas.Trans, H, C, T, a.H, H, a.Z, C, 1, G(oW2+int64(v0*H)), H))
		beta := float32(1)
		if v0 == 0 {
			beta = 0
		}
		run(t.gemm(blas.NoTrans, blas.NoTrans, H, T, C, P(oW2+int64(v0*H)), H, a.Z, C, beta, a.dH, H))
	}
	run(d.Launch("tf_tanh_back", gridFor(int64(T*H)), blockSize, a.dH, a.H, int64(T*H)))
	run(d.Launch("tf_colsum", gridFor(int64(H)), blockSize, a.dH, T, H, int64(H), G(oB1), 0))
	run(t.gemm(blas.NoTrans, blas.Trans, In, H, T, a.X, In, a.dH, H, 1, G(oW1), In))
	run(t.gemm(blas.NoTrans, blas.NoTrans, In, T, H, P(oW1), In, a.dH, H, 0, a.dX, In))
	run(d.Launch("tf_emb_scatter", gridFor(int64(T*In)), blockSize, a.dX, tok, pos, G(oEmb), T, W, E))
	if err := d.RecordComputed(h.slot); err != nil {
		run(devErr("record compute", err))
	}
	parts := min(t.nParts, gridFor(n))
	run(d.Launch("tf_sumsq", parts, blockSize, t.grad, n, t.partial))
	if ferr != nil {
		return gpu.Metrics{}, ferr
	}
	// Host side: gradient norm, statistics (synchronizes with the stream).
	if err := d.Download(unsafe.Pointer(&t.partsH[0]), t.partial, int64(8*parts)); err != nil {
		return gpu.Metrics{}, devErr("download norm", err)
	}
	t.out.Resize(T)
	for _, x := range []struct {
		dst  unsafe.Pointer
		src  DevPtr
		size int
	}{{unsafe.Pointer(&t.out.Logprob[0]), a.lp, 4}, {unsafe.Pointer(&t.out.Ratio[0]), a.ratio, 8},
		{unsafe.Pointer(&t.out.Surrogate[0]), a.sur, 8}, {unsafe.Pointer(&t.out.KL[0]), a.kl, 8},
		{unsafe.Pointer(&t.out.Entropy[0]), a.ent, 8}, {unsafe.Pointer(&t.out.Flags[0]), a.flags, 4}} {
		if err := d.Download(x.dst, x.src, int64(x.size*T)); err != nil {
			return gpu.Metrics{}, devErr("download token outputs", err)
		}
	}
	buf := d.Host(h.slot)
	stats, err := ReduceStats(&t.out, st, buf, opts)
	if err != nil {
		return gpu.Metrics{}, err
	}
	met := gpu.Metrics{ObjectiveStats: stats, Rows: len(st.RowStart) - 1, Segments: st.Segments, InputTokens: int64(T), FromVersion: t.version}
	var lags [][]objective.LagStat
	oldH, maskH := st.Layout.Float32s(buf, ColOld), st.Layout.ColumnBytes(buf, ColMask)
	for r := 0; r+1 < len(st.RowStart); r++ {
		s, e := st.RowStart[r], st.RowStart[r+1]
		ls, err := objective.LagStats(t.out.Logprob[s:e], oldH[s:e], st.Versions[s:e], maskH[s:e], t.version)
		if err != nil {
			return gpu.Metrics{}, fmt.Errorf("cuda: row %d: %w", r, err)
		}
		lags = append(lags, ls)
	}
	met.Lag = objective.MergeLagStats(lags...)
	var sq float64
	for _, p := range t.partsH[:parts] {
		sq += p
	}
	met.GradNorm = math.Sqrt(sq)
	if math.IsNaN(met.GradNorm) || math.IsInf(met.GradNorm, 0) {
		return gpu.Metrics{}, fmt.Errorf("%w: gradient norm %v", ErrBatch, met.GradNorm)
	}
	met.GradScale = 1
	if adam.MaxGradNorm > 0 && met.GradNorm > adam.MaxGradNorm {
		met.GradScale = adam.MaxGradNorm / met.GradNorm
	}
	t.steps++
	c1 := 1 - math.Pow(adam.Beta1, float64(t.steps))
	c2 := 1 - math.Pow(adam.Beta2, float64(t.steps))
	if err := d.Launch("tf_adam", gridFor(n), blockSize, t.params, t.grad, t.m1, t.m2, n, met.GradScale,
		adam.Beta1, adam.Beta2, c1, c2, adam.LR, adam.Eps, adam.WeightDecay); err != nil {
		t.steps--
		return gpu.Metrics{}, err
	}
	t.version++
	met.Version = t.version
	return met, nil
}

func devErr(what string, err error) error { return fmt.Errorf("%w: %s: %w", ErrDevice, what, err) }

// gridFor is a grid-stride launch size for n elements.
func gridFor(n int64) int {
	g := (n + blockSize - 1) / blockSize
	if g > 65535 {
		g = 65535
	}
	if g < 1 {
		g = 1
	}
	return int(g)
}

const blockSize = 256 // TF_BLOCK in kernels/trajflow.cu

// kernelNames are the kernels of kernels/trajflow.cu the device step loads.
var kernelNames = []string{"tf_gather_x", "tf_bias_tanh", "tf_lse_init", "tf_lse_chunk", "tf_token_loss",
	"tf_dz_chunk", "tf_colsum", "tf_tanh_back", "tf_emb_scatter", "tf_sumsq", "tf_adam"}
