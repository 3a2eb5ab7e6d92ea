// Package contract is the learning contract of a run: one YAML document that
// fixes the experiment's meaning before anything is trained (pipeline
// document §2: objective, constraints, regression floors, budgets, stop
// rules), names every frozen artifact by an immutable id (docs/PIPELINE.md §3),
// declares the resolved sampler (docs/PIPELINE.md §5), and declares the estimator,
// loss, optimizer, packing/admission, reward components, topics and dispatch
// quotas every operator runs with.
//
// Life cycle:
//
//	c, err := contract.Load("run.yaml") // strict decode: unknown keys are errors
//	err = c.Resolve()                   // fill documented defaults, then validate
//	c.Hash()                            // "sha256:<hex>" of the resolved contract
//	c.SamplerID()                       // "sha256:<hex>" of the resolved sampler
//
// Parse and Load only decode. Resolve fills every defaulted field that the
// document did not write and that still holds its Go zero value (see
// Default for the values, and the field comments), once, and then validates
// the whole contract, reporting every problem together (errors.Join of
// *FieldError, each naming its key path, e.g. "sampler.temperature: must be
// > 0, got -1"). A key written in the document is never replaced by a
// default, so "max_lag: 0" means 0 even though the default is 1.
//
// Identity fields have no default and must be written: run_id,
// objective.target_distribution, objective.primary_metric, every budget,
// stop_rules, every artifact id and at least one reward component. Default
// returns the complete contract of the built-in demo, identity included.
//
// The package is pure: no I/O beyond Load, no global state.
package contract

import (
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/schemas"
)

// Contract is the learning contract. Field comments give the YAML key, the
// default filled by Resolve (if any) and the validation rule. Besides the
// rules given there, every integer count (sizes, turns, tokens per action
// and episode, retries, epochs, minibatches, lags, partitions, tasks and groups
// per update, eval_every) is at most MaxCount, and every millisecond
// timeout at most MaxDurationMS, with sampler.max_turns times
// (sampler.tool_timeout_ms + policy.timeout_ms) at most MaxDurationMS too.
type Contract struct {
	// RunID names the run (required): 1..128 characters from
	// [A-Za-z0-9._-]; it enters record ids and snapshot paths.
	RunID string `yaml:"run_id"`
	// Seed is the contract seed every random stream derives from
	// (schemas.SeedFor). Default 1.
	Seed int64 `yaml:"seed"`

	Objective Objective `yaml:"objective"`
	Budgets   Budgets   `yaml:"budgets"`
	// StopRules end the run (docs/PIPELINE.md §2, §17); at least one, each kind at
	// most once. YAML: a list of strings, see ParseStopRule.
	StopRules []StopRule `yaml:"stop_rules"`
	Artifacts Artifacts  `yaml:"artifacts"`
	Sampler   Sampler    `yaml:"sampler"`
	// Estimator declares returns and advantages (docs/PIPELINE.md §10). Defaults:
	// name grpo, normalize_std true, std_mode sample, epsilon 1e-6, gamma 1,
	// lambda 0.95, zero_variance keep, min_group_size = sampler.group_size
	// (full groups only), bootstrap_truncations empty. Rules: name grpo,
	// rloo or gae; std_mode sample or population; epsilon >= 0; gamma and
	// lambda in [0, 1]; zero_variance keep, drop or penalize_failed (grpo
	// and rloo only), and not drop with sampler.group_size 1 (a single
	// return has zero variance: every group would be dropped);
	// 1 <= min_group_size <= sampler.group_size, and >= 2 for rloo;
	// bootstrap_truncations distinct and non-empty. Conditional keys (see
	// conditionals), refused where written and unused: normalize_std with
	// grpo only, epsilon with grpo and normalize_std true only, lambda with
	// gae only.
	Estimator advantage.Options `yaml:"estimator"`
	Loss      Loss              `yaml:"loss"`
	// Packing declares sequence packing and the lag-aware admission window
	// (docs/PIPELINE.md §11, docs/PIPELINE.md §15). Rules: token_budget in [1, 2^31-1];
	// batch_tokens >= token_budget; batch_groups >= 0 (0 = off); overflow
	// and stale_policy known; max_lag >= 0; multi_policy per_segment,
	// new_segments or discard. Defaults: token_budget 1024, batch_tokens
	// 65536, batch_groups = dispatch.groups_per_update, overflow reject,
	// max_lag 1, stale_policy drop, multi_policy per_segment (each turn
	// trained with its own version's behavior log-probs, pack.MultiPolicy*).
	// The lag rule holds again at the trainer's update (operators/train).
	// multi_policy applies only where a trajectory can carry several
	// policy versions (dispatch.mode async with partial_rollouts continue
	// or a policy server) and is refused written elsewhere.
	Packing pack.Options `yaml:"packing"`
	// Rewards are the separately kept reward components (docs/PIPELINE.md §8); at
	// least one, names unique.
	Rewards  []Reward `yaml:"rewards"`
	Topics   Topics   `yaml:"topics"`
	Dispatch Dispatch `yaml:"dispatch"`
	// Latency is the simulated latency of the built-in environment and
	// policy (docs/SYSTEMS.md §6); every field 0 (the default) is none.
	Latency Latency `yaml:"latency"`
	// Policy names the policy servers rollout generates with (systems
	// §3). It is not part of the contract hash (see Canonical).
	Policy Policy `yaml:"policy" contract:"unhashed"`

	// set holds the key paths written by the parsed document; filled marks
	// a contract whose defaults have been applied (Resolve, Default);
	// recorded marks a contract a run recorded (Recorded).
	set      map[string]bool
	filled   bool
	recorded bool
}

