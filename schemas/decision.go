package schemas

// Gate actions (docs/PIPELINE.md §17) and the dispatch acknowledgement of a stop.
const (
	GatePromote  = "promote"
	GateContinue = "continue"
	GateRollback = "rollback"
	GateStop     = "stop"
	// GateHalted is dispatch's record that it stopped launching after a
	// stop decision: RoundsDispatched rounds were launched in all.
	GateHalted = "halted"
)

// GateCheck is one piece of a gate decision's evidence: a measured value
// with its confidence interval [Lo, Hi] and the bound it was held against
// (the promoted release's value for the primary metric, the largest
// allowed value of a constraint, the smallest of a regression floor, a
// stop rule's count).
type GateCheck struct {
	Kind  string  `json:"kind"`
	Name  string  `json:"name"`
	Value float64 `json:"value"`
	Lo    float64 `json:"lo"`
	Hi    float64 `json:"hi"`
	Bound float64 `json:"bound"`
	OK    bool    `json:"ok"`
}

// GateDecision is the gate's ruling on one policy release (promote,
// continue, rollback, stop), with its evidence, on the decisions topic;
// and dispatch's acknowledgement of a stop (action halted). In
// stop-and-synchronize mode with a gate, dispatch launches a round at a
// release only after the gate ruled on it.
type GateDecision struct {
	RunID         string `json:"run_id"`
	PolicyVersion int64  `json:"policy_version"`
	Action        string `json:"action"`
	Reason        string `json:"reason"`
	// StopRule is the text form of the rule that stopped the run.
	StopRule string `json:"stop_rule,omitempty"`
	// RollbackTo is the release a rollback returns to.
	RollbackTo int64 `json:"rollback_to,omitempty"`
	// Promoted is the last promoted release after the decision.
	Promoted int64 `json:"promoted"`
	// Evaluated is set when the decision rests on an evaluation of the
	// release (every eval_every releases); the others rule on the
	// update's KL and the budgets only.
	Evaluated bool `json:"evaluated"`
	// Final marks the ruling on a final evaluation
	// (EvaluationRecord.Final): the run's last ruling.
	Final  bool        `json:"final,omitempty"`
	Checks []GateCheck `json:"checks"`
	// RoundsDispatched (action halted) is how many rounds dispatch
	// launched before it stopped.
	RoundsDispatched int64 `json:"rounds_dispatched,omitempty"`
	At               int64 `json:"at_us"`
	// Resume (the gate operator's decisions) is the gate's state after
	// the decision: a restarted gate operator resumes from it.
	Resume *GateResume `json:"resume,omitempty"`
}

// EncodeGateDecision returns the JSON document of a gate decision.
func EncodeGateDecision(d GateDecision) ([]byte, error) { return encodeDoc(KindGateDecision, &d) }

// DecodeGateDecision reads a document written by EncodeGateDecision.
func DecodeGateDecision(b []byte) (GateDecision, error) {
	return decodeDoc[GateDecision](KindGateDecision, b)
}
