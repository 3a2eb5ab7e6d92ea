// Package validate is the accept/quarantine stage (docs/PIPELINE.md §9):
// it sorts every finalized trajectory into one of three classes.
//
//   - Valid: a statistically valid training episode. Environment and logging
//     succeeded; task success may be zero. A low reward or an agent failure
//     is never a reason to reject (docs/PIPELINE.md §9: dropping ordinary failures
//     changes the behavior distribution and removes negative advantages).
//   - InfraInvalid: corrupt or incomplete logging, server crash, reward
//     failure, irrecoverable version mismatch. The record goes to quarantine
//     with a reason; the attempt is retried upstream and never counts as a
//     task failure.
//   - Incident: unauthorized or unexpected behavior requiring review, such as
//     a hidden-evaluation task reaching the training stream (docs/PIPELINE.md §9
//     "evaluator leakage and sandbox incidents"). The record goes to
//     quarantine and an incident is raised.
//
// Check and CheckRewarded are pure functions of (record, options): no I/O,
// no clock, no randomness. Every rejection carries a machine-readable reason
// code (the Reason* constants, stable across releases, suitable as metric
// labels and census reasons) and a human-readable detail naming the place of
// the fault, e.g. reason "logprob_length_mismatch", detail
// "turn 2: 17 action ids, 16 log-probs".
package validate

import (
	"fmt"
	"math"
	"slices"
)

// Class is the acceptance class of a record (docs/PIPELINE.md §9).
type Class string

// The three classes of docs/PIPELINE.md §9.
const (
	Valid        Class = "valid"
	InfraInvalid Class = "infra_invalid"
	Incident     Class = "incident"
)

// Reason codes of Check. Each code has exactly one class (see ClassOf).
const (
	// ReasonMissingID: RecordID, RunID, TaskID or GroupID is empty.
	ReasonMissingID = "missing_id"
	// ReasonGroupMember: GroupSize < 1, Member outside [0, GroupSize), or a
	// negative Attempt.
	ReasonGroupMember = "group_member"
	// ReasonEvalTaskID: the task belongs to the hidden-evaluation split or
	// is on the evaluation denylist. Class Incident.
	ReasonEvalTaskID = "eval_task_id"
	// ReasonSafetyIncident: the episode ended for a reason the contract
	// declares an incident (Options.IncidentEndReasons). Class Incident.
	ReasonSafetyIncident = "safety_incident"
	// ReasonInfraFailure: the attempt reported StatusInfra.
	ReasonInfraFailure = "infra_failure"
	// ReasonTimedOut: the attempt reported StatusTimedOut and the contract
	// does not declare timeouts to be truncations.
	ReasonTimedOut = "timed_out"
	// ReasonUnknownStatus: Status is none of the schemas.Status* values.
	ReasonUnknownStatus = "unknown_status"
	// ReasonVersionMismatch: contract hash, tokenizer hash, parser version or
	// environment version differs from what the run expects.
	ReasonVersionMismatch = "version_mismatch"
	// ReasonTimestampOrder: FinishedAt precedes StartedAt.
	ReasonTimestampOrder = "timestamp_order"
	// ReasonNoTurns: the trajectory has no turns.
	ReasonNoTurns = "no_turns"
	// ReasonDuplicateTurn: a turn index occurs twice.
	ReasonDuplicateTurn = "duplicate_turn"
	// ReasonTurnOrder: turn indices are not 0..n-1 in order.
	ReasonTurnOrder = "turn_order"
	// ReasonEmptyPrompt: turn 0 has no prompt tokens.
	ReasonEmptyPrompt = "empty_prompt"
	// ReasonEmptyAction: a turn has no sampled action tokens.
	ReasonEmptyAction = "empty_action"
	// ReasonLogprobLengthMismatch: a turn's action ids and action log-probs
	// differ in length.
	ReasonLogprobLengthMismatch = "logprob_length_mismatch"
	// ReasonNonFiniteLogprob: an action log-prob is NaN or ±Inf.
	ReasonNonFiniteLogprob = "nonfinite_logprob"
	// ReasonPositiveLogprob: an action log-prob is > 0 (beyond
	// Options.LogprobTolerance); a probability cannot exceed 1.
	ReasonPositiveLogprob = "positive_logprob"
	// ReasonTokenIDRange: a prompt, action or observation token id is
	// negative or >= Options.VocabSize.
	ReasonTokenIDRange = "token_id_range"
	// ReasonPolicyVersionOrder: a turn's policy version is negative or lower
	// than the previous turn's (weights only move forward within an attempt).
	ReasonPolicyVersionOrder = "policy_version_order"
	// ReasonUnknownDecision: a turn's Decision is none of schemas.Decision*.
	ReasonUnknownDecision = "unknown_decision"
	// ReasonNonFiniteValue: a turn's critic Value is ±Inf (NaN is allowed:
	// it means no critic ran).
	ReasonNonFiniteValue = "nonfinite_value"
	// ReasonEndState: End is neither terminated nor truncated, a truncation
	// has no EndReason, or the ending contradicts the status.
	ReasonEndState = "end_state"
	// ReasonNonFiniteBootstrap: the episode was truncated for a reason GAE
	// bootstraps from (Options.BootstrapReasons) but BootstrapValue is not
	// finite.
	ReasonNonFiniteBootstrap = "nonfinite_bootstrap"
	// ReasonOverBudget: more turns, action tokens per turn or tokens per
	// episode than the contract allows; the agent loop should have
	// truncated.
	ReasonOverBudget = "over_budget"
)

