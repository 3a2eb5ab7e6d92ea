package rollout

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Loader makes the policy snapshot of a release from its checkpoint's
// bytes, verifying the checkpoint hash (gpu.PolicyFromRelease).
type Loader func(rel schemas.PolicyRelease, checkpoint []byte) (*model.Policy, error)

// StageConfig configures the rollout operator.
type StageConfig struct {
	Registry *Registry
	Settings model.Settings // DefaultSettings(Registry) for the demo
	Limits   Limits
	Topics   pipeline.Topics
	RunID    string
	Load     Loader
	// Retries is how often a group whose episodes failed for a reason of
	// the infrastructure (policy server error, timeout) is run again, with
	// attempt numbers 1, 2, ...; the failures are census events with Infra
	// set, never task failures. After the last retry the input goes to
	// quarantine ("infra_exhausted").
	Retries int
	// Backoff is the wait before the first run again (default 100 ms),
	// doubled for each further one up to 32 times Backoff, so a service
	// that restarts has time to come back; the wait ends with ctx.
	Backoff time.Duration
	// GroupTimeout bounds one run of a group's episodes (0: none); a run
	// that exceeds it is an infrastructure timeout ("timed_out").
	GroupTimeout time.Duration
	// PolicyWait bounds how long Process waits for the policy version an
	// attempt asks for (0: until the operator stops).
	PolicyWait time.Duration
	Now        func() time.Time
	// Latency is the simulated latency of the built-in environment and
	// policy (the contract's latency section; zero: none). It wraps the
	// environment and the policy of every run (LatencyModel.Wrap), so the
	// agent loop is unchanged and tokens never depend on it.
	Latency LatencyModel
	// Continue is partial-rollout continuation (the contract's
	// dispatch.partial_rollouts continue, docs/SYSTEMS.md §7): an episode in
	// flight when a newer policy is loaded continues with it from its next
	// turn (following), instead of finishing on the snapshot its group
	// started with.
	Continue bool
	// Env is the environment the episodes run against; nil is Registry,
	// in process. An environment service's client (connectors/envsvc) is
	// injected by the operators registry; Registry still names the tasks
	// (split, versions) and its family must be the one Env serves.
	Env Environment
	// EnvRetries returns how many calls Env's client retried so far, by
	// reason (envsvc Counters().Retries); nil when Env retries nothing
	// itself. Every retry during a group's run becomes a census event
	// (CensusRetried), so the census accounts for each one. One stage per
	// client: the retries counted during a run are the run's.
	EnvRetries func() map[string]int64
	// Server, when set, is where the stage generates: policy server
	// replicas (the contract's policy section; the registry builds a
	// gateway). Releases are then not loaded here (Load is unused): the
	// stage follows the weights topic, where weight sync acknowledges the
	// version each replica serves, and a group waits until a replica
	// serves the version its attempts ask for.
	Server Server
	// Exact makes a group on a Server want exactly its attempts' version
	// (stop-and-synchronize mode) instead of that version or a newer one.
	Exact bool
	// RetryBackoff, when its Initial is set, replaces Backoff: the wait
	// before a group's retry after an infrastructure failure, Initial
	// doubling up to Max (the registry's for policy servers).
	RetryBackoff pipeline.Backoff
}

// Stage is the rollout operator: it consumes the tasks topic (one message
// per group), runs each group's episodes batched on the policy version the
// attempts ask for, and emits one trajectories message per group (keyed by
// group id) with census started/completed events.
//
// Policy versions (docs/SYSTEMS.md §8): the policy topic is a side input (the
// runtime tails it and calls Side); every newer release is loaded into a
// shadow slot (Load verifies the checkpoint hash; a release that fails to
// load is logged and skipped, the current version keeps serving), then new
// requests switch to it atomically. A
// group in flight keeps the snapshot it started with, so every token keeps
// the version that sampled it. Process waits until a version at least as
// new as the attempts' PolicyVersion is loaded; in stop-and-synchronize
// mode that is exactly the attempts' version.
type Stage struct {
	cfg StageConfig

	env *pipeline.Env

	mu      sync.Mutex
	current *model.Policy
	changed chan struct{} // closed and replaced on every switch

	reps *replicas // with a Server: the versions replicas serve
}

