// Package weightsync is the weight sync operator (docs/SYSTEMS.md §8 "Policy
// versioning and weight publication"): it consumes the policy topic and
// loads every newer ready release into every policy server replica with
// that replica's own calls (through the Replica interface: the registry
// adapts connectors/policy/weightsync, which this package does not
// import), verifies what the replica then serves, and acknowledges each
// replica's version on the weights topic. The rollout stage follows the
// weights topic and sends a group only to replicas that acknowledged the
// version it wants; requests in flight finish on the version they started
// on (every protocol's switch is atomic: docs/SYSTEMS.md §8 "never update weights
// partially in place").
//
// A replica whose load fails (down, a failed verification) is
// acknowledged with Loaded false and the error, keeps serving what it
// served, and is tried again with the newest release every RetryInterval
// (Tick) until it succeeds: a failure is never dropped silently, and a
// replica that comes back catches up.
package weightsync

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Replica is one policy server replica.
type Replica interface {
	// Name is the replica's name on the weights topic (the rollout
	// stage's gateway knows it by the same name).
	Name() string
	// Protocol is llamacpp, sglang or vllm.
	Protocol() string
	// Load loads rel with the replica's calls and verifies what it serves
	// (the returned acknowledgement's Version, Model, Checksum, Unloaded;
	// the stage fills the rest). An error says the replica does not serve
	// the release.
	Load(ctx context.Context, rel schemas.PolicyRelease) (schemas.WeightAck, error)
}

// ErrConfig is wrapped by configuration errors of NewStage.
var ErrConfig = errors.New("weightsync: bad config")

// StageConfig configures the operator.
type StageConfig struct {
	Replicas []Replica
	Topics   pipeline.Topics
	RunID    string
	// Attempts bounds the loads of one release into one replica within a
	// Process (0: 3), with LoadBackoff between them (zero: 500 ms doubling
	// to 5 s).
	Attempts    int
	LoadBackoff pipeline.Backoff
	// RetryInterval is how often Tick tries again the replicas whose last
	// load failed (0: 5 s).
	RetryInterval time.Duration
	Now           func() time.Time
}

// Stage is the weight sync operator.
type Stage struct {
	cfg StageConfig
	log *slog.Logger

	latest *schemas.PolicyRelease // newest release loaded (or tried)
	failed map[string]bool        // replicas whose last load of latest failed
	last   time.Time              // last retry of the failed ones
}

// NewStage validates cfg and returns the stage.
func NewStage(cfg StageConfig) (*Stage, error) {
	if len(cfg.Replicas) == 0 {
		return nil, fmt.Errorf("%w: no replicas (the contract's policy.endpoints)", ErrConfig)
	}
	seen := map[string]bool{}
	for _, r := range cfg.Replicas {
		if seen[r.Name()] {
			return nil, fmt.Errorf("%w: two replicas named %q", ErrConfig, r.Name())
		}
		seen[r.Name()] = true
	}
	if cfg.Attempts <= 0 {
		cfg.Attempts = 3
	}
	if cfg.LoadBackoff == (pipeline.Backoff{}) {
		cfg.LoadBackoff = pipeline.Backoff{Initial: 500 * time.Millisecond, Max: 5 * time.Second}
	}
	cfg.LoadBackoff.Attempts = cfg.Attempts
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = 5 * time.Second
	}
	return &Stage{cfg: cfg, failed: map[string]bool{}, log: slog.Default()}, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "weightsync" }

// Topics implements pipeline.Stage: the policy topic.
func (s *Stage) Topics() []string { return s.cfg.Topics.Names(pipeline.InputsOf(s.Name())) }

// Start keeps the logger and the clock.
func (s *Stage) Start(_ context.Context, env *pipeline.Env) error {
	s.log = env.Logger
	if s.cfg.Now == nil {
		s.cfg.Now = env.Now
	}
	return nil
}

