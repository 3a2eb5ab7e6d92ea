// Package gputest builds training batches of the built-in task family for
// tests of trainers and the train stage: real rollouts of the built-in
// policy, scored by the trusted validator, GRPO advantages, and the pack
// window — the stage functions themselves, in process, without Kafka.
package gputest

import (
	"context"
	"fmt"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// Loop is a small in-process loop of the built-in task.
type Loop struct {
	RunID        string
	Registry     *rollout.Registry
	Settings     model.Settings
	Limits       rollout.Limits
	ContractSeed int64
	GroupSize    int32
	Tasks        int // tasks per batch
	Advantage    advantage.Options
	Pack         pack.Options
	rwd          *reward.Registry
	comps        []reward.Component
}

// Small is a loop of 16 train tasks, 4 attempts per group, 8 groups per
// batch, GRPO keeping zero-variance groups, one window per batch.
func Small() (*Loop, error) {
	cfg := rollout.DefaultRegistryConfig()
	cfg.Train, cfg.Eval = 16, 8
	reg, err := rollout.NewRegistry(cfg)
	if err != nil {
		return nil, err
	}
	rwd, err := reward.NewRegistry(rollout.NewValidator(reg))
	if err != nil {
		return nil, err
	}
	return &Loop{
		RunID: "run-1", Registry: reg, Settings: rollout.DefaultSettings(reg), Limits: rollout.DefaultLimits(),
		ContractSeed: 1, GroupSize: 4, Tasks: 8,
		Advantage: advantage.Options{Estimator: advantage.GRPO, NormalizeStd: true, StdMode: advantage.StdPopulation,
			Epsilon: 1e-6, Gamma: 1, ZeroVariance: advantage.ZeroVarKeep, MinGroupSize: 1},
		Pack: pack.Options{TokenBudget: 256, BatchTokens: 1 << 30, Overflow: pack.OverflowReject, MaxLag: 0, StalePolicy: pack.StaleDrop},
		rwd:  rwd, comps: []reward.Component{{Name: rollout.EvalSuccess, Version: rollout.ValidatorVersion, Weight: 1}},
	}, nil
}

// Collect runs g attempts of each task with pol and returns the scored
// groups and the fraction of successes.
func (l *Loop) Collect(ctx context.Context, pol *model.Policy, tasks []rollout.Task, groupBase int64, g int32) ([][]schemas.Scored, float64, error) {
	var atts []schemas.TaskAttempt
	for i, task := range tasks {
		atts = append(atts, rollout.Attempts(l.RunID, task, groupBase+int64(i), g, l.ContractSeed, pol.Version(), "contract")...)
	}
	trajs, err := l.Registry.RunEpisodes(ctx, pol, atts, l.Settings, l.Limits)
	if err != nil {
		return nil, 0, err
	}
	var groups [][]schemas.Scored
	succ := 0
	for i := range tasks {
		members := make([]schemas.Rewarded, 0, g)
		for k := int32(0); k < g; k++ {
			r, err := reward.Score(ctx, &trajs[i*int(g)+int(k)], l.comps, l.rwd)
			if err != nil {
				return nil, 0, err
			}
			if r.RewardTotal > 0 {
				succ++
			}
			members = append(members, r)
		}
		sc, err := advantage.ScoreGroup(l.Advantage, members)
		if err != nil {
			return nil, 0, err
		}
		groups = append(groups, sc)
	}
	return groups, float64(succ) / float64(len(trajs)), nil
}

// Batch collects one packed batch with pol (batch index `index`, groups of
// the first Tasks train tasks, group indexes from 100·index), packed for
// trainer version pol.Version() under contract hash "contract".
func (l *Loop) Batch(ctx context.Context, pol *model.Policy, index int64) (schemas.PackedBatch, error) {
	groups, _, err := l.Collect(ctx, pol, l.Registry.Train()[:l.Tasks], index*100, l.GroupSize)
	if err != nil {
		return schemas.PackedBatch{}, err
	}
	w, err := pack.NewWindow(l.Pack, pol.Version())
	if err != nil {
		return schemas.PackedBatch{}, err
	}
	for _, g := range groups {
		for _, s := range g {
			if _, err := w.Add(s); err != nil {
				return schemas.PackedBatch{}, err
			}
		}
	}
	b, _ := w.Close(index, l.RunID, "contract", pol.Version())
	if len(b.Rows) == 0 {
		return b, fmt.Errorf("gputest: batch %d is empty", index)
	}
	return b, nil
}
