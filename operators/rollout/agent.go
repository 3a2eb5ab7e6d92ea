package rollout

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/schemas"
)

// Policy generates action tokens; *model.Policy implements it. Each
// Sample's PolicyVersion is recorded as the turn's behavior version, so a
// policy server that switches versions between calls (shadow slot, systems
// §8) is recorded exactly.
type Policy interface {
	Generate(ctx context.Context, reqs []model.Request) ([]model.Sample, error)
}

// End reasons of the built-in environment.
const (
	ReasonAnswer      = "answer"       // terminated: the agent answered
	ReasonMaxTurns    = "max_turns"    // truncated: turn budget spent
	ReasonTokenBudget = "token_budget" // truncated: the next turn would not fit the token budget
)

// Limits bound an episode and fix its random streams.
type Limits struct {
	MaxTurns int // > 0
	// MaxEpisodeTokens bounds the token stream (prompts, actions,
	// observations). A turn starts only if the stream, its prompt, the
	// longest action (Settings.MaxTokens) and the longest observation (2)
	// fit; otherwise the episode is truncated with ReasonTokenBudget.
	MaxEpisodeTokens int
	// ContractSeed is the learning contract's seed; turn t of attempt a
	// samples with schemas.SeedFor(ContractSeed, schemas.TurnID(a, t),
	// "sample").
	ContractSeed int64
	// Now is the clock for latencies and timestamps; nil means time.Now.
	// Token streams never depend on it.
	Now func() time.Time
}

// DefaultLimits are the demo's limits.
func DefaultLimits() Limits { return Limits{MaxTurns: 4, MaxEpisodeTokens: 64, ContractSeed: 1} }

// maxObservation is the longest observation the environment renders.
const maxObservation = 2

// RunEpisode runs one attempt (RunEpisodes with one attempt).
func (r *Registry) RunEpisode(ctx context.Context, pol Policy, a schemas.TaskAttempt, s model.Settings, lim Limits) (schemas.Trajectory, error) {
	out, err := r.RunEpisodes(ctx, pol, []schemas.TaskAttempt{a}, s, lim)
	if err != nil {
		return schemas.Trajectory{}, err
	}
	return out[0], nil
}

