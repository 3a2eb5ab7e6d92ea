package schemas

// Estimate is a measured value with its confidence interval [Lo, Hi] over
// N observations (Lo = Hi = Value when the metric has no interval).
type Estimate struct {
	Value float64 `json:"value"`
	Lo    float64 `json:"lo"`
	Hi    float64 `json:"hi"`
	N     int     `json:"n"`
}

// GateEvaluation is the part of an evaluation the gate decides on: every
// metric by name, and the count of unsafe actions of its safety suite.
type GateEvaluation struct {
	Version       int64               `json:"policy_version"`
	Metrics       map[string]Estimate `json:"metrics"`
	UnsafeActions int                 `json:"unsafe_actions"`
}

// SuiteResult is one evaluation suite's measurement of a release
// (docs/PIPELINE.md §16).
type SuiteResult struct {
	Suite  string `json:"suite"`
	Family string `json:"family"`
	// AttemptsHash is the SHA-256 of the suite's attempt ids and seeds:
	// equal for every release of a run (frozen ids and seeds).
	AttemptsHash string   `json:"attempts_hash"`
	Tasks        int      `json:"tasks"`
	Attempts     int      `json:"attempts"`
	Successes    int      `json:"successes"`
	Success      Estimate `json:"success"`
	// PassAtK (K = attempts per task), P95Turns and P95Cost (an
	// episode's rollout tokens): held-out only.
	K        int       `json:"k,omitempty"`
	PassAtK  *Estimate `json:"pass_at_k,omitempty"`
	P95Turns *Estimate `json:"p95_turns,omitempty"`
	P95Cost  *Estimate `json:"p95_cost,omitempty"`
	// Safety suite: episodes with an attempt at forbidden data, and
	// actions the environment executed on it.
	ForbiddenEpisodes int `json:"forbidden_episodes,omitempty"`
	ViolationEpisodes int `json:"violation_episodes,omitempty"`
	Violations        int `json:"violations,omitempty"`
}

// EvaluationRecord is the eval operator's measurement of one policy
// release, on the evaluations topic (keyed by run id, one partition, in
// release order): the KL to the reference policy on every release, every
// suite on release 0 and every dispatch.eval_every-th release, and what
// the update cost (for the budgets). The gate operator decides on it.
type EvaluationRecord struct {
	RunID         string `json:"run_id"`
	PolicyVersion int64  `json:"policy_version"`
	// RolledBackTo is set on a rollback's release: the parameters of
	// release RolledBackTo, published again; it is never evaluated.
	RolledBackTo *int64 `json:"rolled_back_to,omitempty"`
	// KL is the mean per-token KL (k3) of the release to the reference
	// policy on its validation episodes.
	KL Estimate `json:"kl_to_reference"`
	// Evaluation and Suites are set when every suite ran on the release.
	Evaluation *GateEvaluation `json:"evaluation,omitempty"`
	Suites     []SuiteResult   `json:"suites,omitempty"`
	// OptimizerTokens (tokens x epochs) and StepSeconds are the update's,
	// from its update record (0 for release 0 and a rollback's release).
	OptimizerTokens int64   `json:"optimizer_tokens"`
	StepSeconds     float64 `json:"step_seconds"`
	// Final marks the final evaluation of a run with a round limit: every
	// suite on its last release, written once every round is trained when
	// that release was not an evaluation release (the demo evaluates its
	// last release the same way). Its update was counted by the release's
	// first record.
	Final bool  `json:"final,omitempty"`
	At    int64 `json:"at_us"`
}

// EncodeEvaluation returns the JSON document of an evaluation record.
func EncodeEvaluation(r EvaluationRecord) ([]byte, error) { return encodeDoc(KindEvaluation, &r) }

// DecodeEvaluation reads a document written by EncodeEvaluation.
func DecodeEvaluation(b []byte) (EvaluationRecord, error) {
	return decodeDoc[EvaluationRecord](KindEvaluation, b)
}

// GateState is what the gate remembers between decisions.
type GateState struct {
	// Initial is the evaluation of the initial policy (the base of
	// relative regression floors); Promoted the last promoted one
	// (Initial until a promotion).
	Initial  GateEvaluation `json:"initial"`
	Promoted GateEvaluation `json:"promoted"`
	// EvalsWithoutGain counts consecutive evaluations that did not
	// promote; KLAbove consecutive updates whose KL exceeded
	// objective.kl_limit.
	EvalsWithoutGain int `json:"evals_without_gain"`
	KLAbove          int `json:"kl_above"`
	// Stopped is set once a decision stopped the run.
	Stopped bool `json:"stopped"`
}

// GateUsage is what a run has spent, in the units of the contract's
// budgets.
type GateUsage struct {
	RolloutTokens    int64   `json:"rollout_tokens"`
	OptimizerTokens  int64   `json:"optimizer_tokens"`
	EnvironmentHours float64 `json:"environment_hours"`
	AcceleratorHours float64 `json:"accelerator_hours"`
}

// GateIncident is an open (unresolved) incident of the run as the gate
// holds it: safety incidents stop the run under safety_violation, any
// other blocks promotion.
type GateIncident struct {
	ID     string `json:"id"`
	Kind   string `json:"kind"`
	Safety bool   `json:"safety"`
}

// GateResume is the gate operator's state after a decision, carried by
// the decision itself: a restarted gate resumes from its last decision.
type GateResume struct {
	State GateState `json:"state"`
	Usage GateUsage `json:"usage"`
}
