//go:build !cuda

package operators

import (
	"fmt"

	"github.com/trajflow/trajflow/gpu"
)

// Backend returns the train backend of device: "cpu" (or "") is the CPU
// reference; "cuda" and "cuda:N" need a build with the cuda tag.
func Backend(device string) (gpu.BackendFactory, error) {
	cuda, _, err := parseDevice(device)
	if err != nil {
		return nil, err
	}
	if cuda {
		return nil, fmt.Errorf("operators: train --device %s: this trajflow was built without CUDA support; build it with the cuda tag (make cuda-build, see gpu/README.md)", device)
	}
	return gpu.CPUBackend, nil
}