// NewStage validates cfg and returns the stage.
func NewStage(cfg StageConfig) (*Stage, error) {
	if cfg.Registry == nil || (cfg.Load == nil && cfg.Server == nil) {
		return nil, errors.New("rollout: stage needs a registry, and a loader or a policy server")
	}
	if err := cfg.Settings.Validate(); err != nil {
		return nil, fmt.Errorf("rollout: stage: %w", err)
	}
	if cfg.Limits.MaxTurns <= 0 || cfg.Limits.MaxEpisodeTokens <= 0 || cfg.Retries < 0 {
		return nil, fmt.Errorf("rollout: stage: limits %+v, retries %d", cfg.Limits, cfg.Retries)
	}
	if err := cfg.Latency.Validate(); err != nil {
		return nil, err
	}
	return &Stage{cfg: cfg, changed: make(chan struct{}), reps: newReplicas()}, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "rollout" }

// Topics implements pipeline.Stage.
func (s *Stage) Topics() []string { return s.cfg.Topics.Names(pipeline.InputsOf(s.Name())) }

// SideTopics implements pipeline.SideInputs: the policy topic (releases
// to load, in process) and the weights topic (the versions policy server
// replicas serve).
func (s *Stage) SideTopics() []string {
	return s.cfg.Topics.Names(pipeline.SideInputsOf(s.Name()))
}

// Start keeps the environment (its logger and the release files).
func (s *Stage) Start(_ context.Context, env *pipeline.Env) error {
	s.env = env
	if s.cfg.Now == nil {
		s.cfg.Now = env.Now
	}
	return nil
}

// Side implements pipeline.SideInputs: every ready release newer than the
// current version is loaded into a shadow slot (hash verified) and then
// switched to. A record that does not decode, or a release that fails to
// load, is logged and skipped: the current version keeps serving.
func (s *Stage) Side(_ context.Context, m pipeline.Message) error {
	if m.Topic == s.cfg.Topics.Weights {
		s.sideWeights(m)
		return nil
	}
	if s.cfg.Server != nil {
		return nil // weight sync loads releases into the servers
	}
	rel, err := schemas.DecodeRelease(m.Value)
	if err != nil || !rel.Ready {
		s.log().Warn("policy topic: record skipped", "source", m.Ref.String(), "err", err)
		return nil
	}
	s.offer(rel)
	return nil
}

func (s *Stage) log() *slog.Logger {
	if s.env != nil {
		return s.env.Logger
	}
	return slog.Default()
}

// offer loads rel into the shadow slot and switches to it if it is newer
// than the current version.
func (s *Stage) offer(rel schemas.PolicyRelease) {
	if cur := s.Policy(); cur != nil && cur.Version() >= rel.PolicyVersion {
		return
	}
	ckpt, err := s.readCheckpoint(rel.CheckpointURI)
	var p *model.Policy
	if err == nil {
		p, err = s.cfg.Load(rel, ckpt)
	}
	if err != nil {
		s.log().Error("policy release not loaded; keeping the current version", "version", rel.PolicyVersion, "err", err)
		return
	}
	s.Switch(p)
	s.env.Metrics().PolicyVersion("served", p.Version())
	s.log().Info("policy switched", "version", p.Version())
}

// readCheckpoint reads the checkpoint a manifest names, through the
// environment's release store when there is one.
func (s *Stage) readCheckpoint(uri string) ([]byte, error) {
	if s.env != nil {
		if rs, err := s.env.Releases(); err == nil {
			return rs.Read(uri)
		}
	}
	return pipeline.ReadURI(uri)
}

// Switch makes p the policy of new requests if it is newer than the
// current one (requests in flight keep theirs).
func (s *Stage) Switch(p *model.Policy) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.current != nil && s.current.Version() >= p.Version() {
		return
	}
	s.current = p
	close(s.changed)
	s.changed = make(chan struct{})
}