// Process implements pipeline.Stage: a ready release newer than the last
// one is loaded into every replica, each acknowledged on the weights
// topic. Older releases (the compacted topic replayed) and releases not
// ready produce nothing.
func (s *Stage) Process(ctx context.Context, m pipeline.Message) (pipeline.Result, error) {
	last := int64(-1)
	if s.latest != nil {
		last = s.latest.PolicyVersion
	}
	rel, newer, err := stagekit.NewerRelease(&m, last)
	if err != nil || !newer {
		return pipeline.Result{}, err
	}
	s.latest = &rel
	clear(s.failed)
	outs, err := s.load(ctx, s.cfg.Replicas)
	if err != nil {
		return pipeline.Result{}, err
	}
	s.last = s.now()
	return pipeline.Result{Outputs: outs}, nil
}

// Tick tries again, with the newest release, the replicas whose last load
// failed, every RetryInterval.
func (s *Stage) Tick(ctx context.Context, now time.Time) (pipeline.Result, error) {
	if s.latest == nil || len(s.failed) == 0 || now.Sub(s.last) < s.cfg.RetryInterval {
		return pipeline.Result{}, nil
	}
	var again []Replica
	for _, r := range s.cfg.Replicas {
		if s.failed[r.Name()] {
			again = append(again, r)
		}
	}
	outs, err := s.load(ctx, again)
	s.last = now
	if err != nil {
		return pipeline.Result{}, err
	}
	return pipeline.Result{Outputs: outs}, nil
}

// load loads the latest release into reps concurrently and returns one
// acknowledgement per replica, in configuration order.
func (s *Stage) load(ctx context.Context, reps []Replica) ([]pipeline.Output, error) {
	rel := *s.latest
	acks := make([]schemas.WeightAck, len(reps))
	var wg sync.WaitGroup
	for i, r := range reps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var ack schemas.WeightAck
			err := pipeline.Retry(ctx, s.cfg.LoadBackoff, func(ctx context.Context, attempt int) error {
				var err error
				ack, err = r.Load(ctx, rel)
				if err != nil {
					s.log.Warn("weight sync: load failed", "replica", r.Name(), "version", rel.PolicyVersion, "attempt", attempt, "err", err)
				}
				return err
			})
			if err != nil {
				ack = schemas.WeightAck{Version: rel.PolicyVersion, Error: err.Error()}
			} else {
				ack.Loaded = true
			}
			ack.RunID, ack.Replica, ack.Protocol = s.cfg.RunID, r.Name(), r.Protocol()
			acks[i] = ack
		}()
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err // stopping: the release is redelivered
	}
	outs := make([]pipeline.Output, 0, len(acks))
	for _, a := range acks {
		if a.Loaded {
			delete(s.failed, a.Replica)
			s.log.Info("weight sync: replica serves the release", "replica", a.Replica, "version", a.Version, "checksum", a.Checksum, "unloaded", a.Unloaded)
		} else {
			s.failed[a.Replica] = true
			s.log.Error("weight sync: replica did not load the release; it keeps serving what it served and is tried again", "replica", a.Replica, "version", a.Version, "err", a.Error)
		}
		a.At = s.now().UnixMicro()
		b, err := schemas.EncodeWeightAck(a)
		if err != nil {
			return nil, err
		}
		id := schemas.DerivedID("weightsync", fmt.Sprintf("%s/%d/%v", a.Replica, a.Version, a.Loaded))
		outs = append(outs, pipeline.Output{Topic: s.cfg.Topics.Weights, Key: []byte(a.Replica), Value: b,
			Headers: stagekit.Headers(schemas.KindWeightAck, id)})
	}
	return outs, nil
}

// Failed lists the replicas whose last load failed, sorted.
func (s *Stage) Failed() []string {
	var out []string
	for n := range s.failed {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func (s *Stage) now() time.Time { return stagekit.Now(s.cfg.Now) }
