package schemas

// This file holds the Go row types of every record kind. Each kind has its
// own file with its Arrow schema and codec (task.go, trajectory.go, ...).
//
// Token-level conventions (docs/PIPELINE.md §7, §11):
//   - Token ids are int32 and are exactly those returned by the policy; they
//     are never re-derived from text.
//   - A trajectory is a sequence of turns. The training token stream of a
//     trajectory is, turn by turn, PromptIDs ++ ActionIDs ++ ObservationIDs.
//     PromptIDs of turn 0 is the rendered system+user prompt; PromptIDs of a
//     later turn holds only the template tokens the agent renders between the
//     previous observation and this action (prompts are stored as deltas, so
//     storage stays linear in the episode length).
//   - Only ActionIDs were sampled by the policy; only they are ever training
//     targets. Observations are context.
//   - ActionLogprobs[i] is the log-probability of ActionIDs[i] under the
//     actual sampling distribution (after temperature, top-k/top-p and masks,
//     docs/PIPELINE.md §5).

// Split of the task registry a task belongs to.
const (
	SplitTrain = "train"
	SplitEval  = "eval"
)

// Decision of the parser/authorizer for one turn (docs/PIPELINE.md §7).
const (
	DecisionOK      = "ok"      // parsed and authorized; the environment stepped
	DecisionInvalid = "invalid" // the parser rejected the action
	DecisionDenied  = "denied"  // parsed, but the authorizer refused it
)

// Status of an attempt.
const (
	StatusCompleted = "completed" // the episode ended (terminated or truncated)
	StatusFailed    = "failed"    // the task failed for a reason of the agent
	StatusTimedOut  = "timed_out" // the episode exceeded its wall-clock budget
	StatusInfra     = "infra"     // infrastructure-invalid: retried, never a task failure
)

// Ending of an episode: termination is a true end of the MDP; truncation is
// an external cut (turn or token budget, timeout). GAE bootstraps only from
// truncations the contract declares (docs/PIPELINE.md §10).
const (
	EndTerminated = "terminated"
	EndTruncated  = "truncated"
)

// TaskAttempt is one unit of work emitted by dispatch (docs/PIPELINE.md §6): the
// curriculum's (task_id, environment_version, seed, group_id), the group
// membership reserved for it, and the behavior policy version attached.
type TaskAttempt struct {
	AttemptID     string `json:"attempt_id"`
	RunID         string `json:"run_id"`
	TaskID        string `json:"task_id"`
	TaskVersion   string `json:"task_version"`
	Domain        string `json:"domain"`
	Split         string `json:"split"`
	EnvVersion    string `json:"env_version"`
	GroupID       string `json:"group_id"`
	GroupSize     int32  `json:"group_size"`
	Member        int32  `json:"member"`
	Attempt       int32  `json:"attempt"`
	Seed          int64  `json:"seed"`
	PolicyVersion int64  `json:"policy_version"`
	ContractHash  string `json:"contract_hash"`
	DispatchedAt  int64  `json:"dispatched_at_us"` // unix microseconds
}

// Turn is one decision step of an episode.
type Turn struct {
	Index          int32     `json:"index"`
	PromptIDs      []int32   `json:"prompt_ids"`
	ActionIDs      []int32   `json:"action_ids"`
	ActionLogprobs []float32 `json:"action_logprobs"`
	PolicyVersion  int64     `json:"policy_version"` // the version that sampled ActionIDs
	Decision       string    `json:"decision"`       // DecisionOK / DecisionInvalid / DecisionDenied
	DecisionReason string    `json:"decision_reason"`
	ObservationIDs []int32   `json:"observation_ids"`
	// Value is the critic's prediction for the state before this turn's
	// action; NaN when no critic ran. Used only by GAE.
	Value        float32 `json:"value"`
	GenLatencyUS int64   `json:"gen_latency_us"`
	EnvLatencyUS int64   `json:"env_latency_us"`
}

// Trajectory is the immutable event log of one attempt, as the agent loop
// finalizes it (docs/PIPELINE.md §7).
type Trajectory struct {
	RecordID      string `json:"record_id"` // == AttemptID of the attempt
	RunID         string `json:"run_id"`
	TaskID        string `json:"task_id"`
	TaskVersion   string `json:"task_version"`
	Domain        string `json:"domain"`
	Split         string `json:"split"`
	EnvVersion    string `json:"env_version"`
	GroupID       string `json:"group_id"`
	GroupSize     int32  `json:"group_size"`
	Member        int32  `json:"member"`
	Attempt       int32  `json:"attempt"`
	Seed          int64  `json:"seed"`
	ContractHash  string `json:"contract_hash"`
	SamplerID     string `json:"sampler_id"` // hash of the resolved sampler (docs/PIPELINE.md §5)
	ParserVersion string `json:"parser_version"`
	TokenizerHash string `json:"tokenizer_hash"`
	// ChatTemplateHash is the policy server's chat template that rendered
	// the prompts and observations ("sha256:<hex>"; "" when no template
	// rendered them: the token families speak ids).
	ChatTemplateHash string `json:"chat_template_hash"`
	Status           string `json:"status"`     // Status*
	End              string `json:"end"`        // EndTerminated / EndTruncated
	EndReason        string `json:"end_reason"` // e.g. "answer", "max_turns", "token_budget"
	// BootstrapValue is the critic's value of the state after the last turn;
	// used only when the episode was truncated for a bootstrappable reason.
	BootstrapValue float32 `json:"bootstrap_value"`
	// Artifacts is environment evidence for the trusted validator (JSON);
	// it is never shown to the policy.
	Artifacts  string `json:"artifacts"`
	StartedAt  int64  `json:"started_at_us"`
	FinishedAt int64  `json:"finished_at_us"`
	Turns      []Turn `json:"turns"`
}

