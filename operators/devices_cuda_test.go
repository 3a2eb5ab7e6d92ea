//go:build cuda

package operators

import (
	"errors"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/cuda"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// TestTrainCUDARefusesDemo: in a cuda build, the train stage of the demo
// contract with --device cuda gets the CUDA factory, which refuses the
// demo's behavior (its task grammar) when the stage starts it, before any
// device is opened, naming what the device step lacks.
func TestTrainCUDARefusesDemo(t *testing.T) {
	c := contract.Default()
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	for _, dev := range []string{"cuda", "cuda:1"} {
		cfg, err := TrainConfig(Deps{Contract: c, ReleaseDir: t.TempDir(), Device: dev})
		if err != nil {
			t.Fatal(err)
		}
		m, err := gpu.InitialModel(cfg.Model, cfg.ModelSeed)
		if err != nil {
			t.Fatal(err)
		}
		_, err = cfg.Backend(m, cfg.Behavior, 0)
		if !errors.Is(err, cuda.ErrUnsupported) || !strings.Contains(err.Error(), "grammar") || !strings.Contains(err.Error(), "--device cpu") {
			t.Fatalf("%s: %v", dev, err)
		}
		t.Logf("%s: %v", dev, err)
	}
}
