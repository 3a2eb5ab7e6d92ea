//go:build !cuda

package operators

import (
	"fmt"

	"github.com/trajflow/trajflow/gpu"
)

// Backend returns the train backend of device: "cpu" (or "") is the CPU
// reference; "cuda" needs a build with the cuda tag.
func Backend(device string) (gpu.BackendFactory, error) {
	switch device {
	case "", "cpu":
		return gpu.CPUBackend, nil
	case "cuda":
		return nil, fmt.Errorf("operators: train --device cuda: this trajflow was built without CUDA support; build it with the cuda tag (make cuda-build, see gpu/README.md)")
	}
	return nil, fmt.Errorf("operators: train --device %q: want cpu or cuda", device)
}