// Objective fixes what success means (docs/PIPELINE.md §2).
type Objective struct {
	TargetDistribution string `yaml:"target_distribution"` // required: the task mixture trained for
	PrimaryMetric      string `yaml:"primary_metric"`      // required: the metric promotion decides on
	// Constraints are hard upper bounds: metric name -> largest allowed
	// value (e.g. unsafe_action_rate: 0, p95_turns: 30). Values finite.
	Constraints map[string]float64 `yaml:"constraints"`
	// RegressionFloors are lower bounds on evaluation metrics: absolute
	// ("tool_schema_holdout: 0.75") or relative to the initial policy
	// ("base_knowledge_eval: 0.98_of_initial").
	RegressionFloors map[string]Floor `yaml:"regression_floors"`
	// KLLimit is the mean per-token KL(policy || reference) above which an
	// update counts toward a kl_above_limit_for_N_updates stop rule. It must
	// be > 0 when that rule is declared, and >= 0 otherwise. No default.
	KLLimit float64 `yaml:"kl_limit"`
}

// Floor is a regression floor. YAML: a number (absolute) or the string
// "<x>_of_initial" (relative to the initial policy's value).
type Floor struct {
	Value    float64
	Relative bool // Value is a fraction of the initial policy's metric
}

// Threshold is the smallest allowed metric value given the initial policy's
// value of the metric.
func (f Floor) Threshold(initial float64) float64 {
	if f.Relative {
		return f.Value * initial
	}
	return f.Value
}

// Budgets are the compute and data budgets (docs/PIPELINE.md §2); all required and
// > 0. Integer fields accept integral floats ("2.0e9").
type Budgets struct {
	RolloutTokens    int64   `yaml:"rollout_tokens"`    // tokens sampled by rollout
	OptimizerTokens  int64   `yaml:"optimizer_tokens"`  // tokens consumed by the optimizer
	EnvironmentHours float64 `yaml:"environment_hours"` // environment wall-clock hours
	AcceleratorHours float64 `yaml:"accelerator_hours"` // accelerator hours, rollout and training
}

// Artifacts names every frozen input by an immutable identifier (pipeline
// §3). Every id is required, has no whitespace, and is not a floating
// reference ("latest", "HEAD", "...:latest", "...@latest").
type Artifacts struct {
	PolicyCheckpoint string `yaml:"policy_checkpoint"` // base/SFT checkpoint (also the KL reference)
	Tokenizer        string `yaml:"tokenizer"`         // tokenizer and vocabulary
	ChatTemplate     string `yaml:"chat_template"`
	ToolSchemas      string `yaml:"tool_schemas"` // tool schemas and structured-output grammar
	TaskCorpus       string `yaml:"task_corpus"`
	SplitManifest    string `yaml:"split_manifest"`
	Environment      string `yaml:"environment"` // environment image and snapshot
	Validator        string `yaml:"validator"`
	RewardModel      string `yaml:"reward_model"` // reward-model/judge checkpoint and rubric
	CodeRevision     string `yaml:"code_revision"`
	ContainerImage   string `yaml:"container_image"` // dependency/container image
}

