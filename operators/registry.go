// Package operators is the registry of every stage that `trajflow run NAME`
// can start — one explicit list, in pipeline order — and the translation
// of a learning contract into each stage's configuration. The stages
// themselves live in operators/NAME and know nothing of the contract.
package operators

import (
	"errors"
	"fmt"
	"time"

	"github.com/trajflow/trajflow/connectors/envsvc"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/internal/evaluation"
	"github.com/trajflow/trajflow/internal/gate"
	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/operators/dispatch"
	"github.com/trajflow/trajflow/operators/eval"
	gateop "github.com/trajflow/trajflow/operators/gate"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/operators/snapshot"
	"github.com/trajflow/trajflow/operators/train"
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
	// EvalDenylist reports hidden-evaluation task ids (docs/PIPELINE.md §6).
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
	// rollout); nil means the default registry of the contract's
	// artifacts.environment (rollout.RegistryForArtifact).
	Tasks *rollout.Registry
	// ReleaseDir is the policy releases directory the trainer writes
	// (checkpoints, manifests, update records); rollout workers read the
	// checkpoints the manifests name. The launcher gives it to the stage
	// as its release store.
	ReleaseDir string
	// Rounds is how many update rounds dispatch launches (0: until
	// stopped).
	Rounds int64
	// Gated: a gate rules on every release on the decisions topic, and
	// dispatch launches a round at a release only after its ruling
	// (dispatch.StageConfig.Gated).
	Gated bool
	// EvalSamples is the eval stage's attempts per task of every suite
	// (0: 4).
	EvalSamples int32
	// Device selects the train stage's backend ("cpu", the default, or
	// "cuda" in a build with the cuda tag).
	Device string
	// Env is the client of the environment services the rollout stage
	// runs its episodes against (DialEnv); nil: the in-process registry.
	// The caller owns it and closes it after the stage. One rollout stage
	// per client: the stage puts the client's retries during a group's
	// run into that group's census.
	Env *envsvc.Client
	// NoTrain says that no train stage runs (a model the built-in trainer
	// cannot train): dispatch completes a round once pack decided its
	// groups instead of waiting for the release trained on them.
	NoTrain bool
	// PolicyTrace sees every call of the rollout stage's policy server
	// clients, request and response bodies (nil: none; a test's log).
	PolicyTrace func(method, path string, req []byte, status int, resp []byte)
}

// Factory builds a stage.
type Factory func(d Deps) (pipeline.Stage, error)

// Spec is one stage of the registry.
type Spec struct {
	Name string
	Doc  string
	New  Factory
	// Needed reports whether a run of the contract needs the stage (nil:
	// every run does).
	Needed func(c *contract.Contract) bool
}

// specs is every stage `trajflow run NAME` can start, in pipeline order.
var specs = []Spec{
	{Name: "dispatch", Doc: "plans rounds of task attempts (curriculum, quotas, denylist) and paces them", New: newDispatch},
	{Name: "rollout", Doc: "runs the agent loop of each group on the policy (built-in or a server)", New: newRollout},
	{Name: "validate", Doc: "checks every trajectory; refusals go to quarantine with a reason", New: newValidate},
	{Name: "reward", Doc: "scores trajectories with separately kept, versioned reward components", New: newReward},
	{Name: "advantage", Doc: "assembles groups and computes returns and advantages (GRPO, RLOO, GAE)", New: newAdvantage},
	{Name: "pack", Doc: "the lag-aware admission window: reconstruction and packing into batches", New: newPack},
	{Name: "train", Doc: "trains on every batch and publishes a policy release (--releases)", New: newTrain},
	{Name: "weightsync", Doc: "loads every release into every policy server replica and acknowledges the version each serves", New: newWeightsync, Needed: onPolicyServers},
	{Name: "eval", Doc: "measures every release on frozen evaluation suites (validation, held-out, regression, safety) with confidence intervals", New: newEval, Needed: onBuiltinPolicy},
	{Name: "gate", Doc: "applies the contract's objective, stop rules and budgets to every evaluation: promote, continue, rollback or stop", New: newGate, Needed: onBuiltinPolicy},
	{Name: "snapshot", Doc: "writes every topic of the run to Parquet snapshots (--snapshot-dir)", New: newSnapshot},
}

// Specs lists the registered stages, in pipeline order.
func Specs() []Spec { return append([]Spec(nil), specs...) }

// Needed reports whether a run of c needs the stage name (a registered
// one): weight sync only when the contract's policy runs on servers.
func Needed(name string, c *contract.Contract) bool {
	sp, ok := Lookup(name)
	return ok && (sp.Needed == nil || sp.Needed(c))
}

