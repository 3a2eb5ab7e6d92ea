package rollout

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/stagekit"
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
	// longest action (Settings.MaxTokens) and the longest observation fit;
	// otherwise the episode is truncated with ReasonTokenBudget. The
	// longest observation is Spec.MaxObservation tokens for a token family
	// (2 for kv), and for a text family the bytes of the rendered tool
	// message around an observation of Spec.MaxObservation bytes (a token
	// covers at least one byte).
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

// maxObservation is the longest observation the kv family renders.
const maxObservation = 2

// RunEpisode runs one attempt (RunEpisodes with one attempt).
func (r *Registry) RunEpisode(ctx context.Context, pol Policy, a schemas.TaskAttempt, s model.Settings, lim Limits) (schemas.Trajectory, error) {
	out, err := r.RunEpisodes(ctx, pol, []schemas.TaskAttempt{a}, s, lim)
	if err != nil {
		return schemas.Trajectory{}, err
	}
	return out[0], nil
}

// RunEpisodes runs the agent loop (Agent.Run) for atts against the
// registry's in-process environment. A text family needs pol to implement
// Tokenizer too (a policy server's client does).
func (r *Registry) RunEpisodes(ctx context.Context, pol Policy, atts []schemas.TaskAttempt, s model.Settings, lim Limits) ([]schemas.Trajectory, error) {
	tok, _ := pol.(Tokenizer)
	return Agent{Env: r, Policy: pol, Tokenizer: tok, Settings: s, Limits: lim}.Run(ctx, atts)
}

// Agent is the agent loop of docs/PIPELINE.md §7 over an Environment: the
// registry in process, or an environment service through its client.
type Agent struct {
	Env    Environment
	Policy Policy
	// Tokenizer renders and tokenizes the observations of text episodes
	// (the policy server's own); token episodes do not use it.
	Tokenizer Tokenizer
	Settings  model.Settings
	Limits    Limits
}

// Concurrent is implemented by environments whose calls are worth
// overlapping (a remote service): the agent loop then has up to
// Concurrency() Reset, Step and Close calls of different episodes in
// flight at once. Results do not depend on it.
type Concurrent interface {
	Concurrency() int
}

