package validate

// Options are the expectations a run places on its trajectories, taken from
// the learning contract and the frozen artifacts (docs/PIPELINE.md §2, §3, §9).
// Every zero-valued field disables its check, so Options{} checks only the
// structural invariants that hold for any run.
type Options struct {
	// VocabSize is the tokenizer's vocabulary size: every token id must lie
	// in [0, VocabSize). When 0, only negative ids are rejected.
	VocabSize int32
	// ContractHash is the hash of the run's learning contract; a trajectory
	// produced under another contract is a version mismatch. "" = any.
	ContractHash string
	// TokenizerHash is the hash of the frozen tokenizer. "" = any.
	TokenizerHash string
	// ParserVersions lists the accepted agent parser versions. Empty = any.
	ParserVersions []string
	// EnvVersions lists the accepted environment versions. Empty = any.
	EnvVersions []string
	// EvalDenylist reports whether a task id belongs to the hidden
	// evaluation registry (docs/PIPELINE.md §1, §16). A trajectory of such a task in
	// the training stream is an incident ("eval_task_id"), as is any
	// trajectory whose Split is schemas.SplitEval. nil = no denylist.
	EvalDenylist func(taskID string) bool
	// MaxTurns, MaxTokensPerAction and MaxTokensPerEpisode are the
	// contract's budgets; 0 = unlimited. Episode tokens count the whole
	// training stream: prompt, action and observation tokens of every turn.
	MaxTurns            int
	MaxTokensPerAction  int
	MaxTokensPerEpisode int
	// TimeoutIsTruncation declares wall-clock timeouts part of the task: a
	// StatusTimedOut trajectory is then accepted as a truncation (End must
	// be truncated with a reason). By default a timeout is an
	// infrastructure failure ("timed_out"): it says more about the
	// environment or the serving fleet than about the policy, and treating
	// it as a task failure would bias training against slow-but-correct
	// behavior (docs/SYSTEMS.md §6 on completion-time filtering).
	TimeoutIsTruncation bool
	// BootstrapReasons lists the truncation reasons from which the
	// advantage stage bootstraps with BootstrapValue (docs/PIPELINE.md §10); such a
	// trajectory must carry a finite BootstrapValue. Same meaning as
	// advantage.Options.BootstrapReasons.
	BootstrapReasons []string
	// IncidentEndReasons lists EndReason values that are safety or
	// permission incidents (docs/PIPELINE.md §8: hard violations quarantine the
	// episode and trigger the incident path instead of subtracting reward).
	IncidentEndReasons []string
	// LogprobTolerance is how far above 0 a behavior log-prob may lie
	// before it is rejected, to absorb rounding of a log-softmax of a
	// near-certain token. Default 0: any positive log-prob is rejected.
	LogprobTolerance float32
}

// DenySet returns an EvalDenylist that reports membership in ids.
func DenySet(ids ...string) func(taskID string) bool {
	set := make(map[string]struct{}, len(ids))
	for _, id := range ids {
		set[id] = struct{}{}
	}
	return func(taskID string) bool {
		_, ok := set[taskID]
		return ok
	}
}