// Names lists the registered stage names, in pipeline order.
func Names() []string {
	out := make([]string, len(specs))
	for i, s := range specs {
		out[i] = s.Name
	}
	return out
}

// Lookup returns the registered stage named name.
func Lookup(name string) (Spec, bool) {
	for _, s := range specs {
		if s.Name == name {
			return s, true
		}
	}
	return Spec{}, false
}

// ErrUnknownStage is wrapped by New for a name no stage has.
var ErrUnknownStage = errors.New("operators: unknown stage")

// ErrConfig marks a configuration error: an unknown stage, a value the
// stage refuses, a missing required directory. Building the stage again
// cannot fix it, so a restart loop (RunRestarting) never retries it.
// Every error New and NewOperator return wraps it. It is
// pipeline.ErrConfig, which a stage's Start wraps for the same reason.
var ErrConfig = pipeline.ErrConfig

// New builds the stage registered under name. Every error it returns
// wraps ErrConfig.
func New(name string, d Deps) (pipeline.Stage, error) {
	s, ok := Lookup(name)
	if !ok {
		return nil, fmt.Errorf("%w: %w %q (one of %v)", ErrConfig, ErrUnknownStage, name, Names())
	}
	if d.Contract == nil {
		return nil, fmt.Errorf("%w: operators: stage %q: no contract", ErrConfig, name)
	}
	st, err := s.New(d)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return st, nil
}

func newValidate(d Deps) (pipeline.Stage, error) {
	return validate.NewStage(validate.StageConfig{Options: ValidateOptions(d), Topics: d.Topics}), nil
}

func newReward(d Deps) (pipeline.Stage, error) {
	reg, err := RewardRegistry(d)
	if err != nil {
		return nil, err
	}
	return reward.NewStage(reward.StageConfig{
		Components: RewardComponents(d.Contract), Registry: reg, Topics: d.Topics,
		Check: RewardChecks(d.Contract), Retries: d.Contract.Sampler.ToolRetries,
	})
}

func newAdvantage(d Deps) (pipeline.Stage, error) {
	return advantage.NewStage(advantage.StageConfig{
		Options: d.Contract.Estimator, Topics: d.Topics, PartialTimeout: d.PartialGroupTimeout,
	})
}

func newPack(d Deps) (pipeline.Stage, error) {
	return pack.NewStage(pack.StageConfig{
		Options: d.Contract.Packing, Topics: d.Topics, RunID: d.Contract.RunID,
		ContractHash: d.Contract.Hash(), MaxWait: d.WindowMaxWait,
		// A round of groups that are all filtered must still close a
		// window (sync: the next round waits for it; async: dispatch
		// keeps at most max_lag+1 rounds in flight).
		CountDecidedGroups: true,
		// Asynchronous: earliest deadline first, so a straggler is not
		// overtaken out of its last batch within max_lag.
		Deadlines: d.Contract.Dispatch.Mode == contract.DispatchAsync && d.Contract.Packing.BatchGroups > 0,
	})
}

func newDispatch(d Deps) (pipeline.Stage, error) {
	p, err := Planner(d)
	if err != nil {
		return nil, err
	}
	return dispatch.NewStage(dispatch.StageConfig{
		Planner: p, Topics: d.Topics, RunID: d.Contract.RunID, Mode: d.Contract.Dispatch.Mode,
		MaxLag: d.Contract.Packing.MaxLag, BatchGroups: d.Contract.Packing.BatchGroups, Rounds: d.Rounds, Untrained: d.NoTrain,
		Gated: d.Gated, Continue: d.Contract.Dispatch.PartialRollouts == contract.PartialContinue,
	})
}

func newRollout(d Deps) (pipeline.Stage, error) {
	reg, err := TaskRegistry(d)
	if err != nil {
		return nil, err
	}
	cfg := rollout.StageConfig{
		Registry: reg, Settings: RolloutSettings(d.Contract, reg), Limits: RolloutLimits(d.Contract),
		Topics: d.Topics, RunID: d.Contract.RunID, Load: gpu.PolicyFromRelease,
		Retries:      d.Contract.Sampler.ToolRetries,
		GroupTimeout: time.Duration(d.Contract.Sampler.ToolTimeoutMS) * time.Millisecond * time.Duration(max(1, d.Contract.Sampler.MaxTurns)),
		Latency:      RolloutLatency(d.Contract),
		Continue:     d.Contract.Dispatch.PartialRollouts == contract.PartialContinue,
	}
	rolloutEnv(d, &cfg)
	// A contract whose policy runs on servers: the gateway (policy.go).
	if err := rolloutServer(d, reg, &cfg); err != nil {
		return nil, err
	}
	st, err := rollout.NewStage(cfg)
	if c, ok := cfg.Server.(interface{ Close() }); ok && err != nil {
		c.Close() // the gateway's health checks
	}
	return st, err
}

