package capability

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Status is what the environment knows of one action.
type Status int

// Action statuses.
const (
	// StatusUnknown: the action never reached the environment; sending it
	// again cannot execute it twice.
	StatusUnknown Status = iota
	// StatusRunning: accepted and executing; its outcome is not known yet.
	StatusRunning
	// StatusDone: executed; Outcome.Result holds what it returned.
	StatusDone
	// StatusFailed: executed and failed; Outcome.Err says why. It is not
	// executed again.
	StatusFailed
)

func (s Status) String() string {
	switch s {
	case StatusUnknown:
		return "unknown"
	case StatusRunning:
		return "running"
	case StatusDone:
		return "done"
	case StatusFailed:
		return "failed"
	}
	return fmt.Sprintf("status(%d)", int(s))
}

// Outcome is the recorded result of an action.
type Outcome struct {
	Status Status
	Result []byte
	Err    string
}

// ActionError is the action's own failure (the tool ran and failed): a
// definitive answer, never retried.
type ActionError struct{ Msg string }

func (e *ActionError) Error() string { return "capability: action failed: " + e.Msg }

// Executor runs one accepted action inside the environment.
type Executor func(ctx context.Context, episode string, seq uint64, action []byte) ([]byte, error)

// Guard is the environment side: it admits an action only with a valid
// token for exactly that run, episode, sequence number and action, only as
// the next sequence number of its episode (sequence numbers start at 1),
// executes it once, and records the outcome before answering (docs/SYSTEMS.md §12:
// "persist transition before acknowledging"). It is safe for concurrent
// use; actions of one episode are serialized.
type Guard struct {
	key  []byte
	ver  *Verifier
	run  string
	now  func() time.Time
	exec Executor

	mu       sync.Mutex
	episodes map[string]*episode
}

type episode struct {
	serial   sync.Mutex // serializes the episode's actions
	mu       sync.Mutex // guards the fields below
	next     uint64
	closed   bool
	outcomes map[uint64]Outcome
}

// NewGuard returns the guard of run, verifying tokens with key and running
// accepted actions with exec. now may be nil (time.Now).
func NewGuard(key []byte, run string, now func() time.Time, exec Executor) (*Guard, error) {
	if len(key) != KeySize {
		return nil, ErrKey
	}
	if exec == nil {
		return nil, errors.New("capability: guard without executor")
	}
	if now == nil {
		now = time.Now
	}
	ver, _ := NewVerifier(key, now) // the key's length is checked above
	return &Guard{key: bytes.Clone(key), ver: ver, run: run, now: now, exec: exec, episodes: map[string]*episode{}}, nil
}

func (g *Guard) episode(id string) *episode {
	g.mu.Lock()
	defer g.mu.Unlock()
	ep := g.episodes[id]
	if ep == nil {
		ep = &episode{next: 1, outcomes: map[uint64]Outcome{}}
		g.episodes[id] = ep
	}
	return ep
}

// authorize verifies token and its scope against (run, episode, seq,
// action).
func (g *Guard) authorize(token, episode string, seq uint64, action []byte) error {
	_, err := g.ver.Verify(token, g.run, episode, seq, action)
	return err
}

// Execute admits and runs one action. Refusals wrap ErrRefused (and one of
// ErrMalformed, ErrForged, ErrExpired, ErrScope, ErrReplayed,
// ErrOutOfOrder, ErrClosed) and execute nothing. An executor error is
// recorded and returned as *ActionError.
func (g *Guard) Execute(ctx context.Context, token, episode string, seq uint64, action []byte) ([]byte, error) {
	if err := g.authorize(token, episode, seq, action); err != nil {
		return nil, err
	}
	ep := g.episode(episode)
	ep.serial.Lock()
	defer ep.serial.Unlock()
	ep.mu.Lock()
	switch {
	case ep.closed:
		ep.mu.Unlock()
		return nil, ErrClosed
	case seq < ep.next:
		next := ep.next
		ep.mu.Unlock()
		return nil, fmt.Errorf("%w: %d (next is %d)", ErrReplayed, seq, next)
	case seq > ep.next:
		next := ep.next
		ep.mu.Unlock()
		return nil, fmt.Errorf("%w: %d (next is %d)", ErrOutOfOrder, seq, next)
	}
	// The sequence number is consumed and the action marked running before
	// it executes: a duplicate delivery arriving meanwhile is a replay, and
	// a status query says "running", never "unknown".
	ep.next = seq + 1
	ep.outcomes[seq] = Outcome{Status: StatusRunning}
	ep.mu.Unlock()
	res, err := g.exec(ctx, episode, seq, action)
	o := Outcome{Status: StatusDone, Result: bytes.Clone(res)}
	if err != nil {
		o = Outcome{Status: StatusFailed, Err: err.Error()}
	}
	ep.mu.Lock()
	ep.outcomes[seq] = o
	ep.mu.Unlock()
	if err != nil {
		return nil, &ActionError{Msg: err.Error()}
	}
	return res, nil
}

