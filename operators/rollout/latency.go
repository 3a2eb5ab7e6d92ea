package rollout

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/schemas"
)

// LatencyModel is a simulated latency for the built-in environment and
// policy (docs/SYSTEMS.md §6: tool calls and generation are heavy-tailed, so a
// synchronous round waits for its stragglers as real agent workloads do).
// Every tool call (Episode.Step) waits ToolMedian·e^{ToolSigma·z} and every
// generated token TokenMedian·e^{TokenSigma·z'} before the result is
// returned: log-normal, z and z' standard normal drawn from the seed and
// the turn's id, cut at ±MaxZ. A batched Generate returns when its slowest
// request would have (decode steps run in lockstep). Latencies depend only
// on Seed, the attempt and the turn, never on timing, and never change a
// token: the wrappers only wait.
type LatencyModel struct {
	ToolMedian  time.Duration
	ToolSigma   float64
	TokenMedian time.Duration
	TokenSigma  float64
	Seed        int64
	// Sleep waits d or until ctx ends (nil: a timer).
	Sleep func(ctx context.Context, d time.Duration) error
}

// MaxZ bounds the normal deviate of a latency draw (|z| <= 4: the
// longest wait is e^{4σ} times the median).
const MaxZ = 4

// Enabled reports whether the model adds any latency.
func (m LatencyModel) Enabled() bool { return m.ToolMedian > 0 || m.TokenMedian > 0 }

// Validate reports whether m is usable.
func (m LatencyModel) Validate() error {
	ok := func(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) && x >= 0 }
	if m.ToolMedian < 0 || m.TokenMedian < 0 || !ok(m.ToolSigma) || !ok(m.TokenSigma) {
		return fmt.Errorf("rollout: latency model %+v: medians and sigmas must be finite and >= 0", m)
	}
	return nil
}

// Draw is the latency of key (a turn id) for a median and sigma.
func (m LatencyModel) Draw(median time.Duration, sigma float64, key, stream string) time.Duration {
	if median <= 0 {
		return 0
	}
	s := schemas.SeedFor(m.Seed, key, "latency/"+stream)
	z := rand.New(rand.NewPCG(s, s^0x9e3779b97f4a7c15)).NormFloat64()
	z = math.Max(-MaxZ, math.Min(MaxZ, z))
	return time.Duration(float64(median) * math.Exp(sigma*z))
}

func (m LatencyModel) sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	if m.Sleep != nil {
		return m.Sleep(ctx, d)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Wrap returns env and pol with the model's latencies (env and pol
// themselves when it adds none). The wrapped environment lets the agent
// loop overlap up to LatencyConcurrency tool calls of different episodes
// (Concurrent), as an environment service does; the wrapped policy keeps
// pol's Tokenizer.
func (m LatencyModel) Wrap(env Environment, pol Policy) (Environment, Policy) {
	if !m.Enabled() {
		return env, pol
	}
	if m.ToolMedian > 0 {
		env = latencyEnv{inner: env, m: m}
	}
	if m.TokenMedian > 0 {
		lp := latencyPolicy{inner: pol, m: m}
		if tok, ok := pol.(Tokenizer); ok {
			pol = latencyTokenizerPolicy{latencyPolicy: lp, Tokenizer: tok}
		} else {
			pol = lp
		}
	}
	return env, pol
}

// LatencyConcurrency is how many calls of different episodes the wrapped
// environment lets the agent loop have in flight.
const LatencyConcurrency = 256

type latencyEnv struct {
	inner Environment
	m     LatencyModel
}

func (e latencyEnv) Concurrency() int {
	if c, ok := e.inner.(Concurrent); ok {
		return max(c.Concurrency(), LatencyConcurrency)
	}
	return LatencyConcurrency
}

func (e latencyEnv) Reset(ctx context.Context, a schemas.TaskAttempt) (Episode, Observation, error) {
	ep, obs, err := e.inner.Reset(ctx, a)
	if err != nil {
		return nil, obs, err
	}
	return latencyEpisode{Episode: ep, m: e.m, attempt: a.AttemptID}, obs, nil
}

type latencyEpisode struct {
	Episode
	m       LatencyModel
	attempt string
}

func (e latencyEpisode) Step(ctx context.Context, turn int32, act EnvAction) (Transition, error) {
	d := e.m.Draw(e.m.ToolMedian, e.m.ToolSigma, schemas.TurnID(e.attempt, turn), "tool")
	if err := e.m.sleep(ctx, d); err != nil {
		return Transition{}, err
	}
	return e.Episode.Step(ctx, turn, act)
}

type latencyPolicy struct {
	inner Policy
	m     LatencyModel
}

func (p latencyPolicy) Generate(ctx context.Context, reqs []model.Request) ([]model.Sample, error) {
	out, err := p.inner.Generate(ctx, reqs)
	if err != nil {
		return out, err
	}
	var d time.Duration
	for k, s := range out {
		if k < len(reqs) {
			per := p.m.Draw(p.m.TokenMedian, p.m.TokenSigma, reqs[k].ID, "token")
			d = max(d, time.Duration(len(s.Tokens))*per)
		}
	}
	if err := p.m.sleep(ctx, d); err != nil {
		return nil, err
	}
	return out, nil
}

type latencyTokenizerPolicy struct {
	latencyPolicy
	Tokenizer
}