// RolloutLatency is the contract's simulated latency of the built-in
// environment and policy, seeded by the contract seed.
func RolloutLatency(c *contract.Contract) rollout.LatencyModel {
	ms := func(x float64) time.Duration { return time.Duration(x * float64(time.Millisecond)) }
	l := c.Latency
	return rollout.LatencyModel{ToolMedian: ms(l.ToolMedianMS), ToolSigma: l.ToolSigma,
		TokenMedian: ms(l.TokenMedianMS), TokenSigma: l.TokenSigma, Seed: c.Seed}
}

func newTrain(d Deps) (pipeline.Stage, error) {
	cfg, err := TrainConfig(d)
	if err != nil {
		return nil, err
	}
	return train.NewStage(cfg)
}

func newEval(d Deps) (pipeline.Stage, error) {
	if onPolicyServers(d.Contract) {
		return nil, fmt.Errorf("operators: eval: %w (policy.protocol %s)", ErrServedPolicy, d.Contract.Policy.Protocol)
	}
	if d.ReleaseDir == "" {
		return nil, errors.New("operators: eval reads the releases' checkpoints and update records: give it the release directory (--releases)")
	}
	reg, err := TaskRegistry(d)
	if err != nil {
		return nil, err
	}
	samples := d.EvalSamples
	if samples == 0 {
		samples = 4
	}
	plane, err := EvaluationPlane(d.Contract, reg, samples)
	if err != nil {
		return nil, err
	}
	c := d.Contract
	return eval.NewStage(eval.StageConfig{Plane: plane, Topics: d.Topics, RunID: c.RunID,
		Every: int64(c.Dispatch.EvalEvery), Epochs: c.Loss.Optimizer.Epochs})
}

func newGate(d Deps) (pipeline.Stage, error) {
	if onPolicyServers(d.Contract) {
		return nil, fmt.Errorf("operators: gate: %w (policy.protocol %s)", ErrServedPolicy, d.Contract.Policy.Protocol)
	}
	return gateop.NewStage(gateop.StageConfig{Policy: gate.PolicyOf(d.Contract), Topics: d.Topics, RunID: d.Contract.RunID})
}

// EvaluationPlane is the evaluation plane of a run of c on the built-in
// policy (docs/PIPELINE.md §16): the registry's validation and held-out
// splits, a regression suite of the other built-in family, the safety
// suite, samples attempts per task, the initial policy as the KL
// reference.
func EvaluationPlane(c *contract.Contract, reg *rollout.Registry, samples int32) (*evaluation.Plane, error) {
	mc, mseed := ModelConfig(c)
	ref, err := gpu.InitialModel(mc, mseed)
	if err != nil {
		return nil, err
	}
	rg, err := rollout.NewFamilyRegistry(evaluation.RegressionFamily(reg.Family()))
	if err != nil {
		return nil, err
	}
	return evaluation.NewPlane(evaluation.PlaneConfig{Registry: reg, Regression: rg,
		Settings: RolloutSettings(c, reg), Limits: RolloutLimits(c),
		Seed: c.Seed, Samples: samples, Reference: ref})
}