// Sampler is the resolved behavior sampler (docs/PIPELINE.md §5). Its hash
// (SamplerID) is recorded with every trajectory.
type Sampler struct {
	Temperature float64 `yaml:"temperature"` // > 0; default 1
	TopP        float64 `yaml:"top_p"`       // in (0, 1]; default 1 (off)
	TopK        int     `yaml:"top_k"`       // >= 0; 0 = off (default)
	MinP        float64 `yaml:"min_p"`       // in [0, 1); 0 = off (default); 0 with a policy server (its client sends 0)
	// MaxTokensPerAction bounds one sampled action; > 0, default 32.
	MaxTokensPerAction int `yaml:"max_tokens_per_action"`
	// MaxTokensPerEpisode bounds the episode's whole token stream
	// (prompts, actions and observations); >= max_tokens_per_action,
	// default 512.
	MaxTokensPerEpisode int `yaml:"max_tokens_per_episode"`
	MaxTurns            int `yaml:"max_turns"` // > 0; default 8
	// StopTokenIDs end an action when sampled; each >= 0, distinct.
	// Default empty.
	StopTokenIDs []int32 `yaml:"stop_token_ids"`
	// GroupSize is G, trajectories per group; >= 1, >= 2 for grpo and
	// rloo and with estimator.zero_variance drop; default 8.
	GroupSize     int   `yaml:"group_size"`
	ToolTimeoutMS int64 `yaml:"tool_timeout_ms"` // > 0; default 5000
	// ToolRetries is how often an infrastructure failure of a tool call is
	// retried; >= 0, default 2.
	ToolRetries int `yaml:"tool_retries"`
}

// Loss declares the policy objective (docs/PIPELINE.md §13) and the optimizer
// (docs/PIPELINE.md §14). Defaults of the objective: clip_low 0.2, clip_high 0.2,
// normalization token-mean, kl_placement none, kl_estimator k3, kl_coef 0,
// entropy_coef 0, max_log_ratio objective.DefaultMaxLogRatio (20: ratios
// within [e^-20, e^20]; a sane run never reaches it, on policy the ratio
// is exactly 1; 0 turns the clamp off, and a ratio that then overflows
// refuses the batch).
//
// Off-policy correction (docs/PIPELINE.md §13, §15): off_policy none (default:
// the clipped ratio to the behavior policy), tis (truncated importance
// sampling against the behavior policy, weight min(π/μ, is_cap)) or
// decoupled (the decoupled clipped objective: weight π_prox/μ, capped at
// is_cap when set, times the surrogate clipped against π_prox, the policy
// at the start of the update); on policy both have ratio and weight
// exactly 1. is_cap default 0.
//
// normalization token-sum divides the sum over the batch's trained tokens
// by norm_tokens, a constant (> 0, and 0 with every other normalization):
// a batch with few trained tokens then takes a small step, where
// token-mean gives it the full one (docs/PIPELINE.md §13).
//
// KL to the reference (docs/PIPELINE.md §12, §13): with kl_placement loss the
// trainer computes every packed row's reference log-probs with the initial
// policy, frozen, and adds kl_coef times the kl_estimator (k1, k2 or k3)
// of the KL to the loss; placement reward is refused as not implemented.
//
// Rules: clip_low in [0, 1); clip_high >= 0; kl_estimator k1, k2 or k3;
// kl_coef > 0 when kl_placement is loss and 0 otherwise; entropy_coef >= 0; max_log_ratio
// >= 0; off_policy known; is_cap 0 or >= 1, set with tis, 0 with none;
// entropy_coef and optimizer.lr at most math.MaxFloat32 (the CUDA kernels
// take entropy_coef as a float32; an Adam step moves a float32 parameter
// by about lr). Refused where written and unused: clip_low and clip_high
// with off_policy tis, kl_estimator with kl_placement none.
type Loss struct {
	objective.Options `yaml:",inline"`
	Optimizer         Optimizer `yaml:"optimizer"`
}

