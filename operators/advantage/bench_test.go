package advantage_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/schemas"
)

// benchGroups builds 4096 trajectories in groups of 8 with heavy-tailed turn
// counts: a Pareto(alpha 1.2) draw, so most episodes have a few turns and a
// few have hundreds (capped at 512).
func benchGroups() ([][]schemas.Rewarded, int) {
	const trajectories, groupSize = 4096, 8
	rng := rand.New(rand.NewPCG(42, 4096))
	var groups [][]schemas.Rewarded
	turnsTotal := 0
	for g := range trajectories / groupSize {
		gid := fmt.Sprintf("bench-%04d", g)
		members := make([]schemas.Rewarded, groupSize)
		for m := range groupSize {
			turns := min(int(math.Floor(math.Pow(1-rng.Float64(), -1/1.2))), 512)
			turnsTotal += turns
			id := fmt.Sprintf("%s-%d", gid, m)
			r := schemas.Rewarded{Trajectory: schemas.Trajectory{
				RecordID: id, GroupID: gid, GroupSize: groupSize, Member: int32(m),
				Status: schemas.StatusCompleted, End: schemas.EndTerminated, EndReason: "answer",
			}}
			if rng.IntN(4) == 0 {
				r.End, r.EndReason, r.BootstrapValue = schemas.EndTruncated, "max_turns", float32(rng.Float64())
			}
			r.Turns = make([]schemas.Turn, turns)
			for i := range r.Turns {
				r.Turns[i] = schemas.Turn{Index: int32(i), Value: float32(rng.Float64())}
				r.Rewards = append(r.Rewards, schemas.RewardComponent{TrajectoryID: id, Name: "tool_cost", Version: "1", Scope: schemas.ScopeTurn, Turn: int32(i), Value: -0.01})
			}
			r.Rewards = append(r.Rewards, schemas.RewardComponent{TrajectoryID: id, Name: "success", Version: "1", Scope: schemas.ScopeTrajectory, Turn: -1, Value: float64(rng.IntN(2))})
			members[m] = r
		}
		groups = append(groups, members)
	}
	return groups, turnsTotal
}

// BenchmarkScoreGroups scores 4096 trajectories (512 groups of 8) per
// iteration with each estimator and reports trajectories and turns per second.
func BenchmarkScoreGroups(b *testing.B) {
	groups, turns := benchGroups()
	for name, opts := range allEstimators() {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			n := 0
			for b.Loop() {
				for _, g := range groups {
					out, err := advantage.ScoreGroup(opts, g)
					if err != nil {
						b.Fatal(err)
					}
					n += len(out)
				}
			}
			sec := b.Elapsed().Seconds()
			b.ReportMetric(float64(n)/sec, "trajectories/s")
			b.ReportMetric(float64(turns)*float64(n)/4096/sec, "turns/s")
		})
	}
}

// BenchmarkAssemble feeds 4096 trajectories through an Assembler and scores
// each completed group.
func BenchmarkAssemble(b *testing.B) {
	groups, _ := benchGroups()
	opts := allEstimators()["grpo"]
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		a := advantage.NewAssembler(1024)
		for _, g := range groups {
			for _, r := range g {
				if members, done := a.Add(r); done {
					out, err := advantage.ScoreGroup(opts, members)
					if err != nil {
						b.Fatal(err)
					}
					n += len(out)
				}
			}
		}
	}
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "trajectories/s")
}