// Scope of a reward component (docs/PIPELINE.md §8).
const (
	ScopeTrajectory = "trajectory"
	ScopeTurn       = "turn"
	ScopeSpan       = "span"
)

// RewardComponent is one separately kept, versioned reward term (pipeline
// §8). Value = Weight * transform(Raw). Components with a non-empty Error
// are unavailable, not zero.
type RewardComponent struct {
	TrajectoryID     string  `json:"trajectory_id"`
	Name             string  `json:"name"`
	Version          string  `json:"version"`
	Raw              float64 `json:"raw"`
	Weight           float64 `json:"weight"`
	Transform        string  `json:"transform"`
	Value            float64 `json:"value"`
	Scope            string  `json:"scope"`
	Turn             int32   `json:"turn"`       // turn index for ScopeTurn/ScopeSpan, -1 otherwise
	SpanStart        int32   `json:"span_start"` // action-token offsets within the turn for ScopeSpan
	SpanEnd          int32   `json:"span_end"`
	EvaluatorVersion string  `json:"evaluator_version"`
	Evidence         string  `json:"evidence"`
	Error            string  `json:"error"`
	Uncertainty      float64 `json:"uncertainty"`
}

// Rewarded is a validated trajectory with its reward components.
type Rewarded struct {
	Trajectory
	Rewards     []RewardComponent `json:"rewards"`
	RewardTotal float64           `json:"reward_total"`
}

// GroupStats are the statistics of a trajectory's group, recorded before any
// filtering or normalization (docs/PIPELINE.md §10).
type GroupStats struct {
	Size       int32   `json:"size"`       // members that contributed a return
	Expected   int32   `json:"expected"`   // declared group size G
	Mean       float64 `json:"mean"`       // mean return over contributing members
	Std        float64 `json:"std"`        // standard deviation (estimator's convention)
	Min        float64 `json:"min"`        //
	Max        float64 `json:"max"`        //
	ZeroVar    bool    `json:"zero_var"`   // all contributing returns equal
	Filtered   string  `json:"filtered"`   // "" when admitted, else the reason (e.g. "zero_variance")
	Incomplete bool    `json:"incomplete"` // fewer than Expected members contributed
}

// Scored is a rewarded trajectory with its returns and advantages.
// TurnReturns, TurnAdvantages and TurnValueTargets have one entry per turn;
// a turn advantage is broadcast to that turn's action tokens only.
type Scored struct {
	Rewarded
	TurnRewards      []float32  `json:"turn_rewards"`
	TurnReturns      []float32  `json:"turn_returns"`
	TurnAdvantages   []float32  `json:"turn_advantages"`
	TurnValueTargets []float32  `json:"turn_value_targets"`
	Group            GroupStats `json:"group"`
	Estimator        string     `json:"estimator"`
	EstimatorVersion string     `json:"estimator_version"`
}

// PackedRow is one packed training sequence: several trajectories
// (segments) concatenated into at most the token budget.
//
// Alignment (docs/PIPELINE.md §11, §12): InputIDs, PositionIDs and SegmentIDs are
// indexed by input position i. Every other per-token slice is aligned to
// the next-token target: entry i describes the prediction made at position
// i of target InputIDs[i+1]. The last position of each segment predicts
// nothing inside its segment, so its ActionMask is 0 there; the last entry
// of the row is always masked.
type PackedRow struct {
	InputIDs       []int32   `json:"input_ids"`
	PositionIDs    []int32   `json:"position_ids"` // restart at 0 in every segment
	SegmentIDs     []int32   `json:"segment_ids"`  // 0..len(Segments)-1
	ActionMask     []uint8   `json:"action_mask"`  // 1 iff target is a trained policy token
	OldLogprobs    []float32 `json:"old_logprobs"`
	RefLogprobs    []float32 `json:"ref_logprobs"` // nil when no reference ran
	Advantages     []float32 `json:"advantages"`
	ValueTargets   []float32 `json:"value_targets"`
	TurnIDs        []int32   `json:"turn_ids"`        // turn index of the target, -1 for context
	PolicyVersions []int32   `json:"policy_versions"` // behavior version of the target, -1 for context

	SegTrajectoryIDs  []string  `json:"segment_trajectory_ids"`
	SegGroupIDs       []string  `json:"segment_group_ids"`
	SegPolicyVersions []int64   `json:"segment_policy_versions"` // oldest behavior version among the segment's trained tokens
	SegLengths        []int32   `json:"segment_lengths"`
	SegWeights        []float32 `json:"segment_weights"`
	SegTruncated      []bool    `json:"segment_truncated"` // segment cut by the overflow rule
}

