package bench

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/validate"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// coreInput is 4096 heavy-tailed trajectories (512 groups of 8, mean ~1000
// tokens, tail to 32k) of the bench contract, validated and rewarded.
func coreInput(tb testing.TB) (*contract.Contract, [][]schemas.Rewarded, int64) {
	tb.Helper()
	c := testkit.LoadContract(tb, "../testdata/contracts/bench.yaml")
	s := synth.Default() // no loss shares: every trajectory is scored and packed
	s.RunID, s.ContractHash, s.GroupSize, s.MaxTurns = c.RunID, c.Hash(), c.Sampler.GroupSize, c.Sampler.MaxTurns
	s.PolicyVersion, s.MeanLag = 0, 0
	d := operators.Deps{Contract: c, VocabSize: s.Vocab}
	reg, err := operators.RewardRegistry(d)
	if err != nil {
		tb.Fatal(err)
	}
	comps := operators.RewardComponents(c)
	vopts := operators.ValidateOptions(d)
	var groups [][]schemas.Rewarded
	var tokens int64
	for g := int64(0); g < 4096/int64(s.GroupSize); g++ {
		var rs []schemas.Rewarded
		for _, t := range s.Group(g) {
			if v := validate.Check(&t, vopts); !v.OK() {
				tb.Fatalf("group %d: %v", g, v)
			}
			r, err := reward.Score(context.Background(), &t, comps, reg)
			if err != nil {
				tb.Fatal(err)
			}
			all, _ := synth.Tokens(&t)
			tokens += int64(all)
			rs = append(rs, r)
		}
		groups = append(groups, rs)
	}
	return c, groups, tokens
}

// BenchmarkAdvantagePack measures the data plane's core on one goroutine:
// group advantages (ScoreGroup), reconstruction of every scored
// trajectory into a training sequence, and packing them into rows of the
// token budget, over 4096 heavy-tailed trajectories. tokens/s counts every
// token of the input trajectories per second of process CPU time.
func BenchmarkAdvantagePack(b *testing.B) {
	c, groups, tokens := coreInput(b)
	segs := make([]pack.Segment, 0, 4096)
	var st pack.Stats
	b.ReportAllocs()
	b.ResetTimer()
	cpu0, wall0 := processCPU(), time.Now()
	n := 0
	for b.Loop() {
		segs = segs[:0]
		for _, g := range groups {
			scored, err := advantage.ScoreGroup(c.Estimator, g)
			if err != nil {
				b.Fatal(err)
			}
			for i := range scored {
				seg, f, err := pack.Reconstruct(&scored[i], 0, c.Packing)
				if err != nil {
					b.Fatal(err)
				}
				if f == pack.FilterNone {
					segs = append(segs, seg)
				}
			}
		}
		_, st = pack.Pack(segs, c.Packing.TokenBudget)
		n++
	}
	b.StopTimer()
	cpu := (processCPU() - cpu0).Seconds()
	wall := time.Since(wall0).Seconds()
	b.ReportMetric(float64(tokens)*float64(n)/cpu, "tokens/cpu-s")
	b.ReportMetric(float64(tokens)*float64(n)/wall, "tokens/s")
	b.ReportMetric(float64(tokens)/4096, "mean-tokens")
	b.ReportMetric(st.Efficiency, "efficiency")
	b.ReportMetric(float64(runtime.GOMAXPROCS(0)), "procs")
}
