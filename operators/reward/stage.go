package reward

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/operators/validate"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// StageConfig configures the reward operator.
type StageConfig struct {
	Components []Component
	Registry   *Registry
	Topics     pipeline.Topics
	Check      validate.RewardOptions
	// Retries is how many times a trajectory whose evaluators failed is
	// scored again before it is quarantined as infrastructure-invalid
	// (docs/PIPELINE.md §8: "distinguish validator failure from agent failure").
	Retries int
	Backoff time.Duration
	Now     func() time.Time
}

// Stage is the reward operator (docs/PIPELINE.md §8): every valid trajectory is
// scored by each declared component's evaluator, components kept separate.
// A trajectory whose evaluators keep failing goes to quarantine with reason
// reward_unavailable — an infrastructure failure, never a task failure.
type Stage struct {
	cfg StageConfig
	env *pipeline.Env // reports the rewards (Env.Metrics)
}

// NewStage validates cfg and returns the stage.
func NewStage(cfg StageConfig) (*Stage, error) {
	if cfg.Registry == nil {
		return nil, errors.New("reward: stage without registry")
	}
	if err := ValidateComponents(cfg.Components); err != nil {
		return nil, err
	}
	for _, c := range cfg.Components {
		e, ok := cfg.Registry.Lookup(c.Name)
		if !ok {
			return nil, fmt.Errorf("%w: component %q", ErrUnknownEvaluator, c.Name)
		}
		if e.Version() != c.Version {
			return nil, fmt.Errorf("%w: component %q declared %q, evaluator %q", ErrVersionMismatch, c.Name, c.Version, e.Version())
		}
	}
	if cfg.Backoff <= 0 {
		cfg.Backoff = 50 * time.Millisecond
	}
	return &Stage{cfg: cfg}, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "reward" }

// Topics implements pipeline.Stage.
func (s *Stage) Topics() []string { return s.cfg.Topics.Names(pipeline.InputsOf(s.Name())) }

// Start takes the runtime's clock when none is configured.
func (s *Stage) Start(_ context.Context, env *pipeline.Env) error {
	s.env = env
	if s.cfg.Now == nil {
		s.cfg.Now = env.Now
	}
	return nil
}

// Process implements pipeline.Stage.
func (s *Stage) Process(ctx context.Context, m pipeline.Message) (pipeline.Result, error) {
	rows, err := stagekit.Decode(schemas.Trajectories, m)
	if err != nil {
		return pipeline.Result{}, err
	}
	defer stagekit.TraceAttempts(ctx, s.Name(), "validate", time.Now(), len(rows), func(i int) string { return rows[i].RecordID })
	ids := make([]string, len(rows))
	for i := range rows {
		ids[i] = rows[i].RecordID
	}
	if err := stagekit.CheckID(&m, stagekit.MessageID("validate", ids...)); err != nil {
		return pipeline.Result{}, err
	}
	ids = ids[:0]
	// Members refused upstream stay declared; this stage's refusals join them.
	absent, err := stagekit.AbsentOf(&m)
	if err != nil {
		return pipeline.Result{}, err
	}
	var res pipeline.Result
	out := make([]schemas.Rewarded, 0, len(rows))
	for i := range rows {
		t := &rows[i]
		r, v, err := s.score(ctx, t)
		if err != nil {
			return pipeline.Result{}, err
		}
		if v.OK() {
			s.env.Metrics().Rewarded(&r)
			out = append(out, r)
			ids = append(ids, t.RecordID)
			continue
		}
		outs, err := stagekit.RefuseRow(schemas.Trajectories, s.cfg.Topics, s.Name(), m, i, *t, stagekit.Refused{
			RunID: t.RunID, AttemptID: t.RecordID, TaskID: t.TaskID, GroupID: t.GroupID,
			Reason: v.Reason, Detail: v.Detail, Infra: v.Infra(), At: s.now().UnixMicro(), Turns: t.Turns,
		})
		if err != nil {
			return pipeline.Result{}, err
		}
		res.Outputs = append(res.Outputs, outs...)
		absent.Add(t.GroupID, t.Member, t.GroupSize)
	}
	if len(out) > 0 {
		o, err := stagekit.Encode(schemas.RewardedTrajectories, s.cfg.Topics.Rewarded, string(m.Key), stagekit.MessageID(s.Name(), ids...), out)
		if err != nil {
			return pipeline.Result{}, err
		}
		res.Outputs = append(res.Outputs, stagekit.WithAbsent(o, absent))
	}
	return res, nil
}

// score runs the evaluators, retrying evaluator failures with backoff
// (pipeline.Retry: a stop never waits for a backoff).
func (s *Stage) score(ctx context.Context, t *schemas.Trajectory) (schemas.Rewarded, validate.Verdict, error) {
	var r schemas.Rewarded
	var v validate.Verdict
	var scoreErr error
	err := pipeline.Retry(ctx, pipeline.Backoff{Attempts: s.cfg.Retries + 1, Initial: s.cfg.Backoff, Max: 32 * s.cfg.Backoff},
		func(ctx context.Context, _ int) error {
			if r, scoreErr = Score(ctx, t, s.cfg.Components, s.cfg.Registry); scoreErr != nil {
				return fmt.Errorf("%w: %w", pipeline.ErrPermanent, scoreErr)
			}
			if v = validate.CheckRewarded(&r, s.cfg.Check); !v.OK() && v.Reason == validate.ReasonRewardUnavailable {
				return errRewardUnavailable
			}
			return nil
		})
	switch {
	case err == nil, errors.Is(err, errRewardUnavailable):
		// After the last retry an unavailable reward is the verdict.
		return r, v, nil
	case errors.Is(err, pipeline.ErrPermanent):
		return r, v, fmt.Errorf("reward: %s: %w", t.RecordID, scoreErr)
	default:
		return r, v, fmt.Errorf("reward: %s: %w", t.RecordID, err)
	}
}

// errRewardUnavailable marks an evaluator failure worth retrying.
var errRewardUnavailable = errors.New("reward unavailable")

// now is the stage's clock (stagekit.Now).
func (s *Stage) now() time.Time { return stagekit.Now(s.cfg.Now) }