// Run runs many attempts at once: every turn, it renders each live
// episode's prompt, asks the policy for all of their actions in one
// Generate call, then steps each episode with its action (the environment
// parses, authorizes and executes it). It returns one trajectory per
// attempt, in order.
//
// Per turn it logs PromptIDs (turn 0: the whole prompt; later: the delta,
// kv's ACT or a chat template's generation prompt), ActionIDs and
// ActionLogprobs exactly as sampled, the sample's policy version, the
// decision and its reason, ObservationIDs (a text observation tokenized by
// the policy server's tokenizer and appended; earlier turns are never
// re-tokenized), Value = NaN (no critic) and the generation and
// environment latencies. An episode ends terminated (ReasonAnswer) or
// truncated (ReasonMaxTurns, ReasonTokenBudget); Status is completed;
// BootstrapValue is NaN; Artifacts is what the episode's Close returned.
//
// Each request's seed depends only on the attempt id and turn, and the
// sampler's result does not depend on the batch, so a trajectory's tokens
// do not depend on which other attempts ran beside it. An unknown task, a
// version mismatch, a policy or environment error fails the call (an
// infrastructure failure for the caller to retry; every live episode is
// closed with ReasonAborted first), as does ctx ending.
func (ag Agent) Run(ctx context.Context, atts []schemas.TaskAttempt) ([]schemas.Trajectory, error) {
	s, lim := ag.Settings, ag.Limits
	if ag.Env == nil || ag.Policy == nil {
		return nil, errors.New("rollout: agent needs an environment and a policy")
	}
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
	par := 1
	if c, ok := ag.Env.(Concurrent); ok {
		par = max(1, c.Concurrency())
	}
	type live struct {
		ep     Episode
		spec   Spec
		text   *textRenderer // ObsText episodes
		maxObs int           // tokens the next observation may take
		stream []int32       // every token so far
		prompt []int32       // the prompt of the next turn
		done   bool          // ended (finish)
		closed bool          // Close returned
	}
	n := len(atts)
	eps := make([]live, n)
	trajs := make([]schemas.Trajectory, n)
	sid := s.ID()
	if r, ok := ag.Policy.(SamplerRecorder); ok {
		sid = r.SamplerID(s) // a policy server's: its identity is part of the sample
	}
	// Every episode that was reset is closed exactly once: by finish, or
	// here (ReasonAborted) when the loop fails.
	failed := true
	defer func() {
		if !failed {
			return
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = each(cctx, n, par, func(i int) error {
			if eps[i].ep != nil && !eps[i].closed {
				_, _ = eps[i].ep.Close(cctx, ReasonAborted)
			}
			return nil
		})
	}()
	// Each attempt's span of rollout, in the attempt's trace (child of
	// dispatch's): its environment steps are its children.
	actx := make([]context.Context, n)
	for i := range atts {
		c, span := stagekit.StartAttempt(ctx, "rollout", "dispatch", atts[i].AttemptID)
		if !span.IsRecording() {
			c = attemptTrace(ctx, atts[i].AttemptID)
		}
		actx[i] = c
	}
	defer func() {
		for i := range actx {
			span := trace.SpanFromContext(actx[i])
			if failed {
				span.SetStatus(codes.Error, "episode aborted")
			} else if len(trajs[i].Turns) > 0 {
				span.SetAttributes(attribute.Int("trajflow.turns", len(trajs[i].Turns)), attribute.String("trajflow.end_reason", trajs[i].EndReason))
			}
			span.End()
		}
	}()
	err := each(ctx, n, par, func(i int) error {
		a := atts[i]
		ep, obs, err := ag.Env.Reset(ctx, a)
		if err != nil {
			return fmt.Errorf("rollout: attempt %s: %w", a.AttemptID, err)
		}
		e := &eps[i]
		e.ep, e.spec = ep, ep.Spec()
		if err := e.spec.Validate(); err != nil {
			return fmt.Errorf("%w: attempt %s: %v", ErrEnvironment, a.AttemptID, err)
		}
		tokHash, tplHash := e.spec.TokenizerHash, ""
		switch e.spec.Observations {
		case ObsTokens:
			if len(obs.IDs) == 0 {
				return fmt.Errorf("%w: attempt %s: empty first observation", ErrEnvironment, a.AttemptID)
			}
			e.prompt, e.maxObs = obs.IDs, e.spec.MaxObservation
		case ObsText:
			if ag.Tokenizer == nil {
				return fmt.Errorf("rollout: attempt %s: the %s family speaks text: the agent needs the policy server's Tokenizer", a.AttemptID, e.spec.Family)
			}
			if len(obs.Messages) == 0 {
				return fmt.Errorf("%w: attempt %s: no first messages", ErrEnvironment, a.AttemptID)
			}
			tr, prompt, err := newTextRenderer(ctx, ag.Tokenizer, obs.Messages, e.spec.MaxObservation)
			if err != nil {
				return fmt.Errorf("rollout: attempt %s: %w", a.AttemptID, err)
			}
			e.text, e.prompt, e.maxObs = tr, prompt, tr.maxObsTokens
			tokHash, tplHash = ag.Tokenizer.TokenizerHash(), ag.Tokenizer.ChatTemplateHash()
		}
		trajs[i] = schemas.Trajectory{
			RecordID: a.AttemptID, RunID: a.RunID, TaskID: a.TaskID, TaskVersion: a.TaskVersion,
			Domain: a.Domain, Split: a.Split, EnvVersion: a.EnvVersion, GroupID: a.GroupID,
			GroupSize: a.GroupSize, Member: a.Member, Attempt: a.Attempt, Seed: a.Seed,
			ContractHash: a.ContractHash, SamplerID: sid, ParserVersion: e.spec.ParserVersion,
			TokenizerHash: tokHash, ChatTemplateHash: tplHash, Status: schemas.StatusCompleted,
			BootstrapValue: float32(math.NaN()), StartedAt: now().UnixMicro(),
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	type ending struct {
		i           int
		end, reason string
	}
	var ends []ending
	finish := func(i int, end, reason string) {
		eps[i].done = true
		trajs[i].End, trajs[i].EndReason = end, reason
		ends = append(ends, ending{i, end, reason})
	}
	closeEnded := func() error {
		err := each(ctx, len(ends), par, func(k int) error {
			i := ends[k].i
			fin, err := eps[i].ep.Close(ctx, ends[k].reason)
			if err != nil {
				return fmt.Errorf("rollout: attempt %s: close: %w", atts[i].AttemptID, err)
			}
			eps[i].closed = true
			trajs[i].Artifacts = fin.Artifacts
			trajs[i].FinishedAt = now().UnixMicro()
			return nil
		})
		ends = ends[:0]
		return err
	}
	idx := make([]int, 0, n)
	reqs := make([]model.Request, 0, n)
	type stepped struct {
		tr  Transition
		obs []int32
		lat int64
	}
	res := make([]stepped, n)
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
			if len(e.stream)+len(e.prompt)+s.MaxTokens+e.maxObs > lim.MaxEpisodeTokens {
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
		if err := closeEnded(); err != nil {
			return nil, err
		}
		if len(idx) == 0 {
			failed = false
			return trajs, nil
		}
		t0 := now()
		gctx, gspan := tracerOf(ctx).Start(ctx, "rollout generate", trace.WithAttributes(
			attribute.Int("trajflow.turn", int(turn)), attribute.Int("trajflow.requests", len(reqs))))
		samples, err := ag.Policy.Generate(gctx, reqs)
		endTraced(gspan, err)
		if err != nil {
			return nil, fmt.Errorf("rollout: turn %d: %w", turn, err)
		}
		if len(samples) != len(reqs) {
			return nil, fmt.Errorf("rollout: turn %d: policy returned %d samples for %d requests", turn, len(samples), len(reqs))
		}
		gen := now().Sub(t0).Microseconds() / int64(len(reqs)) // batch latency, shared evenly
		for k := range idx {
			if sm := samples[k]; len(sm.Tokens) != len(sm.Logprobs) {
				return nil, fmt.Errorf("rollout: turn %d: sample of %d tokens with %d log-probs", turn, len(sm.Tokens), len(sm.Logprobs))
			}
		}
		err = each(ctx, len(idx), par, func(k int) error {
			i := idx[k]
			e := &eps[i]
			sm := samples[k]
			act := EnvAction{IDs: sm.Tokens}
			if e.text != nil {
				txt, err := ag.Tokenizer.Detokenize(ctx, sm.Tokens)
				if err != nil {
					return fmt.Errorf("rollout: attempt %s: detokenize: %w", atts[i].AttemptID, err)
				}
				act.Text = txt
			}
			t1 := now()
			sctx, sspan := tracerOf(ctx).Start(actx[i], "rollout env step", trace.WithAttributes(
				attribute.String("trajflow.attempt_id", atts[i].AttemptID), attribute.Int("trajflow.turn", int(turn)),
				attribute.Int("trajflow.action_tokens", len(sm.Tokens))))
			tr, err := e.ep.Step(sctx, turn, act)
			if err == nil {
				sspan.SetAttributes(attribute.String("trajflow.decision", tr.Decision))
			}
			endTraced(sspan, err)
			if err != nil {
				return fmt.Errorf("rollout: attempt %s: %w", atts[i].AttemptID, err)
			}
			lat := now().Sub(t1).Microseconds()
			obs, err := observationIDs(ctx, e.spec, e.text, sm.Tokens, tr)
			if err != nil {
				return fmt.Errorf("rollout: attempt %s turn %d: %w", atts[i].AttemptID, turn, err)
			}
			res[i] = stepped{tr: tr, obs: obs, lat: lat}
			return nil
		})
		if err != nil {
			return nil, err
		}
		for k, i := range idx {
			e := &eps[i]
			sm := samples[k]
			st := res[i]
			res[i] = stepped{}
			trajs[i].Turns = append(trajs[i].Turns, schemas.Turn{
				Index:          turn,
				PromptIDs:      e.prompt,
				ActionIDs:      append([]int32(nil), sm.Tokens...),
				ActionLogprobs: append([]float32(nil), sm.Logprobs...),
				PolicyVersion:  sm.PolicyVersion,
				Decision:       st.tr.Decision,
				DecisionReason: st.tr.Reason,
				ObservationIDs: st.obs,
				Value:          float32(math.NaN()),
				GenLatencyUS:   gen,
				EnvLatencyUS:   st.lat,
			})
			e.stream = append(append(append(e.stream, e.prompt...), sm.Tokens...), st.obs...)
			if e.text != nil {
				e.prompt = slices.Clone(e.text.genPrompt)
			} else {
				e.prompt = slices.Clone(e.spec.TurnPrompt)
			}
			if st.tr.Terminated {
				finish(i, schemas.EndTerminated, ReasonAnswer)
			}
		}
	}
}

// observationIDs returns the tokens a transition appends to the stream:
// a token episode's ids as they are; a text episode's tool output rendered
// as a tool message by the chat template and tokenized. It refuses an
// observation that breaks the episode's spec.
func observationIDs(ctx context.Context, spec Spec, tr *textRenderer, action []int32, t Transition) ([]int32, error) {
	o := t.Observation
	if tr == nil {
		if len(o.IDs) > spec.MaxObservation || o.Text != "" || len(o.Messages) > 0 {
			return nil, fmt.Errorf("%w: observation of %d ids (at most %d), %d text bytes, %d messages", ErrEnvironment, len(o.IDs), spec.MaxObservation, len(o.Text), len(o.Messages))
		}
		return o.IDs, nil
	}
	if len(o.IDs) > 0 || len(o.Messages) > 0 {
		return nil, fmt.Errorf("%w: a text episode returned token ids or messages", ErrEnvironment)
	}
	if o.Text == "" && t.Terminated {
		return nil, nil
	}
	if len(o.Text) > spec.MaxObservation {
		return nil, fmt.Errorf("%w: observation of %d bytes, at most %d", ErrEnvironment, len(o.Text), spec.MaxObservation)
	}
	if !IsEscaped(o.Text) {
		return nil, fmt.Errorf("%w: observation text is not escaped (tool output must never carry markup)", ErrEnvironment)
	}
	return tr.observation(ctx, action, o.Text)
}

// each calls f(0..n-1), at most par at once (in order when par is 1), and
// returns the error of the lowest index that failed.
func each(ctx context.Context, n, par int, f func(i int) error) error {
	if par <= 1 || n <= 1 {
		for i := 0; i < n; i++ {
			if err := f(i); err != nil {
				return err
			}
		}
		return nil
	}
	errs := make([]error, n)
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		if ctx.Err() != nil {
			errs[i] = ctx.Err()
			continue
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			errs[i] = f(i)
		}()
	}
	wg.Wait()
	return firstNonNil(errs)
}

func firstNonNil(errs []error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// DefaultSettings are the demo's sampler settings for the tasks of reg:
// temperature 1, no top-k/top-p, the task grammar, actions of at most 3
// tokens ending at END. Under them the training distribution equals the
// sampling distribution with the grammar recomputed from the stored tokens
// (model.Behavior). For the text family: temperature 1, actions of at
// most 48 tokens, no grammar and no stop ids (a policy server's client
// adds its end-of-turn token and the family's closing tags as stops).
func DefaultSettings(reg *Registry) model.Settings {
	if reg.Family() == FamilyText {
		return model.Settings{Behavior: model.Behavior{Temperature: 1}, MaxTokens: 48}
	}
	return model.Settings{
		Behavior:  model.Behavior{Temperature: 1, Grammar: reg.Grammar()},
		MaxTokens: 3,
		Stop:      []int32{TokEnd},
	}
}

// tracerOf is the rollout tracer of the provider of ctx's span (the
// operator's, when the stage runs in one; a no-op otherwise).
func tracerOf(ctx context.Context) trace.Tracer {
	return trace.SpanFromContext(ctx).TracerProvider().Tracer("github.com/trajflow/trajflow/operators/rollout")
}

// attemptTrace is ctx under the span of the attempt's traceparent (trace
// id derived from the attempt id, as on every record of the attempt), so
// that the environment steps of an attempt join its trace.
func attemptTrace(ctx context.Context, attemptID string) context.Context {
	return propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{"traceparent": stagekit.TraceParent(attemptID)})
}

// endTraced ends span, recording err.
func endTraced(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