// Policy returns the current policy snapshot (nil before the first).
func (s *Stage) Policy() *model.Policy {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.current
}

// await returns a snapshot of version >= v.
func (s *Stage) await(ctx context.Context, v int64) (*model.Policy, error) {
	if s.cfg.PolicyWait > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.cfg.PolicyWait)
		defer cancel()
	}
	for {
		s.mu.Lock()
		cur, ch := s.current, s.changed
		s.mu.Unlock()
		if cur != nil && cur.Version() >= v {
			return cur, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("rollout: waiting for policy version %d: %w", v, ctx.Err())
		case <-ch:
		}
	}
}

// Process implements pipeline.Stage.
func (s *Stage) Process(ctx context.Context, m pipeline.Message) (pipeline.Result, error) {
	atts, err := stagekit.Decode(schemas.TaskAttempts, m)
	if err != nil {
		return pipeline.Result{}, err
	}
	if err := stagekit.CheckID(&m, atts[0].GroupID); err != nil {
		return pipeline.Result{}, err
	}
	now := s.now()
	want := int64(0)
	for _, a := range atts {
		if a.Split == schemas.SplitEval || s.cfg.Registry.IsEval(a.TaskID) {
			// docs/PIPELINE.md §6: hidden-eval tasks never enter the training
			// stream; a dispatcher that sent one is an incident.
			inc, ierr := stagekit.IncidentOutput(s.cfg.Topics.Incidents, stagekit.Incident{
				RunID: a.RunID, AttemptID: a.AttemptID, TaskID: a.TaskID, Stage: s.Name(),
				Reason: "eval_task_id", Detail: "hidden-eval task on the tasks topic", Source: m.Ref.String(), At: now.UnixMicro(),
			})
			if ierr != nil {
				return pipeline.Result{}, ierr
			}
			r := pipeline.Refuse("eval_task_id", "attempt %s of hidden-eval task %s", a.AttemptID, a.TaskID)
			r.Also = []pipeline.Output{inc}
			return pipeline.Result{}, r
		}
		want = max(want, a.PolicyVersion)
	}
	pol, version, err := s.policyFor(ctx, want)
	if err != nil {
		return pipeline.Result{}, err // the operator stops; the group is redelivered
	}
	var res pipeline.Result
	census := func(a schemas.TaskAttempt, kind, reason string, infra bool, tokens, lat int64, at time.Time) error {
		ev, err := stagekit.Census(s.cfg.Topics.Census, schemas.CensusEvent{
			RunID: a.RunID, AttemptID: a.AttemptID, TaskID: a.TaskID, GroupID: a.GroupID, Kind: kind,
			Stage: s.Name(), Reason: reason, Infra: infra, PolicyVersion: version, Tokens: tokens,
			LatencyUS: lat, At: at.UnixMicro(),
		})
		if err == nil {
			res.Outputs = append(res.Outputs, ev)
		}
		return err
	}
	for try := 0; ; try++ {
		if err := s.pause(ctx, try); err != nil {
			return pipeline.Result{}, err // stopping: redelivered later
		}
		run := make([]schemas.TaskAttempt, len(atts))
		for i, a := range atts {
			if try > 0 {
				a.Attempt = int32(try)
				a.AttemptID = schemas.AttemptID(a.RunID, a.TaskID, a.GroupID, a.Member, a.Attempt)
				a.Seed = int64(schemas.SeedFor(s.cfg.Limits.ContractSeed, a.AttemptID, "env"))
			}
			run[i] = a
		}
		start := s.now()
		// The started events go out now when the runtime can emit them:
		// pack reads them to know which episodes are running, on which
		// version (its earliest-deadline-first windows).
		first := len(res.Outputs)
		for _, a := range run {
			if err := census(a, schemas.CensusStarted, "", false, 0, 0, start); err != nil {
				return pipeline.Result{}, err
			}
		}
		if sent, err := s.env.Emit(ctx, res.Outputs[first:]...); err != nil {
			return pipeline.Result{}, fmt.Errorf("rollout: group %s: emit started events: %w", atts[0].GroupID, err)
		} else if sent {
			res.Outputs = res.Outputs[:first]
		}
		rctx, cancel := ctx, context.CancelFunc(func() {})
		if s.cfg.GroupTimeout > 0 {
			rctx, cancel = context.WithTimeout(ctx, s.cfg.GroupTimeout)
		}
		lim := s.cfg.Limits
		if lim.Now == nil {
			lim.Now = s.now
		}
		before := s.envRetries()
		err := s.prepare(rctx)
		var trajs []schemas.Trajectory
		if err == nil {
			trajs, err = s.runEpisodes(rctx, pol, run, lim)
		}
		cancel()
		end := s.now()
		retried, rerr := s.retryEvents(run[0], version, before, end)
		if rerr != nil {
			return pipeline.Result{}, rerr
		}
		res.Outputs = append(res.Outputs, retried...)
		if err == nil {
			out, err := stagekit.Encode(schemas.Trajectories, s.cfg.Topics.Trajectories, run[0].GroupID,
				stagekit.MessageID(s.Name(), run[0].GroupID), trajs)
			if err != nil {
				return pipeline.Result{}, err
			}
			res.Outputs = append(res.Outputs, out)
			for i, a := range run {
				n, _, _ := schemas.TurnsUsage(trajs[i].Turns)
				if err := census(a, schemas.CensusCompleted, trajs[i].EndReason, false, n, end.Sub(start).Microseconds(), end); err != nil {
					return pipeline.Result{}, err
				}
			}
			return res, nil
		}
		if ctx.Err() != nil {
			return pipeline.Result{}, ctx.Err() // stopping: redelivered later
		}
		kind, reason := schemas.CensusFailed, "infra_error"
		switch r := InfraReason(err); {
		case r != "":
			reason = "policy_" + r // a policy server's failure, by reason (its own timeouts included)
		case errors.Is(err, context.DeadlineExceeded):
			kind, reason = schemas.CensusTimedOut, "timed_out"
		}
		s.log().Warn("group failed for a reason of the infrastructure", "group", run[0].GroupID, "try", try, "reason", reason, "err", err)
		for _, a := range run {
			if cerr := census(a, kind, reason, true, 0, end.Sub(start).Microseconds(), end); cerr != nil {
				return pipeline.Result{}, cerr
			}
		}
		if try >= s.cfg.Retries {
			// The last try's attempts are quarantined with the group's
			// tasks record: the census says so, so that no attempt is
			// unaccounted for.
			for _, a := range run {
				if cerr := census(a, schemas.CensusQuarantined, "infra_exhausted", true, 0, 0, end); cerr != nil {
					return pipeline.Result{}, cerr
				}
			}
			r := pipeline.Refuse("infra_exhausted", "group %s: %d tries: %v", run[0].GroupID, try+1, err)
			r.Also = res.Outputs
			return pipeline.Result{}, r
		}
	}
}

// now is the stage's clock (stagekit.Now).
func (s *Stage) now() time.Time { return stagekit.Now(s.cfg.Now) }

// policyFor is the policy a group whose attempts want version v runs on,
// once it is there: the in-process snapshot (version >= v), or the policy
// servers (a replica serving v) — and the version its census events name.
func (s *Stage) policyFor(ctx context.Context, v int64) (Policy, int64, error) {
	if s.cfg.Server != nil {
		p, err := s.awaitServed(ctx, v)
		return p, v, err
	}
	p, err := s.await(ctx, v)
	if err != nil {
		return nil, 0, err
	}
	return p, p.Version(), nil
}

// wait waits d or until ctx ends.
func wait(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
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

// Close closes the policy server (its health checks) when it has a
// Close method.
func (s *Stage) Close() error {
	if c, ok := s.cfg.Server.(interface{ Close() }); ok {
		c.Close()
	}
	return nil
}