func newSnapshot(d Deps) (pipeline.Stage, error) {
	if d.SnapshotDir == "" {
		return nil, errors.New("operators: snapshot: no snapshot directory (--snapshot-dir)")
	}
	y, err := d.Contract.YAML()
	if err != nil {
		return nil, err
	}
	var tasks []snapshot.TaskRow
	if d.Tasks != nil {
		for _, t := range append(d.Tasks.Train(), d.Tasks.Eval()...) {
			tasks = append(tasks, snapshot.TaskRow{TaskID: t.ID, TaskVersion: t.Version, Domain: t.Domain,
				Split: t.Split, EnvVersion: t.EnvVersion, Key: t.Key})
		}
	}
	return snapshot.NewStage(snapshot.Config{
		Dir: d.SnapshotDir, Run: d.Contract.RunID, Tasks: tasks,
		ContractHash: d.Contract.Hash(), ContractYAML: y, VocabSize: d.VocabSize,
		RollBytes: d.SnapshotRollBytes, RollInterval: d.SnapshotRollInterval,
	}, d.Topics)
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

// TaskRegistry returns d.Tasks or the default registry of the family the
// contract's artifacts.environment names.
func TaskRegistry(d Deps) (*rollout.Registry, error) {
	if d.Tasks != nil {
		return d.Tasks, nil
	}
	if d.Contract == nil {
		return rollout.NewRegistry(rollout.DefaultRegistryConfig())
	}
	return rollout.RegistryForArtifact(d.Contract.Artifacts.Environment)
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
// (docs/PIPELINE.md §5): temperature, top-k, top-p, min-p, the task grammar as the
// constrained-decoding mask, actions of at most max_tokens_per_action
// ending at a stop token.
//
// A nil reg (an environment that is not built in) has no grammar.
func RolloutSettings(c *contract.Contract, reg *rollout.Registry) model.Settings {
	b := model.Behavior{Temperature: c.Sampler.Temperature, TopK: c.Sampler.TopK, TopP: c.Sampler.TopP, MinP: c.Sampler.MinP}
	if reg != nil {
		b.Grammar = reg.Grammar()
	}
	return model.Settings{
		Behavior:  b,
		MaxTokens: c.Sampler.MaxTokensPerAction,
		Stop:      append([]int32(nil), c.Sampler.StopTokenIDs...),
	}
}

// SamplerSettings are the sampler settings a run's trajectories and
// releases record (their sampler_id): RolloutSettings over the task
// registry of d, or, for an environment that is not built in, without a
// grammar (none of ours masks its sampler).
func SamplerSettings(d Deps) (model.Settings, error) {
	reg, err := TaskRegistry(d)
	switch {
	case errors.Is(err, rollout.ErrNotBuiltin):
		return RolloutSettings(d.Contract, nil), nil
	case err != nil:
		return model.Settings{}, err
	}
	return RolloutSettings(d.Contract, reg), nil
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
func TrainConfig(d Deps) (train.StageConfig, error) {
	if d.ReleaseDir == "" {
		return train.StageConfig{}, fmt.Errorf("operators: train needs a release directory (--releases)")
	}
	backend, err := Backend(d.Device)
	if err != nil {
		return train.StageConfig{}, err
	}
	c := d.Contract
	s, err := SamplerSettings(d)
	if err != nil {
		return train.StageConfig{}, err
	}
	mc, seed := ModelConfig(c)
	var ref *model.Model
	if c.Loss.KLPlacement == objective.KLLoss {
		// The KL reference is the initial policy, as the evaluation
		// plane's (EvaluationPlane).
		if ref, err = gpu.InitialModel(mc, seed); err != nil {
			return train.StageConfig{}, err
		}
	}
	o := c.Loss.Optimizer
	return train.StageConfig{
		Topics: d.Topics, RunID: c.RunID, ContractHash: c.Hash(), Behavior: s.Behavior,
		Model: mc, ModelSeed: seed, Objective: c.Loss.Options, Reference: ref, Backend: backend,
		Lag: train.LagRule{MaxLag: c.Packing.MaxLag, Policy: c.Packing.StalePolicy}, TokenBudget: c.Packing.TokenBudget,
		Adam:   gpu.AdamOptions{LR: o.LR, Beta1: o.Beta1, Beta2: o.Beta2, Eps: o.Eps, MaxGradNorm: o.GradClip},
		Epochs: o.Epochs, Minibatches: o.Minibatches, Seed: c.Seed,
		Meta: gpu.ReleaseMeta{TokenizerHash: rollout.TokenizerHash, SamplerContract: s.ID(), ContractHash: c.Hash(),
			CurriculumVersion: c.CurriculumVersion(), RewardVersion: c.RewardVersion()},
	}, nil
}

// RewardChecks are the reward stage's checks from the contract (pipeline
// §9 "reward ranges and component availability"): every declared
// component is required on every rewarded trajectory, and a component with
// a declared raw_range must score inside it.
func RewardChecks(c *contract.Contract) validate.RewardOptions {
	o := validate.RewardOptions{Ranges: map[string]validate.Range{}, Scopes: map[string]string{}}
	for _, r := range c.Rewards {
		o.Required = append(o.Required, r.Name)
		o.Scopes[r.Name] = r.Scope
		if len(r.RawRange) == 2 {
			o.Ranges[r.Name] = validate.Range{Min: r.RawRange[0], Max: r.RawRange[1]}
		}
	}
	return o
}