// PackedBatch is one global training batch: the rows that one update
// consumes, and the denominators its loss normalizes by.
type PackedBatch struct {
	BatchID        string `json:"batch_id"`
	BatchIndex     int64  `json:"batch_index"`
	RunID          string `json:"run_id"`
	ContractHash   string `json:"contract_hash"`
	TrainerVersion int64  `json:"trainer_version"` // policy version of the trainer when the window closed
	TokenBudget    int32  `json:"token_budget"`
	Rows           []PackedRow
}

// PolicyRelease is the manifest of one published policy (docs/SYSTEMS.md §8). It is
// written only after the checkpoint is complete, hashed and fsynced; Ready
// marks it usable.
type PolicyRelease struct {
	PolicyVersion    int64  `json:"policy_version"`
	TrainingStep     int64  `json:"training_step"`
	CheckpointHash   string `json:"checkpoint_hash"`
	CheckpointURI    string `json:"checkpoint_uri"`
	ModelConfigHash  string `json:"model_config_hash"`
	TokenizerHash    string `json:"tokenizer_hash"`
	ChatTemplateHash string `json:"chat_template_hash"`
	SamplerContract  string `json:"sampler_contract"`
	ContractHash     string `json:"contract_hash"`
	CreatedAt        string `json:"created_at"` // RFC 3339
	Ready            bool   `json:"ready"`
	// NextBatch says how far the trainer has come through the batches
	// topic: every batch index below it was consumed (trained, or skipped
	// as trained already) when this version was released. 0 for the
	// initial release and for a trainer that does not say. Dispatch paces
	// asynchronous rounds by it.
	NextBatch int64 `json:"next_batch,omitempty"`
	// CurriculumVersion and RewardVersion identify the curriculum (what
	// tasks are drawn, when and how) and the reward the release was
	// trained under (contract.CurriculumVersion and RewardVersion); a
	// release published by a rollback carries those of the release it
	// restored. Empty from a trainer that does not say.
	CurriculumVersion string `json:"curriculum_version,omitempty"`
	RewardVersion     string `json:"reward_version,omitempty"`
}

// Consumed is how many batches of the batches topic the trainer had
// consumed when it published r: NextBatch, or, for a trainer that does not
// say (NextBatch 0), its version (one batch per version). Not the version
// alone when NextBatch is given: a gate's rollback publishes a release
// without training a batch, after which the version runs ahead of the
// batches.
func (r PolicyRelease) Consumed() int64 {
	if r.NextBatch > 0 {
		return r.NextBatch
	}
	return r.PolicyVersion
}

// Census event kinds: the life of every attempt (docs/PIPELINE.md §6, §9; docs/SYSTEMS.md §6).
const (
	CensusDispatched  = "dispatched"
	CensusStarted     = "started"
	CensusCompleted   = "completed"
	CensusFailed      = "failed"
	CensusTimedOut    = "timed_out"
	CensusQuarantined = "quarantined"
	CensusFiltered    = "filtered"
	CensusAdmitted    = "admitted"
	CensusTrained     = "trained"
	// CensusRetried is one retry of an environment call that got no
	// answer or a refusal worth retrying (docs/SYSTEMS.md §12, §14): the rollout
	// stage writes one per retry its environment client made during a
	// group's run, with the client's reason ("timeout", "connection",
	// "status_timeout", "capacity", ...) and Infra set, on the attempt of
	// the group's first member. The attempt itself goes on: a retry is
	// not a failure (CensusFailed with Infra is the attempt run again).
	CensusRetried = "retried"
)

// CensusEvent is one step in the life of an attempt.
type CensusEvent struct {
	EventID       string `json:"event_id"` // deterministic: DerivedID(kind+stage, attempt id)
	RunID         string `json:"run_id"`
	AttemptID     string `json:"attempt_id"`
	TaskID        string `json:"task_id,omitempty"`
	GroupID       string `json:"group_id,omitempty"`
	Kind          string `json:"kind"`
	Stage         string `json:"stage"`
	Reason        string `json:"reason,omitempty"`
	Infra         bool   `json:"infra,omitempty"` // failure of infrastructure, not of the task
	BatchID       string `json:"batch_id,omitempty"`
	Update        int64  `json:"update,omitempty"`
	PolicyVersion int64  `json:"policy_version,omitempty"`
	Tokens        int64  `json:"tokens,omitempty"`
	// StaleTokens are policy tokens of the attempt taken out of training
	// by the lag rule (docs/PIPELINE.md §15): at pack (a trajectory filtered
	// "stale", or stale turns kept as context) or at the trainer's update
	// (ReasonStaleAtUpdate, or stale turns masked of a trained one).
	StaleTokens int64   `json:"stale_tokens,omitempty"`
	Reward      float64 `json:"reward,omitempty"`
	LatencyUS   int64   `json:"latency_us,omitempty"`
	At          int64   `json:"at_us"`
}
