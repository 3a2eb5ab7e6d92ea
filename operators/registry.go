// Package operators is the registry of every stage that `trajflow run NAME`
// can start, and the translation of a learning contract into each stage's
// configuration.
package operators

import (
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/operators/validate"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// Deps is what a stage factory may use.
type Deps struct {
	Contract *contract.Contract // resolved
	Topics   pipeline.Topics
	// Evaluators are the reward evaluators beyond the built-in generic ones
	// (for example the environment's trusted validator).
	Evaluators []reward.Evaluator
	// EvalDenylist reports hidden-evaluation task ids (pipeline §6).
	EvalDenylist func(taskID string) bool
	VocabSize    int32
	// PartialGroupTimeout and WindowMaxWait are the wall-clock policies of
	// the advantage and pack stages (0 = off).
	PartialGroupTimeout time.Duration
	WindowMaxWait       time.Duration
	// SnapshotDir is where the snapshot stage writes its Parquet files;
	// SnapshotRollBytes and SnapshotRollInterval close a file by size or
	// age (0: the stage's defaults).
	SnapshotDir          string
	SnapshotRollBytes    int64
	SnapshotRollInterval time.Duration
	// Tasks is the task registry of the built-in environment (dispatch,
	// rollout); nil means rollout.DefaultRegistryConfig().
	Tasks *rollout.Registry
	// ReleaseDir is the policy releases directory the trainer writes
	// (checkpoints, manifests, update records); rollout workers read the
	// checkpoints the manifests name.
	ReleaseDir string
	// Rounds is how many update rounds dispatch launches (0: until
	// stopped).
	Rounds int64
}

// Factory builds a stage.
type Factory func(d Deps) (pipeline.Stage, error)

var (
	mu        sync.Mutex
	factories = map[string]Factory{}
)

// Register adds a stage factory under name; registering a name twice
// panics.
func Register(name string, f Factory) {
	mu.Lock()
	defer mu.Unlock()
	if _, dup := factories[name]; dup {
		panic("operators: stage registered twice: " + name)
	}
	factories[name] = f
}

// New builds the stage registered under name.
func New(name string, d Deps) (pipeline.Stage, error) {
	mu.Lock()
	f, ok := factories[name]
	mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("operators: no stage %q (have %v)", name, Names())
	}
	if d.Contract == nil {
		return nil, fmt.Errorf("operators: stage %q: no contract", name)
	}
	return f(d)
}

// Names lists the registered stages.
func Names() []string {
	mu.Lock()
	defer mu.Unlock()
	out := make([]string, 0, len(factories))
	for n := range factories {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func init() {
	Register("validate", func(d Deps) (pipeline.Stage, error) {
		return validate.NewStage(validate.StageConfig{Options: ValidateOptions(d), Topics: d.Topics}), nil
	})
	Register("reward", func(d Deps) (pipeline.Stage, error) {
		reg, err := RewardRegistry(d)
		if err != nil {
			return nil, err
		}
		return reward.NewStage(reward.StageConfig{
			Components: RewardComponents(d.Contract), Registry: reg, Topics: d.Topics,
			Retries: d.Contract.Sampler.ToolRetries,
		})
	})
	Register("advantage", func(d Deps) (pipeline.Stage, error) {
		return advantage.NewStage(advantage.StageConfig{
			Options: d.Contract.Estimator, Topics: d.Topics, PartialTimeout: d.PartialGroupTimeout,
		})
	})
	Register("pack", func(d Deps) (pipeline.Stage, error) {
		return pack.NewStage(pack.StageConfig{
			Options: d.Contract.Packing, Topics: d.Topics, RunID: d.Contract.RunID,
			ContractHash: d.Contract.Hash(), MaxWait: d.WindowMaxWait,
			// A round of groups that are all filtered must still close a
			// window (sync: the next round waits for it; async: dispatch
			// keeps at most max_lag+1 rounds in flight).
			CountDecidedGroups: true,
		})
	})
}

// ValidateOptions derives the validate stage's options from the contract.
func ValidateOptions(d Deps) validate.Options {
	c := d.Contract
	return validate.Options{
		VocabSize:           d.VocabSize,
		ContractHash:        c.Hash(),
		EvalDenylist:        d.EvalDenylist,
		MaxTurns:            c.Sampler.MaxTurns,
		MaxTokensPerAction:  c.Sampler.MaxTokensPerAction,
		MaxTokensPerEpisode: c.Sampler.MaxTokensPerEpisode,
		BootstrapReasons:    c.Estimator.BootstrapReasons,
	}
}

// RewardComponents converts the contract's reward declarations.
func RewardComponents(c *contract.Contract) []reward.Component {
	out := make([]reward.Component, len(c.Rewards))
	for i, r := range c.Rewards {
		out[i] = reward.Component{Name: r.Name, Version: r.Version, Weight: r.Weight, Transform: r.Transform, ClipMin: r.ClipMin, ClipMax: r.ClipMax}
	}
	return out
}

// RewardRegistry returns the built-in evaluators plus d.Evaluators.
func RewardRegistry(d Deps) (*reward.Registry, error) {
	reg := reward.NewBuiltinRegistry()
	for _, e := range d.Evaluators {
		if err := reg.Register(e); err != nil {
			return nil, err
		}
	}
	return reg, nil
}
