package schemas

import (
	"errors"
	"fmt"
)

// Kind names a record kind. The kind and its version travel with every
// encoded message: in the Arrow schema metadata of an IPC stream
// (MetaKind, MetaVersion), in the "kind"/"version" fields of a JSON
// document, and in the Kafka headers (HeaderKind, HeaderVersion).
type Kind string

// The record kinds.
const (
	KindTaskAttempt     Kind = "task_attempt"
	KindTrajectory      Kind = "trajectory"
	KindRewardComponent Kind = "reward_component"
	KindRewarded        Kind = "rewarded_trajectory"
	KindScored          Kind = "scored_trajectory"
	KindPackedBatch     Kind = "packed_batch"
	KindPolicyRelease   Kind = "policy_release"
	KindCensusEvent     Kind = "census_event"
	KindWindowRecord    Kind = "window_record"
	KindIncident        Kind = "incident"
	KindUpdateRecord    Kind = "update_record"
	KindWeightAck       Kind = "weight_ack"
	KindGateDecision    Kind = "gate_decision"
	KindEvaluation      Kind = "evaluation"
)

// Current versions of each kind. A decoder accepts exactly the versions it
// knows; anything else is a *VersionError. Version 2 of trajectory,
// rewarded_trajectory and scored_trajectory added chat_template_hash.
var Versions = map[Kind]int{
	KindTaskAttempt:     1,
	KindTrajectory:      2,
	KindRewardComponent: 1,
	KindRewarded:        2,
	KindScored:          2,
	KindPackedBatch:     1,
	KindPolicyRelease:   1,
	KindCensusEvent:     1,
	KindWindowRecord:    1,
	KindIncident:        1,
	KindUpdateRecord:    1,
	KindWeightAck:       1,
	KindGateDecision:    1,
	KindEvaluation:      1,
}

// Arrow schema metadata keys under which kind and version are stored
// (the Kafka headers are in headers.go).
const (
	MetaKind    = "trajflow.kind"
	MetaVersion = "trajflow.version"
)

// ErrDecode wraps every failure to decode bytes into records: truncated or
// garbage input, a missing column, a type mismatch, inconsistent lengths.
var ErrDecode = errors.New("schemas: cannot decode")

// VersionError reports a message whose kind is not the one expected or
// whose version this build does not know. It is never wrapped in ErrDecode
// so a quarantine reason can tell the two apart.
type VersionError struct {
	WantKind Kind
	GotKind  string
	Got      string // version as found in the message ("" when missing)
	Known    int
}

func (e *VersionError) Error() string {
	if string(e.WantKind) != e.GotKind {
		return fmt.Sprintf("schemas: message kind %q, want %q", e.GotKind, e.WantKind)
	}
	return fmt.Sprintf("schemas: %s version %q unknown (this build reads version %d)", e.WantKind, e.Got, e.Known)
}
