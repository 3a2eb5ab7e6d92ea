package cuda

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
)

// paramsClose is the documented parameter tolerance (gpu/README.md):
// relative L2 distance <= rel. It also returns the largest absolute
// difference.
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

// metricsClose is the documented tolerance on the metrics of one step
// (gpu/README.md): statistics within rel (StatsClose), gradient norm and
// scale within rel, equal counts and versions, and per-lag statistics.
func metricsClose(got, want gpu.Metrics, rel float64) error {
	if err := StatsClose(got.ObjectiveStats, want.ObjectiveStats, rel); err != nil {
		return err
	}
	if got.Tokens != want.Tokens || got.Sequences != want.Sequences || got.ClippedPos != want.ClippedPos ||
		got.ClippedNeg != want.ClippedNeg || got.LogRatioClamped != want.LogRatioClamped ||
		got.Rows != want.Rows || got.Segments != want.Segments || got.InputTokens != want.InputTokens {
		return fmt.Errorf("counts %+v, want %+v", got, want)
	}
	if math.Abs(got.GradNorm-want.GradNorm) > rel*want.GradNorm || got.Version != want.Version || got.FromVersion != want.FromVersion ||
		math.Abs(got.GradScale-want.GradScale) > rel*want.GradScale {
		return fmt.Errorf("grad norm %v scale %v versions %d -> %d, want %v %v %d -> %d",
			got.GradNorm, got.GradScale, got.FromVersion, got.Version, want.GradNorm, want.GradScale, want.FromVersion, want.Version)
	}
	if len(got.Lag) != len(want.Lag) {
		return fmt.Errorf("%d lag strata, want %d", len(got.Lag), len(want.Lag))
	}
	for i := range got.Lag {
		g, w := got.Lag[i], want.Lag[i]
		if g.Lag != w.Lag || g.Tokens != w.Tokens || math.Abs(g.RatioMean-w.RatioMean) > rel*w.RatioMean {
			return fmt.Errorf("lag %+v, want %+v", g, w)
		}
	}
	return nil
}

// parityCases are the objectives, temperatures and vocabulary chunks of the
// parity check: token-mean (the demo loss), seq-mean-token-mean with a K3
// KL in the loss and a chunk that does not divide the vocabulary, and
// seq-mean-token-sum with a K2 KL in the reward and a log-ratio clamp.
var parityCases = []struct {
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
}

