//go:build cuda

package cuda

/*
#cgo LDFLAGS: -lcuda
#include <cuda.h>

static CUresult tf_host_alloc(void **p, size_t n) { return cuMemHostAlloc(p, n, CU_MEMHOSTALLOC_PORTABLE); }
*/
import "C"

import (
	_ "embed"
	"fmt"
	"os"
	"runtime"
	"unsafe"

	"gorgonia.org/cu"
	cublas "gorgonia.org/cu/blas"
)

// embeddedPTX is kernels/trajflow.ptx, generated from kernels/trajflow.cu
// by `make cuda-ptx` (target compute_80, so it JIT-compiles on sm_80 and
// newer, the H200's sm_90 included).
//
//go:embed kernels/trajflow.ptx
var embeddedPTX string

// PTXEnv names a PTX file that replaces the embedded kernels (for example
// one compiled with nvcc on the GPU machine by gpu/devicecheck.sh).
const PTXEnv = "TRAJFLOW_CUDA_PTX"

var kernelNames = []string{"tf_gather_x", "tf_bias_tanh", "tf_lse_init", "tf_lse_chunk", "tf_token_loss",
	"tf_dz_chunk", "tf_colsum", "tf_tanh_back", "tf_emb_scatter", "tf_sumsq", "tf_adam"}

// Device is one GPU with its primary context, the kernels module, a cuBLAS
// handle, and the double-buffered staging slots (it implements Engine).
//
// Streams. Kernels and cuBLAS run on the legacy default stream (the cuBLAS
// binding has no stream setter); host-to-device copies run on a
// non-blocking copy stream, which does not synchronize with the default
// stream, so the copy of batch k+1 overlaps the compute of batch k. Events
// order the two: the compute waits for copied(slot), the copy into a slot
// waits for computed(slot).
//
// CUDA contexts are current per OS thread: every method locks the calling
// goroutine to its thread and makes the context current. A Device is not
// safe for concurrent use.
type Device struct {
	dev      cu.Device
	ctx      cu.CUContext
	mod      cu.Module
	fn       map[string]cu.Function
	blas     *cublas.Standard
	copy     cu.Stream
	host     [Slots]unsafe.Pointer
	hostN    [Slots]int
	dbuf     [Slots]cu.DevicePtr
	copied   [Slots]cu.Event
	computed [Slots]cu.Event
	PTXFrom  string // "embedded" or the file named by PTXEnv
}

func devErr(what string, err error) error { return fmt.Errorf("%w: %s: %w", ErrDevice, what, err) }

// enter locks the goroutine to its thread and makes the context current;
// the returned func undoes the lock.
func (d *Device) enter() (func(), error) {
	runtime.LockOSThread()
	if err := cu.SetCurrentContext(d.ctx); err != nil {
		runtime.UnlockOSThread()
		return nil, devErr("set context", err)
	}
	return runtime.UnlockOSThread, nil
}

// OpenDevice initializes the driver, retains the primary context of GPU
// ordinal, loads the kernels (the PTX file named by $TRAJFLOW_CUDA_PTX, or
// the embedded PTX), and creates the cuBLAS handle, copy stream and events.
func OpenDevice(ordinal int) (*Device, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := result(C.cuInit(0)); err != nil {
		return nil, devErr("cuInit", err)
	}
	dev, err := cu.GetDevice(ordinal)
	if err != nil {
		return nil, devErr("get device", err)
	}
	ctx, err := dev.RetainPrimaryCtx()
	if err != nil {
		return nil, devErr("retain primary context", err)
	}
	if err := cu.SetCurrentContext(ctx); err != nil {
		return nil, devErr("set context", err)
	}
	d := &Device{dev: dev, ctx: ctx, fn: map[string]cu.Function{}, PTXFrom: "embedded"}
	ptx := embeddedPTX
	if p := os.Getenv(PTXEnv); p != "" {
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrDevice, PTXEnv, err)
		}
		ptx, d.PTXFrom = string(b), p
	}
	if d.mod, err = cu.LoadData(ptx); err != nil {
		return nil, devErr("load PTX ("+d.PTXFrom+")", err)
	}
	for _, n := range kernelNames {
		f, err := d.mod.Function(n)
		if err != nil {
			return nil, devErr("kernel "+n, err)
		}
		d.fn[n] = f
	}
	d.blas = cublas.New()
	if d.copy, err = cu.MakeStream(cu.NonBlocking); err != nil {
		return nil, devErr("copy stream", err)
	}
	for s := 0; s < Slots; s++ {
		if d.copied[s], err = cu.MakeEvent(cu.DisableTiming); err != nil {
			return nil, devErr("event", err)
		}
		if d.computed[s], err = cu.MakeEvent(cu.DisableTiming); err != nil {
			return nil, devErr("event", err)
		}
	}
	return d, nil
}

func result(r C.CUresult) error {
	if r == C.CUDA_SUCCESS {
		return nil
	}
	return fmt.Errorf("CUresult %d", int(r))
}

