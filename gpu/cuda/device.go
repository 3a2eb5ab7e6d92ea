//go:build cuda

package cuda

/*
#cgo LDFLAGS: -lcuda
#include <cuda.h>

static CUresult tf_host_alloc(void **p, size_t n) { return cuMemHostAlloc(p, n, CU_MEMHOSTALLOC_PORTABLE); }
*/
import "C"

import (
	"bytes"
	_ "embed"
	"fmt"
	"os"
	"runtime"
	"unsafe"

	"gonum.org/v1/gonum/blas"
	"gorgonia.org/cu"
	cublas "gorgonia.org/cu/blas"

	"github.com/trajflow/trajflow/gpu/model"
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

// Enter implements backend: it locks the goroutine to its thread and makes the context current;
// the returned func undoes the lock.
func (d *Device) Enter() (func(), error) {
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
		// Load again only to obtain the JIT compiler's error log.
		logBuf := &cu.JITErrorLogBuffer{Buffer: make([]byte, 16<<10)}
		if _, err2 := cu.LoadDataEx(ptx, logBuf); err2 != nil {
			if n := bytes.IndexByte(logBuf.Buffer, 0); n > 0 {
				err = fmt.Errorf("%w; JIT log: %s", err, logBuf.Buffer[:n])
			}
		}
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
	done, err := d.Enter()
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
	done, err := d.Enter()
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
	done, err := d.Enter()
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
	done, err := d.Enter()
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

// SlotPtr implements backend.
func (d *Device) SlotPtr(slot int) DevPtr { return DevPtr(d.dbuf[slot]) }

// ComputeWaitCopied implements backend.
func (d *Device) ComputeWaitCopied(slot int) error {
	if err := (cu.Stream{}).Wait(d.copied[slot], 0); err != nil {
		return devErr("wait copy", err)
	}
	return nil
}

// RecordComputed implements backend.
func (d *Device) RecordComputed(slot int) error {
	if err := d.computed[slot].Record(cu.Stream{}); err != nil {
		return devErr("record compute", err)
	}
	return nil
}

// Alloc implements backend.
func (d *Device) Alloc(bytes int64) (DevPtr, error) {
	p, err := cu.MemAlloc(bytes)
	if err != nil {
		return 0, devErr("alloc", err)
	}
	return DevPtr(p), nil
}

// Free implements backend.
func (d *Device) Free(p DevPtr) { _ = cu.MemFree(cu.DevicePtr(p)) }

// Upload implements backend (synchronous).
func (d *Device) Upload(dst DevPtr, src unsafe.Pointer, bytes int64) error {
	if err := cu.MemcpyHtoD(cu.DevicePtr(dst), src, bytes); err != nil {
		return devErr("upload", err)
	}
	return nil
}

// Download implements backend: it waits for the compute stream.
func (d *Device) Download(dst unsafe.Pointer, src DevPtr, bytes int64) error {
	if err := cu.MemcpyDtoH(dst, cu.DevicePtr(src), bytes); err != nil {
		return devErr("download", err)
	}
	return nil
}

// Zero implements backend (bytes must be a multiple of 4).
func (d *Device) Zero(p DevPtr, bytes int64) error {
	if err := cu.MemsetD32Async(cu.DevicePtr(p), 0, bytes/4, cu.Stream{}); err != nil {
		return devErr("memset", err)
	}
	return nil
}

// Copy implements backend: a device-to-device copy on the default stream.
func (d *Device) Copy(dst, src DevPtr, bytes int64) error {
	if err := cu.MemcpyDtoDAsync(cu.DevicePtr(dst), cu.DevicePtr(src), bytes, cu.Stream{}); err != nil {
		return devErr("device copy", err)
	}
	return nil
}

// Synchronize implements backend.
func (d *Device) Synchronize() error {
	if err := cu.Synchronize(); err != nil {
		return devErr("synchronize", err)
	}
	return nil
}

// Gemm implements backend with cublasSgemm (column-major; the slices
// handed to the binding only carry device addresses).
func (d *Device) Gemm(tA, tB blas.Transpose, m, n, k int, a DevPtr, lda int, b DevPtr, ldb int, beta float32, c DevPtr, ldc int) error {
	d.blas.Sgemm(tA, tB, m, n, k, 1, floats(a, 1), lda, floats(b, 1), ldb, beta, floats(c, 1), ldc)
	if err := d.blas.Err(); err != nil {
		return devErr("cublasSgemm", err)
	}
	return nil
}

// NewTrainer uploads m's parameters to d and starts training at version.
// The behavior must be a pure temperature (no grammar, top-k or top-p:
// ErrUnsupported).
func NewTrainer(d *Device, m *model.Model, b model.Behavior, version int64, o TrainerOptions) (*Trainer, error) {
	return newTrainer(d, m, b, version, o)
}

// Launch implements backend: it runs kernel name on the default stream with a 1-D grid. Every
// argument is passed in its own 8-byte slot (the binding copies 8 bytes
// per argument; the kernel reads the width it declares).
func (d *Device) Launch(name string, grid, block int, args ...any) error {
	slots := make([]uint64, len(args))
	ptrs := make([]unsafe.Pointer, len(args))
	for i, a := range args {
		switch v := a.(type) {
		case DevPtr:
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

// floats views n float32 values at device address p as a slice for the
// cuBLAS binding, which takes slices and passes &s[0] to cuBLAS. The slice
// must never be read or written from Go.
func floats(p DevPtr, n int) []float32 {
	return unsafe.Slice((*float32)(*(*unsafe.Pointer)(unsafe.Pointer(&p))), n)
}