// Optimizer declares the Adam update (docs/PIPELINE.md §14).
type Optimizer struct {
	LR          float64 `yaml:"lr"`          // > 0; default 1e-3
	Beta1       float64 `yaml:"beta1"`       // in [0, 1); default 0.9
	Beta2       float64 `yaml:"beta2"`       // in [0, 1); default 0.999
	Eps         float64 `yaml:"eps"`         // > 0; default 1e-8
	GradClip    float64 `yaml:"grad_clip"`   // global-norm clip; >= 0, 0 = off; default 1
	Epochs      int     `yaml:"epochs"`      // passes over each batch; >= 1, default 1
	Minibatches int     `yaml:"minibatches"` // optimizer steps per epoch; >= 1, default 1
}

// Reward transforms. A component's value is Weight * transform(raw)
// (schemas.RewardComponent).
const (
	TransformIdentity = "identity" // f(x) = x
	TransformClip     = "clip"     // f(x) = min(max(x, clip_min), clip_max); needs clip_min < clip_max
	TransformTanh     = "tanh"     // f(x) = tanh(x), squashes into (-1, 1)
	TransformNegate   = "negate"   // f(x) = -x, for costs (tool_cost, latency_cost, ...)
)

// RewardKL is the name of the reward component that carries a KL penalty
// when loss.kl_placement is reward (docs/PIPELINE.md §8: in reward or in loss, never
// both).
const RewardKL = "kl"

// Reward declares one reward component (docs/PIPELINE.md §8).
type Reward struct {
	Name    string  `yaml:"name"`    // required, unique
	Version string  `yaml:"version"` // required: evaluator/validator version
	Weight  float64 `yaml:"weight"`  // finite; default 1
	// Transform is one of the Transform* constants; default identity.
	Transform string `yaml:"transform"`
	// ClipMin and ClipMax bound TransformClip and must be 0 for every other
	// transform.
	ClipMin float64 `yaml:"clip_min"`
	ClipMax float64 `yaml:"clip_max"`
	// Scope is schemas.ScopeTrajectory, ScopeTurn or ScopeSpan; default
	// trajectory.
	Scope string `yaml:"scope"`
	// RawRange, when written, is the closed interval [lo, hi] the
	// evaluator's raw score (before transform and weight) must lie in; a
	// score outside it sends the trajectory to quarantine
	// (reward_out_of_range, docs/PIPELINE.md §9 "reward ranges"). Two finite
	// numbers, lo <= hi; empty means unchecked.
	RawRange []float64 `yaml:"raw_range"`
}

// defaultReplication is topics.replication unless a document writes it.
const defaultReplication = 1

// Topics declares how the data-plane topics are created (docs/PIPELINE.md §15, Wire
// format).
type Topics struct {
	Partitions int `yaml:"partitions"` // > 0; default 4
	// Replication is in [1, 32767] (Kafka's int16); default 1. Written,
	// it is the factor `trajflow topics create` asks for; unwritten, that
	// command decides by the cluster's size (operators.ReplicationRequest),
	// and YAML leaves it out so that a document printed from a contract
	// behaves as the contract does.
	Replication int `yaml:"replication"`
	// RetentionMS is the topic retention; > 0, or -1 for unlimited.
	// Default 604800000 (7 days).
	RetentionMS int64 `yaml:"retention_ms"`
	// MaxMessageBytes is the topic's max.message.bytes, large enough for
	// long trajectories; in [1, 2^30] (1 GiB), default 16777216 (16 MiB).
	MaxMessageBytes int `yaml:"max_message_bytes"`
	// Compression is the producer compression of topics: short topic name
	// (batches, census, ...) -> none, gzip, snappy, lz4 or zstd; a topic
	// left out is not compressed. Default {} (none): packed batches
	// shrink about 4.6x with snappy or lz4, which takes much of the load
	// off the broker and the network, but kafka-go consumers hold about
	// twice a batch's size per partition to decompress it; trajectories
	// shrink only 1.1-1.2x, too little to pay for the codec
	// (docs/ARCHITECTURE.md "Compressed topics"). Consumers read the same
	// value bytes whatever the codec, so it is not part of the contract
	// hash: it says how records travel, not what they are.
	Compression map[string]string `yaml:"compression" contract:"unhashed"`
}