// Name is the device name.
func (d *Device) Name() string {
	n, err := d.dev.Name()
	if err != nil {
		return "unknown"
	}
	return n
}

// Close frees the staging buffers, the module and the cuBLAS handle and
// releases the primary context.
func (d *Device) Close() error {
	done, err := d.enter()
	if err != nil {
		return err
	}
	defer done()
	_ = cu.Synchronize()
	for s := 0; s < Slots; s++ {
		if d.host[s] != nil {
			_ = cu.MemFreeHost(d.host[s])
		}
		if d.dbuf[s] != 0 {
			_ = cu.MemFree(d.dbuf[s])
		}
		_ = cu.DestroyEvent(&d.copied[s])
		_ = cu.DestroyEvent(&d.computed[s])
	}
	_ = d.copy.Destroy()
	_ = d.blas.Close()
	_ = d.mod.Unload()
	return d.dev.ReleasePrimaryCtx()
}

// Ensure implements Engine: it reallocates slot's pinned host buffer and
// device buffer to n bytes after the slot's copy and compute completed.
func (d *Device) Ensure(slot, n int) error {
	done, err := d.enter()
	if err != nil {
		return err
	}
	defer done()
	if n <= d.hostN[slot] {
		return nil
	}
	if err := d.copied[slot].Synchronize(); err != nil {
		return devErr("wait copy", err)
	}
	if err := d.computed[slot].Synchronize(); err != nil {
		return devErr("wait compute", err)
	}
	if d.host[slot] != nil {
		_ = cu.MemFreeHost(d.host[slot])
		d.host[slot], d.hostN[slot] = nil, 0
	}
	if d.dbuf[slot] != 0 {
		_ = cu.MemFree(d.dbuf[slot])
		d.dbuf[slot] = 0
	}
	var p unsafe.Pointer
	if err := result(C.tf_host_alloc(&p, C.size_t(n))); err != nil {
		return devErr("pinned alloc", err)
	}
	dp, err := cu.MemAlloc(int64(n))
	if err != nil {
		_ = cu.MemFreeHost(p)
		return devErr("device alloc", err)
	}
	d.host[slot], d.hostN[slot], d.dbuf[slot] = p, n, dp
	return nil
}

// Host implements Engine.
func (d *Device) Host(slot int) []byte {
	if d.host[slot] == nil {
		return nil
	}
	return unsafe.Slice((*byte)(d.host[slot]), d.hostN[slot])
}

// WaitCopied implements Engine.
func (d *Device) WaitCopied(slot int) error {
	done, err := d.enter()
	if err != nil {
		return err
	}
	defer done()
	if err := d.copied[slot].Synchronize(); err != nil {
		return devErr("wait copy", err)
	}
	return nil
}

// CopyAsync implements Engine.
func (d *Device) CopyAsync(slot, n int) error {
	done, err := d.enter()
	if err != nil {
		return err
	}
	defer done()
	if err := d.copy.Wait(d.computed[slot], 0); err != nil {
		return devErr("copy stream wait", err)
	}
	if err := cu.MemcpyHtoDAsync(d.dbuf[slot], d.host[slot], int64(n), d.copy); err != nil {
		return devErr("H2D copy", err)
	}
	if err := d.copied[slot].Record(d.copy); err != nil {
		return devErr("record copy", err)
	}
	return nil
}

// SlotPtr is the device address of slot's staging buffer.
func (d *Device) SlotPtr(slot int) cu.DevicePtr { return d.dbuf[slot] }

// launch runs kernel name on the default stream with a 1-D grid. Every
// argument is passed in its own 8-byte slot (the binding copies 8 bytes
// per argument; the kernel reads the width it declares).
func (d *Device) launch(name string, grid, block int, args ...any) error {
	slots := make([]uint64, len(args))
	ptrs := make([]unsafe.Pointer, len(args))
	for i, a := range args {
		switch v := a.(type) {
		case cu.DevicePtr:
			slots[i] = uint64(v)
		case int:
			*(*int32)(unsafe.Pointer(&slots[i])) = int32(v)
		case int64:
			slots[i] = uint64(v)
		case float32:
			*(*float32)(unsafe.Pointer(&slots[i])) = v
		case float64:
			*(*float64)(unsafe.Pointer(&slots[i])) = v
		default:
			panic(fmt.Sprintf("cuda: kernel argument %T", a))
		}
		ptrs[i] = unsafe.Pointer(&slots[i])
	}
	if grid < 1 {
		grid = 1
	}
	if err := d.fn[name].Launch(grid, 1, 1, block, 1, 1, 0, cu.Stream{}, ptrs); err != nil {
		return devErr(name, err)
	}
	return nil
}

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

// floats views n float32 values at device address p as a slice for the
// cuBLAS binding, which takes slices and passes &s[0] to cuBLAS. The slice
// must never be read or written from Go.
func floats(p cu.DevicePtr, n int) []float32 {
	return unsafe.Slice((*float32)(*(*unsafe.Pointer)(unsafe.Pointer(&p))), n)
}