// Reason codes of CheckRewarded.
const (
	// ReasonRewardUnavailable: a component carries an Error (its evaluator
	// failed), or a required component is absent. An evaluator failure is
	// an infrastructure failure, never an agent failure (docs/PIPELINE.md §8).
	ReasonRewardUnavailable = "reward_unavailable"
	// ReasonRewardMetadata: a component lacks name or version, or belongs to
	// another trajectory.
	ReasonRewardMetadata = "reward_metadata"
	// ReasonRewardScope: unknown scope, or a turn/span that does not exist
	// in the trajectory.
	ReasonRewardScope = "reward_scope"
	// ReasonDuplicateReward: two components with the same name and place.
	ReasonDuplicateReward = "duplicate_reward"
	// ReasonNonFiniteReward: a raw score, weight, value, uncertainty or the
	// total is NaN or ±Inf.
	ReasonNonFiniteReward = "nonfinite_reward"
	// ReasonRewardOutOfRange: a raw score lies outside its declared range.
	ReasonRewardOutOfRange = "reward_out_of_range"
	// ReasonRewardTotalMismatch: RewardTotal is not the sum of the values of
	// the available components.
	ReasonRewardTotalMismatch = "reward_total_mismatch"
)

var reasonClass = map[string]Class{
	ReasonMissingID:             InfraInvalid,
	ReasonGroupMember:           InfraInvalid,
	ReasonEvalTaskID:            Incident,
	ReasonSafetyIncident:        Incident,
	ReasonInfraFailure:          InfraInvalid,
	ReasonTimedOut:              InfraInvalid,
	ReasonUnknownStatus:         InfraInvalid,
	ReasonVersionMismatch:       InfraInvalid,
	ReasonTimestampOrder:        InfraInvalid,
	ReasonNoTurns:               InfraInvalid,
	ReasonDuplicateTurn:         InfraInvalid,
	ReasonTurnOrder:             InfraInvalid,
	ReasonEmptyPrompt:           InfraInvalid,
	ReasonEmptyAction:           InfraInvalid,
	ReasonLogprobLengthMismatch: InfraInvalid,
	ReasonNonFiniteLogprob:      InfraInvalid,
	ReasonPositiveLogprob:       InfraInvalid,
	ReasonTokenIDRange:          InfraInvalid,
	ReasonPolicyVersionOrder:    InfraInvalid,
	ReasonUnknownDecision:       InfraInvalid,
	ReasonNonFiniteValue:        InfraInvalid,
	ReasonEndState:              InfraInvalid,
	ReasonNonFiniteBootstrap:    InfraInvalid,
	ReasonOverBudget:            InfraInvalid,

	ReasonRewardUnavailable:   InfraInvalid,
	ReasonRewardMetadata:      InfraInvalid,
	ReasonRewardScope:         InfraInvalid,
	ReasonDuplicateReward:     InfraInvalid,
	ReasonNonFiniteReward:     InfraInvalid,
	ReasonRewardOutOfRange:    InfraInvalid,
	ReasonRewardTotalMismatch: InfraInvalid,
}

// ClassOf returns the class of a reason code: Valid for "", and
// InfraInvalid for a code this package does not define.
func ClassOf(reason string) Class {
	if reason == "" {
		return Valid
	}
	if c, ok := reasonClass[reason]; ok {
		return c
	}
	return InfraInvalid
}

// Reasons returns every reason code this package can emit, sorted.
func Reasons() []string {
	out := make([]string, 0, len(reasonClass))
	for r := range reasonClass {
		out = append(out, r)
	}
	slices.Sort(out)
	return out
}

// Verdict is the outcome of a check. For a valid record Class is Valid and
// Reason and Detail are empty; otherwise Reason is one of the Reason*
// codes, Class is ClassOf(Reason), and Detail locates the fault.
type Verdict struct {
	Class  Class  `json:"class"`
	Reason string `json:"reason,omitempty"`
	Detail string `json:"detail,omitempty"`
}

// OK reports whether the record was accepted.
func (v Verdict) OK() bool { return v.Class == Valid }

// Infra reports whether the rejection is an infrastructure failure (the
// census Infra flag): the attempt is retried and is not a task failure.
func (v Verdict) Infra() bool { return v.Class == InfraInvalid }

// String renders the verdict as "class" or "class: reason: detail".
func (v Verdict) String() string {
	if v.Reason == "" {
		return string(v.Class)
	}
	if v.Detail == "" {
		return string(v.Class) + ": " + v.Reason
	}
	return string(v.Class) + ": " + v.Reason + ": " + v.Detail
}

var accepted = Verdict{Class: Valid}

// reject builds the verdict for reason with a formatted detail.
func reject(reason, format string, args ...any) Verdict {
	return Verdict{Class: ClassOf(reason), Reason: reason, Detail: fmt.Sprintf(format, args...)}
}

// isFinite32 reports whether f is neither NaN nor infinite: its exponent
// bits are not all ones (IEEE 754 binary32). This runs once per action
// token, so it avoids the conversions of math.IsNaN and math.IsInf.
func isFinite32(f float32) bool {
	return math.Float32bits(f)&0x7f800000 != 0x7f800000
}

func isFinite(f float64) bool { return !math.IsNaN(f) && !math.IsInf(f, 0) }