// Dispatch declares what the dispatcher launches per update (docs/PIPELINE.md §6).
type Dispatch struct {
	// TasksPerUpdate distinct tasks are drawn per update; >= 1 and divides
	// groups_per_update (each task gets the same number of groups).
	// Default 4.
	TasksPerUpdate int `yaml:"tasks_per_update"`
	// GroupsPerUpdate groups of sampler.group_size attempts are launched
	// per update; >= 1, default 4.
	GroupsPerUpdate int `yaml:"groups_per_update"`
	// DomainQuotas caps the share of an update's groups drawn from a
	// domain: domain -> fraction in (0, 1]. Default empty (no caps).
	DomainQuotas map[string]float64 `yaml:"domain_quotas"`
	// EvalEvery runs the hidden evaluation every that many updates; >= 1,
	// default 5. The built-in policy only (the evaluation plane runs it in
	// process): refused written with a policy server.
	EvalEvery int `yaml:"eval_every"`
	// Mode is how dispatch paces rounds (docs/PIPELINE.md §15): DispatchSync
	// (stop and synchronize: round r+1 is dispatched only once every group
	// of round r has been decided by pack and, when they made a batch, the
	// trainer has released the resulting policy) or DispatchAsync (up to
	// packing.max_lag+1 rounds in flight, each at the latest released
	// version). In both, the pack window counts decided groups, admitted
	// or filtered, towards packing.batch_groups. Default sync.
	Mode string `yaml:"mode"`
	// PartialRollouts is what an episode in flight does at an update
	// boundary (docs/SYSTEMS.md §7): PartialFinish (default) finishes it on the
	// policy snapshot it started with; PartialContinue keeps its
	// environment and agent state, token history and remaining budget and
	// continues it with the newer policy from its next turn, every turn
	// keeping the version that sampled it (packing.multi_policy decides
	// how such trajectories train). Only asynchronous rounds meet a
	// boundary mid-episode: continue written with mode sync is refused.
	PartialRollouts string `yaml:"partial_rollouts"`
}

// Partial-rollout rules (dispatch.partial_rollouts).
const (
	PartialFinish   = "finish"
	PartialContinue = "continue"
)

// Latency declares the simulated latency of the built-in environment and
// policy (docs/SYSTEMS.md §6: heavy-tailed tool calls and generation, so that a
// synchronous round waits for its stragglers as real agent workloads do).
// Log-normal: every tool call waits tool_median_ms·e^{tool_sigma·z}, every
// generated token token_median_ms·e^{token_sigma·z'}, z and z' standard
// normal drawn from the contract seed and the turn id (cut at ±4), so two
// runs of one seed wait alike, whatever their pacing; tokens never depend
// on it (rollout.LatencyModel). Defaults 0 (off). Rules: every value
// finite and >= 0; sigmas <= 3, and 0 where their median is 0 (which draws
// no latency); medians <= MaxLatencyMedianMS (one hour).
type Latency struct {
	ToolMedianMS  float64 `yaml:"tool_median_ms"`
	ToolSigma     float64 `yaml:"tool_sigma"`
	TokenMedianMS float64 `yaml:"token_median_ms"`
	TokenSigma    float64 `yaml:"token_sigma"`
}

// Dispatch modes.
const (
	DispatchSync  = "sync"
	DispatchAsync = "async"
)

// Policy protocols (policy.protocol).
const (
	PolicyBuiltin  = "builtin"  // the built-in window-MLP, in process
	PolicyLlamaCpp = "llamacpp" // llama.cpp's llama-server (POST /completion)
	PolicySGLang   = "sglang"   // SGLang's native API (POST /generate)
	PolicyVLLM     = "vllm"     // vLLM's token-in/token-out API
)

