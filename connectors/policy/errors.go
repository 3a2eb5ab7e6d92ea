package policy

import (
	"errors"
	"fmt"
)

// Reasons of an InfraError.
const (
	ReasonUnreachable     = "unreachable"      // no connection, or it broke before a response
	ReasonTimeout         = "timeout"          // the per-request timeout passed
	ReasonServerError     = "server_error"     // a 5xx status, or the server aborted the request
	ReasonRejected        = "rejected"         // a 4xx status (the body names what the server refused)
	ReasonBadResponse     = "bad_response"     // undecodable or truncated JSON, a missing or inconsistent field
	ReasonLengthMismatch  = "length_mismatch"  // token ids and log-probs of different lengths
	ReasonNaNLogprob      = "nan_logprob"      // a NaN or infinite log-prob (or a probability of 0, or one below float32's range)
	ReasonPositiveLogprob = "positive_logprob" // a log-prob above 0
	ReasonTokenRange      = "token_range"      // a sampled id outside [0, vocab)
	ReasonAfterStop       = "after_stop"       // a sampled id after a stop id
	ReasonVersionMismatch = "version_mismatch" // the server served another weight version than wanted
	ReasonNoReplica       = "no_replica"       // a gateway had no replica to send a request to
)

// InfraError is a failure of the policy server or of the network, never of
// the task: the caller retries it (on another replica when there is one)
// and must not count it as a task failure (docs/PIPELINE.md §6). Addr is the
// server's base URL; Detail names the field or call and what was wrong.
type InfraError struct {
	Reason string
	Addr   string
	Detail string
	Status int   // the HTTP status of the answer, 0 when none came
	Err    error // the underlying error, if any
}

func (e *InfraError) Error() string {
	s := fmt.Sprintf("policy server %s: %s: %s", e.Addr, e.Reason, e.Detail)
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

func (e *InfraError) Unwrap() error { return e.Err }

// InfraReason is the error's reason. Callers that must not import this
// package (the rollout stage counts infrastructure failures in its census
// by reason) find it through an interface { InfraReason() string }.
func (e *InfraError) InfraReason() string { return e.Reason }

// Infra returns an *InfraError.
func Infra(reason, addr, format string, args ...any) *InfraError {
	return &InfraError{Reason: reason, Addr: addr, Detail: fmt.Sprintf(format, args...)}
}

// AsInfra returns the *InfraError in err's chain.
func AsInfra(err error) (*InfraError, bool) {
	var ie *InfraError
	ok := errors.As(err, &ie)
	return ie, ok
}

// IsInfra reports whether err is an infrastructure failure (an *InfraError
// in its chain).
func IsInfra(err error) bool {
	_, ok := AsInfra(err)
	return ok
}

var (
	// ErrNotOffered is wrapped when a protocol has no call for what was
	// asked (for example a chat-template rendering over SGLang).
	ErrNotOffered = errors.New("policy: not offered by this protocol")
	// ErrSettings is wrapped when sampler settings cannot be honored
	// exactly by a server (a grammar the server does not apply, a stop
	// rule the server does not follow). Retrying does not help.
	ErrSettings = errors.New("policy: settings not servable")
	// ErrConfig is wrapped by configuration errors of a client, the
	// gateway or weight sync.
	ErrConfig = errors.New("policy: bad config")
)
