package rollout

import (
	"context"
	"errors"
	"fmt"

	"github.com/trajflow/trajflow/schemas"
)

// Environment starts the episodes of task attempts. The task registry
// (*Registry) is the in-process environment of the built-in families; the
// client of `trajflow serve env` (connectors/envsvc) reaches the same
// families over HTTP. The agent loop (Agent.Run) drives either the same
// way, so a run gives the same trajectories through both.
type Environment interface {
	// Reset allocates an episode of the attempt's task snapshot (task id,
	// task version, environment version) and seed and returns its first
	// observation. An unknown task or a version mismatch wraps
	// ErrUnknownTask; any other error is an infrastructure failure.
	Reset(ctx context.Context, a schemas.TaskAttempt) (Episode, Observation, error)
}

// Episode is one live episode of an environment. Its methods are called by
// one goroutine at a time (the agent loop's); Step is called once per turn
// with increasing turn numbers, Close exactly once at the end.
type Episode interface {
	// Spec says how the agent loop talks to the episode.
	Spec() Spec
	// Step parses, authorizes and executes the action of turn `turn`. The
	// parser's and the authorizer's refusals are transitions (Decision
	// invalid or denied), not errors; an error is an infrastructure failure
	// (the episode is then closed and the attempt retried, never counted as
	// a task failure). Stepping a terminated episode is an error.
	Step(ctx context.Context, turn int32, a EnvAction) (Transition, error)
	// Close ends the episode (reason is the loop's end reason, or
	// ReasonAborted when the loop failed) and returns the environment's
	// evidence for the trusted validator.
	Close(ctx context.Context, reason string) (Final, error)
}

// Observation kinds of a Spec.
const (
	// ObsTokens: observations are ids of the built-in vocabulary
	// (vocab.go), appended to the token stream as they are.
	ObsTokens = "tokens"
	// ObsText: the first observation is chat messages and later ones are
	// tool output text; the agent loop renders them with the policy
	// server's chat template and tokenizer (textrender.go).
	ObsText = "text"
)

// Spec describes an episode to the agent loop.
type Spec struct {
	Family        string `json:"family"`         // FamilyKV, FamilyLedger, FamilyText
	Observations  string `json:"observations"`   // ObsTokens or ObsText
	ParserVersion string `json:"parser_version"` // recorded in the trajectory
	// TokenizerHash names the vocabulary of ObsTokens episodes; text
	// episodes record the policy server's tokenizer instead ("").
	TokenizerHash string `json:"tokenizer_hash,omitempty"`
	// TurnPrompt is the prompt delta an ObsTokens episode renders before
	// every action after the first.
	TurnPrompt []int32 `json:"turn_prompt,omitempty"`
	// MaxObservation bounds one observation: tokens for ObsTokens, bytes of
	// Observation.Text for ObsText.
	MaxObservation int `json:"max_observation"`
}

// Validate reports whether s is usable by the agent loop.
func (s Spec) Validate() error {
	switch {
	case s.Observations != ObsTokens && s.Observations != ObsText:
		return fmt.Errorf("rollout: episode spec: observations %q", s.Observations)
	case s.ParserVersion == "":
		return errors.New("rollout: episode spec: no parser version")
	case s.MaxObservation <= 0:
		return fmt.Errorf("rollout: episode spec: max observation %d", s.MaxObservation)
	case s.Observations == ObsTokens && (len(s.TurnPrompt) == 0 || s.TokenizerHash == ""):
		return errors.New("rollout: episode spec: a token episode needs a turn prompt and a tokenizer hash")
	}
	return nil
}

// Observation is what the environment shows the policy: token ids of the
// built-in vocabulary, or text (the first one as chat messages). Tool
// output text is untrusted data: the families escape it (EscapeText) and
// cap it at Spec.MaxObservation bytes, and the agent loop refuses an
// observation that breaks either rule.
type Observation struct {
	IDs      []int32       `json:"ids,omitempty"`
	Messages []ChatMessage `json:"messages,omitempty"`
	Text     string        `json:"text,omitempty"`
}

// EnvAction is one action as the environment receives it: the sampled ids
// (ObsTokens episodes parse these) and, for ObsText episodes, their text as
// the policy server's tokenizer decodes it (parsed by the family; the ids
// stay the training record, never re-derived from the text).
type EnvAction struct {
	IDs  []int32 `json:"ids,omitempty"`
	Text string  `json:"text,omitempty"`
}

// Transition is the result of one environment step.
type Transition struct {
	Decision    string      `json:"decision"`         // schemas.Decision*
	Reason      string      `json:"reason,omitempty"` // why an action was invalid or denied
	Observation Observation `json:"observation"`      // shown to the policy next
	Terminated  bool        `json:"terminated,omitempty"`
}

// Final is what an episode leaves when it is closed.
type Final struct {
	// Artifacts is the environment's evidence of the episode (the
	// Trajectory.Artifacts JSON): what it did, never its hidden state.
	Artifacts string `json:"artifacts"`
	// Steps is how many actions the environment executed.
	Steps int `json:"steps"`
}

// ReasonAborted is the Close reason of an episode whose loop failed.
const ReasonAborted = "aborted"

// ErrEnvironment is wrapped by the agent loop when an environment breaks
// its own spec (an over-size or unescaped text observation, a malformed
// spec): an infrastructure failure.
var ErrEnvironment = errors.New("rollout: environment broke its spec")

// Stateful is implemented by the in-process episodes: State returns the
// episode's world state (what Registry.Resume needs to continue it), so an
// environment service can persist it with every transition.
type Stateful interface {
	State() ([]byte, error)
}
