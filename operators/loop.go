package operators

import (
	"fmt"
	"time"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/dispatch"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// This file registers the stages of the RL loop that run the built-in
// policy and environment: dispatch, rollout and train.

func init() {
	Register("dispatch", func(d Deps) (pipeline.Stage, error) {
		p, err := Planner(d)
		if err != nil {
			return nil, err
		}
		return dispatch.NewStage(dispatch.StageConfig{
			Planner: p, Topics: d.Topics, RunID: d.Contract.RunID, Mode: d.Contract.Dispatch.Mode,
			MaxLag: d.Contract.Packing.MaxLag, Rounds: d.Rounds,
		})
	})
	Register("rollout", func(d Deps) (pipeline.Stage, error) {
		reg, err := TaskRegistry(d)
		if err != nil {
			return nil, err
		}
		return rollout.NewStage(rollout.StageConfig{
			Registry: reg, Settings: RolloutSettings(d.Contract, reg), Limits: RolloutLimits(d.Contract),
			Topics: d.Topics, RunID: d.Contract.RunID, Load: gpu.LoadRelease,
			Retries:      d.Contract.Sampler.ToolRetries,
			GroupTimeout: time.Duration(d.Contract.Sampler.ToolTimeoutMS) * time.Millisecond * time.Duration(max(1, d.Contract.Sampler.MaxTurns)),
		})
	})
	Register("train", func(d Deps) (pipeline.Stage, error) {
		cfg, err := TrainConfig(d)
		if err != nil {
			return nil, err
		}
		return gpu.NewStage(cfg)
	})
}

// TaskRegistry returns d.Tasks or the built-in registry.
func TaskRegistry(d Deps) (*rollout.Registry, error) {
	if d.Tasks != nil {
		return d.Tasks, nil
	}
	return rollout.NewRegistry(rollout.DefaultRegistryConfig())
}

// Planner builds the dispatch planner over the registry's train split,
// with the contract's seed, group shape and domain quotas, and the eval
// denylist (the registry's own, and d.EvalDenylist).
func Planner(d Deps) (*dispatch.Planner, error) {
	reg, err := TaskRegistry(d)
	if err != nil {
		return nil, err
	}
	c := d.Contract
	var tasks []dispatch.Task
	for _, t := range reg.Train() {
		tasks = append(tasks, dispatch.Task{ID: t.ID, Version: t.Version, Domain: t.Domain, Split: t.Split, EnvVersion: t.EnvVersion})
	}
	deny := func(id string) bool { return reg.IsEval(id) || (d.EvalDenylist != nil && d.EvalDenylist(id)) }
	return dispatch.NewPlanner(dispatch.PlannerConfig{
		RunID: c.RunID, ContractHash: c.Hash(), Seed: c.Seed, Tasks: tasks, Denylist: deny,
		TasksPerRound: c.Dispatch.TasksPerUpdate, GroupsPerRound: c.Dispatch.GroupsPerUpdate,
		GroupSize: int32(c.Sampler.GroupSize), DomainQuotas: c.Dispatch.DomainQuotas,
	})
}

// RolloutSettings resolves the contract's sampler for the registry's tasks
// (pipeline §5): temperature, top-k, top-p, the task grammar as the
// constrained-decoding mask, actions of at most max_tokens_per_action
// ending at a stop token.
func RolloutSettings(c *contract.Contract, reg *rollout.Registry) model.Settings {
	return model.Settings{
		Behavior:  model.Behavior{Temperature: c.Sampler.Temperature, TopK: c.Sampler.TopK, TopP: c.Sampler.TopP, Grammar: reg.Grammar()},
		MaxTokens: c.Sampler.MaxTokensPerAction,
		Stop:      append([]int32(nil), c.Sampler.StopTokenIDs...),
	}
}

// RolloutLimits are the contract's episode budgets and seed.
func RolloutLimits(c *contract.Contract) rollout.Limits {
	return rollout.Limits{MaxTurns: c.Sampler.MaxTurns, MaxEpisodeTokens: c.Sampler.MaxTokensPerEpisode, ContractSeed: c.Seed}
}

// ModelConfig is the built-in policy's architecture and the seed of its
// initial weights (the contract seed).
func ModelConfig(c *contract.Contract) (model.Config, uint64) {
	return model.DefaultConfig(), uint64(c.Seed)
}

// TrainConfig derives the train stage's configuration from the contract.
func TrainConfig(d Deps) (gpu.StageConfig, error) {
	if d.ReleaseDir == "" {
		return gpu.StageConfig{}, fmt.Errorf("operators: train needs a release directory")
	}
	reg, err := TaskRegistry(d)
	if err != nil {
		return gpu.StageConfig{}, err
	}
	c := d.Contract
	s := RolloutSettings(c, reg)
	mc, seed := ModelConfig(c)
	o := c.Loss.Optimizer
	return gpu.StageConfig{
		Topics: d.Topics, RunID: c.RunID, ContractHash: c.Hash(), Behavior: s.Behavior,
		Model: mc, ModelSeed: seed, Objective: c.Loss.Options,
		Adam:   gpu.AdamOptions{LR: o.LR, Beta1: o.Beta1, Beta2: o.Beta2, Eps: o.Eps, MaxGradNorm: o.GradClip},
		Epochs: o.Epochs, ReleaseDir: d.ReleaseDir,
		Meta: gpu.ReleaseMeta{TokenizerHash: rollout.TokenizerHash, SamplerContract: s.ID(), ContractHash: c.Hash()},
	}, nil
}
