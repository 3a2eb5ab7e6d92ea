//go:build cuda

package cuda

import (
	"math/rand/v2"
	"testing"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
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

// TestDeviceDoubleBuffer: staging batch k+1 before stepping batch k (its
// copy overlapping batch k's compute) gives the same parameters as staging
// and stepping one batch at a time, and a handle whose slot was reused is
// refused.
func TestDeviceDoubleBuffer(t *testing.T) {
	d1, d2 := openDevice(t), openDevice(t)
	cfg := model.Config{Vocab: 32, Window: 4, Embed: 8, Hidden: 16}
	m, _ := model.New(cfg, 9)
	beh := model.Behavior{Temperature: 1}
	opts := gpu.DefaultObjective()
	adam := gpu.DefaultAdam()
	seq, err := NewTrainer(d1, m, beh, 0, TrainerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer seq.Close()
	pip, err := NewTrainer(d2, m, beh, 0, TrainerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer pip.Close()
	rng := rand.New(rand.NewPCG(4, 4))
	var hs []Handle
	for k, n := range []int{40, 300, 80, 500, 60} {
		b := randomBatch(rng, 2, n, cfg.Vocab, false, int32(k))
		h1, err := seq.Stage(b, opts)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := seq.Step(h1, opts, adam); err != nil {
			t.Fatal(err)
		}
		h2, err := pip.Stage(b, opts)
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h2)
		if k > 0 {
			if _, err := pip.Step(hs[k-1], opts, adam); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := pip.Step(hs[len(hs)-1], opts, adam); err != nil {
		t.Fatal(err)
	}
	a, err := seq.Params()
	if err != nil {
		t.Fatal(err)
	}
	b, err := pip.Params()
	if err != nil {
		t.Fatal(err)
	}
	if rel, _, ok := paramsClose(b, a, 1e-6); !ok {
		t.Fatalf("pipelined staging changed the result: relative L2 %.3g", rel)
	}
	if _, err := pip.Step(hs[0], opts, adam); err == nil {
		t.Fatal("stale handle accepted")
	}
}
