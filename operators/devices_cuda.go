//go:build cuda

package operators

import (
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/cuda"
)

// Backend returns the train backend of device: "cpu" (or "") is the CPU
// reference; "cuda" is the CUDA trainer on GPU 0 and "cuda:N" on GPU N
// (cuda.NewBackend). The CUDA trainer implements temperature-only
// behaviors: the factory refuses a contract with a grammar, top-k, top-p
// or min-p when the train stage starts it, naming the fields.
func Backend(device string) (gpu.BackendFactory, error) {
	isCUDA, ordinal, err := parseDevice(device)
	if err != nil {
		return nil, err
	}
	if isCUDA {
		return cuda.NewBackend(ordinal), nil
	}
	return gpu.CPUBackend, nil
}
