//go:build cuda

package cuda

import (
	"testing"
)

func openDevice(t testing.TB) *Device {
	t.Helper()
	d, err := OpenDevice(0)
	if err != nil {
		t.Fatalf("open CUDA device 0: %v", err)
	}
	t.Cleanup(func() { _ = d.Close() })
	return d
}

// TestDeviceParity: GPU steps equal CPU reference steps (gpu.Trainer.Step)
// within 1e-5 relative on the loss statistics, gradient norm and
// parameters, for several random batches, objectives, temperatures and
// vocabulary chunk sizes (checkParity, parityCases).
func TestDeviceParity(t *testing.T) {
	d := openDevice(t)
	t.Logf("device %s, kernels from %s", d.Name(), d.PTXFrom)
	checkParity(t, func() backend { return d })
}

// TestDeviceDoubleBuffer: checkDoubleBuffer on the GPU (two Devices, one
// per trainer).
func TestDeviceDoubleBuffer(t *testing.T) {
	checkDoubleBuffer(t, func() backend { return openDevice(t) })
}

// TestDeviceBackend: the train operator's backend on the GPU
// (NewBackend(0), one device opened per backend): Update with two epochs
// per batch matches the CPU trainer's metrics, parameters and Adam state
// over real batches of the built-in loop (checkBackendParity), and an
// untrainable batch leaves the state on the device bit for bit unchanged
// (checkBackendUntrainable).
func TestDeviceBackend(t *testing.T) {
	t.Run("parity", func(t *testing.T) { checkBackendParity(t, NewBackend(0)) })
	t.Run("untrainable", func(t *testing.T) { checkBackendUntrainable(t, NewBackend(0)) })
}