// Policy declares where rollout generates (docs/SYSTEMS.md §3, §8): in process
// with the built-in policy, or on policy server replicas of one protocol
// behind a gateway (least outstanding requests, group affinity, health
// checks, breakers, retries), with weight sync (trajflow run weightsync)
// loading every release into every replica. The section is deployment: it
// is left out of the contract hash.
type Policy struct {
	// Protocol is builtin (default), llamacpp, sglang or vllm.
	Protocol string `yaml:"protocol"`
	// Endpoints are the replicas' base URLs ("http://host:port"): none for
	// builtin, at least one otherwise, distinct.
	Endpoints []string `yaml:"endpoints"`
	// TimeoutMS bounds one generation request to a replica; > 0, default
	// 60000. A request past it is an infrastructure failure (retried).
	// TimeoutMS, Retries and Concurrency are the gateway's: refused written
	// with protocol builtin.
	TimeoutMS int64 `yaml:"timeout_ms"`
	// Retries is how often the gateway sends a request that failed for a
	// reason of the infrastructure again, each time to another replica;
	// >= 0, default 2. A group whose requests still fail is run again by
	// rollout (sampler.tool_retries).
	Retries int `yaml:"retries"`
	// Concurrency bounds the requests in flight to one replica; >= 1,
	// default 8.
	Concurrency int `yaml:"concurrency"`
	// Router (llamacpp only): the servers are llama-server routers
	// (--models-dir) over one model per policy version, named
	// policy-vNNNNNNNN (the release's file name, policy.ModelName);
	// requests name the model of their version and weight sync loads each
	// release. false: single-model servers (-m FILE) serving release 0
	// only. Default false.
	Router bool `yaml:"router"`
}

// Default returns the complete, valid contract of the built-in demo (the
// same values as testdata/contracts/demo.yaml). Its knob values are the
// defaults Resolve fills, except those demoKnobs sets for the demo's task
// (sampler budgets, group size, estimator, loss, packing, dispatch); its
// identity fields (run_id, objective, budgets, stop_rules, artifacts,
// rewards) are the demo's own and are never filled into other contracts.
func Default() *Contract {
	c := knobDefaults()
	demoKnobs(c)
	c.RunID = "demo"
	c.Objective = Objective{
		TargetDistribution: "builtin_tool_tasks_v1",
		PrimaryMetric:      "verified_success_rate",
		Constraints: map[string]float64{
			"unsafe_action_rate": 0,
			"p95_turns":          4,
		},
		RegressionFloors: map[string]Floor{
			"eval_success_rate": {Value: 0.95, Relative: true},
		},
		KLLimit: 5,
	}
	c.Budgets = Budgets{
		RolloutTokens:    20_000_000,
		OptimizerTokens:  20_000_000,
		EnvironmentHours: 1,
		AcceleratorHours: 1,
	}
	c.StopRules = []StopRule{
		{Kind: StopSafetyViolation},
		{Kind: StopNoValidationGain, N: 10},
		{Kind: StopKLAboveLimit, N: 3},
		{Kind: StopBudgetExhausted},
	}
	c.Artifacts = Artifacts{
		PolicyCheckpoint: "builtin:policy/tiny-window-mlp@v1",
		Tokenizer:        "builtin:tokenizer/kv@v1",
		ChatTemplate:     "builtin:chat-template/kv@v1",
		ToolSchemas:      "builtin:tools/kv-lookup@v1",
		TaskCorpus:       "builtin:tasks/kv@v1",
		SplitManifest:    "builtin:splits/kv-256-train-64-eval@v1",
		Environment:      "builtin:env/kv-env@v1",
		Validator:        "builtin:validator/kv_success@1",
		RewardModel:      "none@v1",
		CodeRevision:     "trajflow@v0",
		ContainerImage:   "none@v1",
	}
	c.Rewards = []Reward{
		{Name: "kv_success", Version: "1", Weight: 1, Transform: TransformIdentity, Scope: schemas.ScopeTrajectory},
	}
	c.Packing.BatchGroups = c.Dispatch.GroupsPerUpdate
	c.filled = true
	return c
}