// Status reports what happened to action seq of episode. The token must be
// valid for that action (a status query is scoped like the action itself;
// it does not consume the sequence number).
func (g *Guard) Status(_ context.Context, token, episode string, seq uint64, action []byte) (Outcome, error) {
	if err := g.authorize(token, episode, seq, action); err != nil {
		return Outcome{}, err
	}
	g.mu.Lock()
	ep := g.episodes[episode]
	g.mu.Unlock()
	if ep == nil {
		return Outcome{Status: StatusUnknown}, nil
	}
	// ep.mu, not ep.serial: a status query answers while the action runs.
	ep.mu.Lock()
	defer ep.mu.Unlock()
	o, ok := ep.outcomes[seq]
	if !ok {
		return Outcome{Status: StatusUnknown}, nil
	}
	o.Result = bytes.Clone(o.Result)
	return o, nil
}

// Close ends an episode: every later action is refused with ErrClosed.
func (g *Guard) Close(episode string) {
	ep := g.episode(episode)
	ep.mu.Lock()
	ep.closed = true
	ep.mu.Unlock()
}

// Env is an environment reached over an unreliable channel: Guard
// implements it in process; a network client implements it remotely.
type Env interface {
	Execute(ctx context.Context, token, episode string, seq uint64, action []byte) ([]byte, error)
	Status(ctx context.Context, token, episode string, seq uint64, action []byte) (Outcome, error)
}

// Client sends actions with tokens and retries ambiguous failures safely.
type Client struct {
	Issuer *Issuer
	Env    Env
	// Attempts bounds the tries of one action (default 5); Backoff is the
	// pause between them (default 50 ms, doubled each time).
	Attempts int
	Backoff  time.Duration
}

// ErrAmbiguous is returned when the outcome of an action is still unknown
// after every attempt.
var ErrAmbiguous = errors.New("capability: action outcome unknown after retries")

// Do executes action as sequence number seq of episode exactly once as far
// as the environment can tell. A refusal (ErrRefused) or the action's own
// failure (*ActionError) is final. Any other error — a timeout, a reset
// connection — is ambiguous: the action may or may not have run, so
// before sending it again Do queries its status with a fresh token
// (docs/SYSTEMS.md §12) and returns the recorded result if it ran, waits while it
// runs, and re-executes only if the environment never saw it.
func (c *Client) Do(ctx context.Context, episode string, seq uint64, action []byte) ([]byte, error) {
	attempts, backoff := c.Attempts, c.Backoff
	if attempts <= 0 {
		attempts = 5
	}
	if backoff <= 0 {
		backoff = 50 * time.Millisecond
	}
	var last error
	ambiguous := false
	for i := 0; i < attempts; i++ {
		if i > 0 {
			select {
			case <-ctx.Done():
				return nil, fmt.Errorf("capability: %s/%d: %w (last error: %v)", episode, seq, ctx.Err(), last)
			case <-time.After(backoff):
			}
			backoff *= 2
		}
		tok := c.Issuer.Issue(episode, seq, action)
		if ambiguous {
			o, err := c.Env.Status(ctx, tok, episode, seq, action)
			if err != nil {
				if errors.Is(err, ErrRefused) {
					return nil, err
				}
				last = err
				continue
			}
			switch o.Status {
			case StatusDone:
				return o.Result, nil
			case StatusFailed:
				return nil, &ActionError{Msg: o.Err}
			case StatusRunning:
				last = errors.New("action still running")
				continue
			}
			// StatusUnknown: it never arrived; sending it again is safe.
		}
		res, err := c.Env.Execute(ctx, tok, episode, seq, action)
		if err == nil {
			return res, nil
		}
		var ae *ActionError
		if errors.Is(err, ErrRefused) || errors.As(err, &ae) {
			return nil, err
		}
		last, ambiguous = err, true
	}
	return nil, fmt.Errorf("%w: %s/%d: %v", ErrAmbiguous, episode, seq, last)
}
