//go:build !cuda

package operators

import (
	"strings"
	"testing"
)

// TestBackendWithoutCUDA: a default build refuses --device cuda with a
// message that says how to get CUDA support.
func TestBackendWithoutCUDA(t *testing.T) {
	for _, d := range []string{"cuda", "cuda:1"} {
		if _, err := Backend(d); err == nil || !strings.Contains(err.Error(), "cuda tag") {
			t.Errorf("%s: %v", d, err)
		}
	}
}
