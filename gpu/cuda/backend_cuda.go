//go:build cuda

package cuda

import "github.com/trajflow/trajflow/gpu"

// NewBackend is the gpu.BackendFactory of the CUDA trainer on GPU ordinal
// (`trajflow run train --device cuda`): each backend it starts opens the
// device (OpenDevice) and closes it in Close. A behavior the device step
// does not implement (Supported: grammar, top-k, top-p, min-p) is refused
// with ErrUnsupported before the device is opened.
func NewBackend(ordinal int) gpu.BackendFactory {
	return backendFactory(func() (backend, func() error, error) {
		d, err := OpenDevice(ordinal)
		if err != nil {
			return nil, nil, err
		}
		return d, d.Close, nil
	}, TrainerOptions{})
}