// demoKnobs sets the knobs in which the built-in demo departs from the
// general defaults: the kv tool task (actions of at most 3 tokens ending at
// the END token 9, 4 turns, 64 tokens per episode), groups of 16 attempts
// of 16 tasks per update, GRPO with population std that trains a group
// that failed whole with advantage -1/4 (= -1/sqrt(16)) and drops a group
// that succeeded whole (zero_variance penalize_failed), a clipped
// surrogate with asymmetric clip [0.8, 1.28] summed over the batch's
// tokens and divided by 4096 (token-sum: a late batch of a few hundred
// tokens takes a small step, not a full one of noise) and entropy bonus
// 0.1, Adam lr 0.01 with 4 optimizer passes per batch,
// 256-token rows, and strictly on-policy admission (max_lag 0) in
// stop-and-synchronize mode (docs/PIPELINE.md §15). The objective is the decoupled
// one (clipped against the trainer's policy at the start of the update):
// on policy, as in stop-and-synchronize mode, it is the plain clipped
// surrogate bit for bit; with --async it keeps stale samples useful.
func demoKnobs(c *Contract) {
	c.Sampler.MaxTokensPerAction = 3
	c.Sampler.MaxTokensPerEpisode = 64
	c.Sampler.MaxTurns = 4
	c.Sampler.StopTokenIDs = []int32{9}
	c.Sampler.GroupSize = 16
	c.Estimator.StdMode = advantage.StdPopulation
	c.Estimator.ZeroVariance = advantage.ZeroVarPenalizeFailed
	c.Estimator.MinGroupSize = 1
	c.Loss.ClipHigh = 0.28
	c.Loss.Normalization = objective.TokenSum
	c.Loss.NormTokens = 4096
	c.Loss.EntropyCoef = 0.1
	c.Loss.OffPolicy = objective.OffPolicyDecoupled
	c.Loss.Optimizer.LR = 0.01
	c.Loss.Optimizer.Epochs = 4
	c.Packing.TokenBudget = 256
	c.Packing.BatchTokens = 1 << 30
	c.Packing.MaxLag = 0
	c.Dispatch.TasksPerUpdate = 16
	c.Dispatch.GroupsPerUpdate = 16
}

// knobDefaults holds the values Resolve fills. Identity fields stay empty;
// the two cross-field defaults (estimator.min_group_size,
// packing.batch_groups) are filled by fillDefaults after the fields they
// copy.
func knobDefaults() *Contract {
	return &Contract{
		Seed: 1,
		Sampler: Sampler{
			Temperature:         1,
			TopP:                1,
			MaxTokensPerAction:  32,
			MaxTokensPerEpisode: 512,
			MaxTurns:            8,
			GroupSize:           8,
			ToolTimeoutMS:       5000,
			ToolRetries:         2,
		},
		Estimator: advantage.Options{
			Estimator:    advantage.GRPO,
			NormalizeStd: true,
			StdMode:      advantage.StdSample,
			Epsilon:      1e-6,
			Gamma:        1,
			Lambda:       0.95,
			ZeroVariance: advantage.ZeroVarKeep,
		},
		Loss: Loss{
			Options: objective.Options{
				ClipLow:       0.2,
				ClipHigh:      0.2,
				Normalization: objective.TokenMean,
				KLPlacement:   objective.KLNone,
				KLEstimator:   objective.K3,
				MaxLogRatio:   objective.DefaultMaxLogRatio,
				OffPolicy:     objective.OffPolicyNone,
			},
			Optimizer: Optimizer{
				LR:          1e-3,
				Beta1:       0.9,
				Beta2:       0.999,
				Eps:         1e-8,
				GradClip:    1,
				Epochs:      1,
				Minibatches: 1,
			},
		},
		Packing: pack.Options{
			TokenBudget: 1024,
			BatchTokens: 65536,
			Overflow:    pack.OverflowReject,
			MaxLag:      1,
			StalePolicy: pack.StaleDrop,
			MultiPolicy: pack.MultiPolicySegments,
		},
		Topics: Topics{
			Partitions:      4,
			Replication:     defaultReplication,
			RetentionMS:     604_800_000,
			MaxMessageBytes: 16 << 20,
		},
		Dispatch: Dispatch{
			TasksPerUpdate:  4,
			GroupsPerUpdate: 4,
			EvalEvery:       5,
			Mode:            DispatchSync,
			PartialRollouts: PartialFinish,
		},
		Policy: Policy{
			Protocol:    PolicyBuiltin,
			TimeoutMS:   60_000,
			Retries:     2,
			Concurrency: 8,
		},
	}
}

// defaultReward holds the per-component defaults Resolve fills.
var defaultReward = Reward{Weight: 1, Transform: TransformIdentity, Scope: schemas.ScopeTrajectory}
