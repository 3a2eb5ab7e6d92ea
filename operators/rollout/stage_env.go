package rollout

import (
	"context"
	"sort"
	"strconv"
	"time"

	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// runEpisodes runs the agent loop of one try of a group against the
// stage's environment: the registry in process, or StageConfig.Env.
func (s *Stage) runEpisodes(ctx context.Context, pol Policy, atts []schemas.TaskAttempt, lim Limits) ([]schemas.Trajectory, error) {
	var env Environment = s.cfg.Registry
	if s.cfg.Env != nil {
		env = s.cfg.Env
	}
	// The contract's simulated latency wraps both (nothing when off).
	env, p := s.cfg.Latency.Wrap(env, s.groupPolicy(pol))
	tok, _ := p.(Tokenizer)
	return Agent{Env: env, Policy: p, Tokenizer: tok, Settings: s.cfg.Settings, Limits: lim}.Run(ctx, atts)
}

// envRetries is a snapshot of the environment client's retries (nil
// without EnvRetries).
func (s *Stage) envRetries() map[string]int64 {
	if s.cfg.EnvRetries == nil {
		return nil
	}
	return s.cfg.EnvRetries()
}

// retryEvents returns one census event (CensusRetried, Infra) per retry
// the environment client made since before, with its reason, on attempt
// a (the group's first member in this try). Event k of a reason has the
// id DerivedID("census/retried/rollout/<reason>/<k>", attempt id), so the
// events of one run are distinct and a redelivered run that retried the
// same way writes the same ids.
func (s *Stage) retryEvents(a schemas.TaskAttempt, version int64, before map[string]int64, at time.Time) ([]pipeline.Output, error) {
	if s.cfg.EnvRetries == nil {
		return nil, nil
	}
	after := s.cfg.EnvRetries()
	reasons := make([]string, 0, len(after))
	for r := range after {
		reasons = append(reasons, r)
	}
	sort.Strings(reasons)
	var out []pipeline.Output
	for _, r := range reasons {
		for k := int64(1); k <= after[r]-before[r]; k++ {
			ev, err := stagekit.Census(s.cfg.Topics.Census, schemas.CensusEvent{
				EventID: schemas.DerivedID("census/"+schemas.CensusRetried+"/"+s.Name()+"/"+r+"/"+strconv.FormatInt(k, 10), a.AttemptID),
				RunID:   a.RunID, AttemptID: a.AttemptID, TaskID: a.TaskID, GroupID: a.GroupID, Kind: schemas.CensusRetried,
				Stage: s.Name(), Reason: r, Infra: true, PolicyVersion: version, At: at.UnixMicro(),
			})
			if err != nil {
				return nil, err
			}
			out = append(out, ev)
		}
	}
	return out, nil
}

// pause waits before run try of a group (none before the first).
func (s *Stage) pause(ctx context.Context, try int) error {
	b := s.cfg.Backoff
	if b <= 0 {
		b = 100 * time.Millisecond
	}
	bo := pipeline.Backoff{Initial: b, Max: 32 * b}
	if s.cfg.RetryBackoff.Initial > 0 {
		bo = s.cfg.RetryBackoff
	}
	d := bo.Delay(try)
	if d <= 0 {
		return nil
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
