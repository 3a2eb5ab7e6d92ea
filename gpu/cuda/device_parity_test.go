//go:build cuda

package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
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

// paramsClose is the documented parameter tolerance (gpu/README.md):
// relative L2 distance <= rel.
func paramsClose(got, want []float32, rel float64) (float64, float64, bool) {
	var num, den, maxAbs float64
	for i := range want {
		d := float64(got[i]) - float64(want[i])
		num += d * d
		den += float64(want[i]) * float64(want[i])
		maxAbs = math.Max(maxAbs, math.Abs(d))
	}
	r := math.Sqrt(num / den)
	return r, maxAbs, r <= rel
}

// TestDeviceParity: GPU steps equal CPU reference steps (gpu.Trainer.Step)
// within 1e-5 relative on the loss statistics and the parameters, for
// several random batches, objectives, temperatures and vocabulary chunk
// sizes (a chunk smaller than the vocabulary exercises the online
// log-sum-exp across chunks).
func TestDeviceParity(t *testing.T) {
	d := openDevice(t)
	cfg := model.Config{Vocab: 32, Window: 6, Embed: 8, Hidden: 24}
	for ci, tc := range []struct {
		name  string
		beh   model.Behavior
		opts  objective.Options
		chunk int
		ref   bool
	}{
		{"demo", model.Behavior{Temperature: 1}, gpu.DefaultObjective(), 0, false},
		{"chunked-kl-loss", model.Behavior{Temperature: 0.7}, objective.Options{ClipLow: 0.2, ClipHigh: 0.28,
			Normalization: objective.SeqMeanTokenMean, KLPlacement: objective.KLLoss, KLEstimator: objective.K3, KLCoef: 0.1, EntropyCoef: 0.01}, 7, true},
		{"seq-sum-clamp", model.Behavior{Temperature: 1.3}, objective.Options{ClipLow: 0.1, ClipHigh: 0.1,
			Normalization: objective.SeqMeanTokenSum, KLPlacement: objective.KLReward, KLEstimator: objective.K2, MaxLogRatio: 0.5}, 16, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := model.New(cfg, uint64(100+ci))
			if err != nil {
				t.Fatal(err)
			}
			cpu, err := gpu.NewTrainer(m, tc.beh, 0)
			if err != nil {
				t.Fatal(err)
			}
			dev, err := NewTrainer(d, m, tc.beh, 0, TrainerOptions{ChunkVocab: tc.chunk})
			if err != nil {
				t.Fatal(err)
			}
			adam := gpu.DefaultAdam()
			adam.WeightDecay = 0.01
			rng := rand.New(rand.NewPCG(uint64(ci), 77))
			for step := 0; step < 4; step++ {
				b := randomBatch(rng, 3, 120, cfg.Vocab, tc.ref, int32(cpu.Version()))
				want, err := cpu.Step(b, tc.opts, adam)
				if err != nil {
					t.Fatal(err)
				}
				h, err := dev.Stage(b, tc.opts)
				if err != nil {
					t.Fatal(err)
				}
				got, err := dev.Step(h, tc.opts, adam)
				if err != nil {
					t.Fatal(err)
				}
				if err := StatsClose(got.Stats, want.Stats, 1e-5); err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
				if math.Abs(got.GradNorm-want.GradNorm) > 1e-5*want.GradNorm || got.Version != want.Version {
					t.Fatalf("step %d: grad norm %v version %d, want %v %d", step, got.GradNorm, got.Version, want.GradNorm, want.Version)
				}
				p, err := dev.Params()
				if err != nil {
					t.Fatal(err)
				}
				rel, maxAbs, ok := paramsClose(p, cpu.Model().Params, 1e-5)
				t.Logf("step %d: loss %.8g (cpu %.8g) params rel L2 %.3g max |diff| %.3g", step, got.Loss, want.Loss, rel, maxAbs)
				if !ok {
					t.Fatalf("step %d: parameters differ: relative L2 %.3g, max |diff| %.3g", step, rel, maxAbs)
				}
			}
		})
	}
}

// TestDeviceDoubleBuffer: staging batch k+1 before stepping batch k gives
// the same parameters as staging and stepping one at a time.
func TestDeviceDoubleBuffer(t *testing.T) {
	d := openDevice(t)
	cfg := model.Config{Vocab: 32, Window: 4, Embed: 8, Hidden: 16}
	m, _ := model.New(cfg, 9)
	beh := model.Behavior{Temperature: 1}
	opts := gpu.DefaultObjective()
	adam := gpu.DefaultAdam()
	rng := rand.New(rand.NewPCG(4, 4))
	seq, _ := NewTrainer(d, m, beh, 0, TrainerOptions{})
	pip, _ := NewTrainer(d, m, beh, 0, TrainerOptions{})
	list := []int{40, 300, 80, 500, 60}
	var hs []Handle
	for k, n := range list {
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
	a, _ := seq.Params()
	b, _ := pip.Params()
	if rel, _, ok := paramsClose(b, a, 1e-6); !ok {
		t.Fatalf("pipelined staging changed the result: rel %.3g", rel)
	}
	if _, err := pip.Step(hs[0], opts, adam); err == nil {
		t.Fatal("stale handle accepted")
	}
}