// checkParity runs several steps of the device step on be and of the CPU
// reference (gpu.Trainer.Step) on the same random batches and requires the
// documented tolerances: statistics within 1e-5 relative (StatsClose),
// gradient norm within 1e-5 relative, parameters within 1e-5 relative L2,
// equal counts and versions.
func checkParity(t *testing.T, be func() backend) {
	cfg := model.Config{Vocab: 32, Window: 6, Embed: 8, Hidden: 24}
	for ci, tc := range parityCases {
		t.Run(tc.name, func(t *testing.T) {
			m, err := model.New(cfg, uint64(100+ci))
			if err != nil {
				t.Fatal(err)
			}
			cpu, err := gpu.NewTrainer(m, tc.beh, 0)
			if err != nil {
				t.Fatal(err)
			}
			dev, err := newTrainer(be(), m, tc.beh, 0, TrainerOptions{ChunkVocab: tc.chunk})
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := dev.Close(); err != nil {
					t.Error(err)
				}
			}()
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
				if err := metricsClose(got, want, 1e-5); err != nil {
					t.Fatalf("step %d: %v", step, err)
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

// TestEmulatedStepParity: the device step's orchestration (buffer offsets,
// column-major matrix-product conventions, vocabulary chunk loops, kernel
// argument lists) on the CPU emulation of the kernels matches the CPU
// reference within the documented tolerances. The CUDA kernels themselves
// are checked by TestDeviceParity on a GPU.
func TestEmulatedStepParity(t *testing.T) {
	var last *emu
	checkParity(t, func() backend { last = newEmu(); return last })
	if last.gemms == 0 {
		t.Fatal("no matrix product ran")
	}
}

// TestKernelSignatures: every kernel of kernels/trajflow.cu is launched by
// the device step with arguments of the kinds its C signature declares
// (pointer, int, long long, float, double); the binding passes each
// argument in an 8-byte slot, so a wrong kind would be read as garbage.
func TestKernelSignatures(t *testing.T) {
	e := newEmu()
	// One step exercises every kernel but the benchmark-only paths.
	cfg := model.Config{Vocab: 20, Window: 3, Embed: 4, Hidden: 5}
	m, _ := model.New(cfg, 1)
	tr, err := newTrainer(e, m, model.Behavior{Temperature: 1}, 0, TrainerOptions{ChunkVocab: 8})
	if err != nil {
		t.Fatal(err)
	}
	opts := parityCases[1].opts
	h, err := tr.Stage(randomBatch(rand.New(rand.NewPCG(2, 2)), 2, 40, cfg.Vocab, true, 0), opts)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Step(h, opts, gpu.DefaultAdam()); err != nil {
		t.Fatal(err)
	}
	sigs := cuSignatures(t)
	if len(sigs) != len(kernelNames) {
		t.Fatalf("%d kernels in trajflow.cu, %d loaded by name", len(sigs), len(kernelNames))
	}
	for _, name := range kernelNames {
		want, ok := sigs[name]
		if !ok {
			t.Fatalf("kernel %s is loaded but not defined in trajflow.cu", name)
		}
		got, ok := e.launches[name]
		if !ok {
			t.Fatalf("kernel %s never launched", name)
		}
		if len(got) != len(want) {
			t.Fatalf("%s: launched with %d arguments %v, declared %d %v", name, len(got), got, len(want), want)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%s argument %d: launched %s, declared %s", name, i, got[i], want[i])
			}
		}
	}
}

// checkDoubleBuffer: staging batch k+1 before stepping batch k (its copy
// overlapping batch k's compute) gives the same parameters as staging and
// stepping one batch at a time, over batches of growing and shrinking
// sizes; a handle whose slot was reused is refused.
func checkDoubleBuffer(t *testing.T, be func() backend) {
	cfg := model.Config{Vocab: 32, Window: 4, Embed: 8, Hidden: 16}
	m, _ := model.New(cfg, 9)
	beh := model.Behavior{Temperature: 1}
	opts := gpu.DefaultObjective()
	adam := gpu.DefaultAdam()
	seq, err := newTrainer(be(), m, beh, 0, TrainerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer seq.Close()
	pip, err := newTrainer(be(), m, beh, 0, TrainerOptions{})
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
	if seq.Version() != 5 || pip.Version() != 5 || pip.Steps() != 5 {
		t.Fatalf("versions %d %d, steps %d", seq.Version(), pip.Version(), pip.Steps())
	}
	if _, err := pip.Step(hs[0], opts, adam); !errors.Is(err, ErrBatch) {
		t.Fatalf("stale handle: %v", err)
	}
	if _, err := pip.Step(Handle{}, opts, adam); !errors.Is(err, ErrBatch) {
		t.Fatalf("empty handle: %v", err)
	}
}

func TestEmulatedDoubleBuffer(t *testing.T) {
	checkDoubleBuffer(t, func() backend { return newEmu() })
}

// TestTrainerRejects: behaviors the device step does not implement, and
// invalid options, are refused before anything changes.
func TestTrainerRejects(t *testing.T) {
	cfg := model.Config{Vocab: 16, Window: 2, Embed: 3, Hidden: 4}
	m, _ := model.New(cfg, 1)
	for _, b := range []model.Behavior{{Temperature: 1, TopK: 4}, {Temperature: 1, TopP: 0.9}, {Temperature: 1, MinP: 0.05}} {
		if _, err := newTrainer(newEmu(), m, b, 0, TrainerOptions{}); !errors.Is(err, ErrUnsupported) {
			t.Fatalf("behavior %+v: %v", b, err)
		}
	}
	if _, err := newTrainer(newEmu(), m, model.Behavior{}, 0, TrainerOptions{}); err == nil {
		t.Fatal("zero temperature accepted")
	}
	tr, err := newTrainer(newEmu(), m, model.Behavior{Temperature: 1, TopK: 16}, 0, TrainerOptions{})
	if err != nil {
		t.Fatalf("top-k >= vocab is no restriction: %v", err)
	}
	opts := gpu.DefaultObjective()
	h, err := tr.Stage(randomBatch(rand.New(rand.NewPCG(1, 2)), 1, 30, cfg.Vocab, false, 0), opts)
	if err != nil {
		t.Fatal(err)
	}
	before, _ := tr.Params()
	bad := gpu.DefaultAdam()
	bad.LR = 0
	if _, err := tr.Step(h, opts, bad); err == nil {
		t.Fatal("lr 0 accepted")
	}
	badOpts := opts
	badOpts.Normalization = "x"
	if _, err := tr.Step(h, badOpts, gpu.DefaultAdam()); err == nil {
		t.Fatal("bad objective accepted")
	}
	after, _ := tr.Params()
	if rel, _, _ := paramsClose(after, before, 0); rel != 0 || tr.Version() != 0 {
		t.Fatal("a refused step changed the parameters or the version")
	}
}