// RunEpisodes runs the agent loop of pipeline §7 for many attempts at once:
// every turn, it renders each live episode's prompt, asks the policy for
// all of their actions in one Generate call, then parses, authorizes and
// steps each episode. It returns one trajectory per attempt, in order.
//
// Per turn it logs PromptIDs (turn 0: the whole prompt; later: the delta
// ACT), ActionIDs and ActionLogprobs exactly as sampled, the sample's
// policy version, the decision and its reason, ObservationIDs, Value = NaN
// (no critic) and the generation and environment latencies. An episode ends
// terminated (ReasonAnswer) or truncated (ReasonMaxTurns,
// ReasonTokenBudget); Status is completed; BootstrapValue is NaN.
//
// Each request's seed depends only on the attempt id and turn, and the
// sampler's result does not depend on the batch, so a trajectory's tokens
// do not depend on which other attempts ran beside it. An unknown task, a
// version mismatch or a policy error fails the call (an infrastructure
// failure for the caller to retry), as does ctx ending.
func (r *Registry) RunEpisodes(ctx context.Context, pol Policy, atts []schemas.TaskAttempt, s model.Settings, lim Limits) ([]schemas.Trajectory, error) {
	if err := s.Validate(); err != nil {
		return nil, fmt.Errorf("rollout: %w", err)
	}
	if lim.MaxTurns <= 0 || lim.MaxEpisodeTokens <= 0 {
		return nil, fmt.Errorf("rollout: limits %d turns, %d tokens must be positive", lim.MaxTurns, lim.MaxEpisodeTokens)
	}
	now := lim.Now
	if now == nil {
		now = time.Now
	}
	type live struct {
		ep     *Episode
		stream []int32 // every token so far
		prompt []int32 // the prompt of the next turn
		done   bool
	}
	n := len(atts)
	eps := make([]live, n)
	trajs := make([]schemas.Trajectory, n)
	sid := s.ID()
	for i, a := range atts {
		ep, prompt, err := r.Reset(a)
		if err != nil {
			return nil, fmt.Errorf("rollout: attempt %s: %w", a.AttemptID, err)
		}
		eps[i] = live{ep: ep, prompt: prompt}
		trajs[i] = schemas.Trajectory{
			RecordID: a.AttemptID, RunID: a.RunID, TaskID: a.TaskID, TaskVersion: a.TaskVersion,
			Domain: a.Domain, Split: a.Split, EnvVersion: a.EnvVersion, GroupID: a.GroupID,
			GroupSize: a.GroupSize, Member: a.Member, Attempt: a.Attempt, Seed: a.Seed,
			ContractHash: a.ContractHash, SamplerID: sid, ParserVersion: ParserVersion,
			TokenizerHash: TokenizerHash, Status: schemas.StatusCompleted,
			BootstrapValue: float32(math.NaN()), StartedAt: now().UnixMicro(),
		}
	}
	finish := func(i int, end, reason string) {
		eps[i].done = true
		trajs[i].End, trajs[i].EndReason = end, reason
		trajs[i].Artifacts = eps[i].ep.ArtifactsJSON()
		trajs[i].FinishedAt = now().UnixMicro()
	}
	idx := make([]int, 0, n)
	reqs := make([]model.Request, 0, n)
	for turn := int32(0); ; turn++ {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("rollout: %w", err)
		}
		idx, reqs = idx[:0], reqs[:0]
		for i := range eps {
			e := &eps[i]
			if e.done {
				continue
			}
			if int(turn) >= lim.MaxTurns {
				finish(i, schemas.EndTruncated, ReasonMaxTurns)
				continue
			}
			if len(e.stream)+len(e.prompt)+s.MaxTokens+maxObservation > lim.MaxEpisodeTokens {
				finish(i, schemas.EndTruncated, ReasonTokenBudget)
				continue
			}
			ctxIDs := append(append(make([]int32, 0, len(e.stream)+len(e.prompt)), e.stream...), e.prompt...)
			idx = append(idx, i)
			tid := schemas.TurnID(atts[i].AttemptID, turn)
			reqs = append(reqs, model.Request{
				Context:  ctxIDs,
				Settings: s,
				Seed:     schemas.SeedFor(lim.ContractSeed, tid, "sample"),
				ID:       tid,
				Affinity: atts[i].GroupID,
			})
		}
		if len(idx) == 0 {
			return trajs, nil
		}
		t0 := now()
		samples, err := pol.Generate(ctx, reqs)
		if err != nil {
			return nil, fmt.Errorf("rollout: turn %d: %w", turn, err)
		}
		if len(samples) != len(reqs) {
			return nil, fmt.Errorf("rollout: turn %d: policy returned %d samples for %d requests", turn, len(samples), len(reqs))
		}
		gen := now().Sub(t0).Microseconds() / int64(len(reqs)) // batch latency, shared evenly
		for k, i := range idx {
			e := &eps[i]
			sm := samples[k]
			if len(sm.Tokens) != len(sm.Logprobs) {
				return nil, fmt.Errorf("rollout: turn %d: sample of %d tokens with %d log-probs", turn, len(sm.Tokens), len(sm.Logprobs))
			}
			t1 := now()
			tr, err := e.ep.Step(turn, sm.Tokens)
			if err != nil {
				return nil, fmt.Errorf("rollout: attempt %s: %w", atts[i].AttemptID, err)
			}
			trajs[i].Turns = append(trajs[i].Turns, schemas.Turn{
				Index:          turn,
				PromptIDs:      e.prompt,
				ActionIDs:      append([]int32(nil), sm.Tokens...),
				ActionLogprobs: append([]float32(nil), sm.Logprobs...),
				PolicyVersion:  sm.PolicyVersion,
				Decision:       tr.Decision,
				DecisionReason: tr.Reason,
				ObservationIDs: tr.Observation,
				Value:          float32(math.NaN()),
				GenLatencyUS:   gen,
				EnvLatencyUS:   now().Sub(t1).Microseconds(),
			})
			e.stream = append(append(append(e.stream, e.prompt...), sm.Tokens...), tr.Observation...)
			e.prompt = TurnPrompt()
			if tr.Terminated {
				finish(i, schemas.EndTerminated, ReasonAnswer)
			}
		}
	}
}

// DefaultSettings are the demo's sampler settings for the tasks of reg:
// temperature 1, no top-k/top-p, the task grammar, actions of at most 3
// tokens ending at END. Under them the training distribution equals the
// sampling distribution with the grammar recomputed from the stored tokens
// (model.Behavior).
func DefaultSettings(reg *Registry) model.Settings {
	return model.Settings{
		Behavior:  model.Behavior{Temperature: 1, Grammar: reg.Grammar()},
		MaxTokens: 3,
		Stop:      []int32{TokEnd},
	}
}
