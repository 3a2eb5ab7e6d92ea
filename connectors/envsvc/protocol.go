// Package envsvc is the environment service protocol of trajflow (version
// 1, docs/ENV_PROTOCOL.md): a server that runs the built-in task families
// behind HTTP + JSON (`trajflow serve env`), and its client, which
// implements rollout.Environment so the agent loop runs against the
// service exactly as against the in-process registry (docs/SYSTEMS.md §12, §14,
// §16).
//
// The service allocates an episode from an immutable task snapshot and
// seed, leases it to the controller, and executes ordered actions that
// each carry a capability token minted by the controller
// (connectors/env/capability) and never shown to the policy. Sequence
// numbers reject duplicate and out-of-order deliveries; a repeated
// delivery with the same idempotency key returns the stored transition
// without executing again; every transition is persisted (Badger, through
// connectors/state) before it is acknowledged; a client that timed out
// asks for the action's status before it sends it again.
package envsvc

import (
	"encoding/json"

	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// ProtocolVersion is the version of the protocol this package speaks; it
// is the "protocol" field of every request and response, the path prefix
// (/v1/) and the HeaderProtocol header of every response.
const ProtocolVersion = 1

// HeaderProtocol is the response header naming the protocol version.
const HeaderProtocol = "Trajflow-Env-Protocol"

// Paths of the protocol's endpoints ({id} is an episode id).
const (
	PathEpisodes  = "/v1/episodes"                // POST: allocate
	PathStep      = "/v1/episodes/{id}/step"      // POST: execute one action
	PathStatus    = "/v1/episodes/{id}/status"    // POST: what happened to one action
	PathRenew     = "/v1/episodes/{id}/renew"     // POST: extend the lease
	PathTerminate = "/v1/episodes/{id}/terminate" // POST: end the episode
	PathHealth    = "/healthz"                    // GET
	PathMetrics   = "/metrics"                    // GET: Prometheus
)

// Outcomes: every response says what became of the request's action.
const (
	// Executed: the action ran (now, or at an earlier delivery whose
	// stored result this response repeats: Replayed).
	Executed = "executed"
	// Refused: the action did not run and will not run; Reason says why,
	// Retry whether the same request may succeed later.
	Refused = "refused"
	// Unknown: the service cannot tell yet (a step that exceeded the step
	// time cap, a status query for an action never received); ask again.
	Unknown = "unknown"
)

// Reasons of refused and unknown outcomes.
const (
	ReasonBadRequest     = "bad_request"      // unparsable, over-size or wrong protocol version
	ReasonTokenMalformed = "token_malformed"  // not a capability token
	ReasonTokenForged    = "token_forged"     // bad signature
	ReasonTokenExpired   = "token_expired"    // past its expiry
	ReasonTokenScope     = "token_scope"      // for another run, episode, sequence number or action
	ReasonSeqReplayed    = "seq_replayed"     // the sequence number was used by another delivery (another idempotency key)
	ReasonSeqConflict    = "seq_conflict"     // the sequence number was used for a different action
	ReasonSeqGap         = "seq_gap"          // ahead of the next expected sequence number
	ReasonUnknownEpisode = "unknown_episode"  // no such episode
	ReasonEpisodeEnded   = "episode_ended"    // terminated, or ended by the service (EndReason)
	ReasonLeaseExpired   = "lease_expired"    // the lease ran out: the episode ended as an infrastructure failure
	ReasonCapacity       = "capacity"         // every episode slot is taken (Retry)
	ReasonUnknownTask    = "unknown_task"     // no served family has the task at the declared versions
	ReasonStepTimeout    = "step_timeout"     // the step exceeded the step time cap (Unknown: ask its status)
	ReasonPersistFailed  = "persist_failed"   // the transition could not be persisted; nothing changed (Retry)
	ReasonEnvironment    = "environment"      // the environment failed the step; nothing changed
	ReasonObservation    = "observation_size" // the observation exceeded the cap: the episode ended as an infrastructure failure
	ReasonShuttingDown   = "shutting_down"    // the service is stopping (Retry)
	ReasonNotReceived    = "not_received"     // status: no delivery of this sequence number arrived
)

// Episode statuses at the end.
const (
	StatusCompleted = "completed" // terminated by the controller
	StatusInfra     = "infra"     // ended by the service: an infrastructure failure
)

// Response is the common part of every response.
type Response struct {
	Protocol int    `json:"protocol"`
	Outcome  string `json:"outcome"`
	Reason   string `json:"reason,omitempty"`
	Detail   string `json:"detail,omitempty"`
	Retry    bool   `json:"retry,omitempty"`
	// Live and Capacity are the service's episodes in use and slots,
	// for the client's least-loaded routing.
	Live     int `json:"live"`
	Capacity int `json:"capacity"`
}

// AllocateRequest allocates an episode of the attempt's task snapshot
// (task id, task version, environment version) and seed. Its token is
// scoped to episode AllocateScope(attempt), sequence number 0 and action
// AllocateAction(attempt, key). The same (attempt, key) allocates once:
// a repeated request returns the same episode.
type AllocateRequest struct {
	Protocol       int                 `json:"protocol"`
	Attempt        schemas.TaskAttempt `json:"attempt"`
	IdempotencyKey string              `json:"idempotency_key"`
	LeaseMS        int64               `json:"lease_ms"`
	Token          string              `json:"token"`
}

// AllocateResponse carries the episode id, its lease and the first
// observation.
type AllocateResponse struct {
	Response
	EpisodeID      string              `json:"episode_id,omitempty"`
	LeaseExpiresMS int64               `json:"lease_expires_unix_ms,omitempty"`
	Spec           rollout.Spec        `json:"spec"`
	Observation    rollout.Observation `json:"observation"`
	Slot           int                 `json:"slot"`
}

// StepRequest executes Action as sequence number Seq (1, 2, ...) of the
// episode. Its token is scoped to (episode, Seq, StepAction(Turn, Action)).
type StepRequest struct {
	Protocol       int               `json:"protocol"`
	Seq            uint64            `json:"seq"`
	IdempotencyKey string            `json:"idempotency_key"`
	Turn           int32             `json:"turn"`
	Action         rollout.EnvAction `json:"action"`
	Token          string            `json:"token"`
}

// StepResponse is the answer to a step or a status query.
type StepResponse struct {
	Response
	Seq        uint64              `json:"seq"`
	NextSeq    uint64              `json:"next_seq"`
	Replayed   bool                `json:"replayed,omitempty"` // the stored transition of an earlier delivery
	Transition *rollout.Transition `json:"transition,omitempty"`
	EndReason  string              `json:"end_reason,omitempty"` // of an ended episode
}

// StatusRequest asks what happened to sequence number Seq of the episode
// (the same fields and token scope as the step it asks about); it never
// executes anything.
type StatusRequest = StepRequest

// RenewRequest extends the episode's lease to now + LeaseMS (at most the
// service's maximum). Its token is scoped to (episode, 0, RenewAction).
type RenewRequest struct {
	Protocol int    `json:"protocol"`
	LeaseMS  int64  `json:"lease_ms"`
	Token    string `json:"token"`
}

// RenewResponse carries the new expiry.
type RenewResponse struct {
	Response
	LeaseExpiresMS int64 `json:"lease_expires_unix_ms,omitempty"`
}

// TerminateRequest ends the episode (Reason: the agent loop's end reason).
// Its token is scoped to (episode, 0, TerminateAction). Terminating an
// ended episode returns the stored result.
type TerminateRequest struct {
	Protocol int    `json:"protocol"`
	Reason   string `json:"reason"`
	Token    string `json:"token"`
}

// ValidatorInput is what the trusted validator needs beyond the
// trajectory: the task snapshot and the environment's artifacts.
type ValidatorInput struct {
	Family      string `json:"family"`
	TaskID      string `json:"task_id"`
	TaskVersion string `json:"task_version"`
	EnvVersion  string `json:"env_version"`
	Artifacts   string `json:"artifacts"`
}

// TerminateResponse is the episode's end: completed when the controller
// terminated it, infra when the service ended it (EndReason).
type TerminateResponse struct {
	Response
	Status         string              `json:"status,omitempty"`
	EndReason      string              `json:"end_reason,omitempty"`
	Steps          int                 `json:"steps"`
	Final          *rollout.Transition `json:"final,omitempty"` // the last executed transition
	Artifacts      string              `json:"artifacts,omitempty"`
	ValidatorInput *ValidatorInput     `json:"validator_input,omitempty"`
}

// Health is the GET /healthz document, answered 200 while the service is
// healthy and 503 once its store failed (a write failed in a way that
// forbids further writes: the data directory became unwritable, an I/O
// error). A failed service refuses every write with persist_failed until
// it is restarted on a usable directory.
type Health struct {
	Status   string   `json:"status"` // HealthOK or HealthFailed
	Protocol int      `json:"protocol"`
	Families []string `json:"families"`
	Live     int      `json:"live"`
	Capacity int      `json:"capacity"`
	// Error says why the service failed, naming the data directory.
	Error string `json:"error,omitempty"`
}

// Health statuses.
const (
	HealthOK     = "ok"
	HealthFailed = "failed"
)

// AllocateScope is the token episode of an allocation.
func AllocateScope(a schemas.TaskAttempt) string { return "attempt:" + a.AttemptID }

// AllocateAction is the action bytes an allocation token binds.
func AllocateAction(a schemas.TaskAttempt, key string) []byte {
	b, _ := json.Marshal(struct {
		Attempt schemas.TaskAttempt `json:"attempt"`
		Key     string              `json:"idempotency_key"`
	}{a, key})
	return b
}

// StepAction is the action bytes a step (or status) token binds.
func StepAction(turn int32, a rollout.EnvAction) []byte {
	b, _ := json.Marshal(struct {
		Turn   int32             `json:"turn"`
		Action rollout.EnvAction `json:"action"`
	}{turn, a})
	return b
}

// Action bytes of lease renewals and terminations (sequence number 0).
var (
	RenewAction     = []byte("trajflow-env/1 renew")
	TerminateAction = []byte("trajflow-env/1 terminate")
)
