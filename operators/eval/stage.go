// Package eval is the evaluation operator (docs/PIPELINE.md §16): it
// consumes the policy topic and measures every ready release apart from
// training, on the evaluation plane's frozen attempts (internal/evaluation):
// the KL to the reference policy on every release, and every suite
// (validation, the hidden held-out split, regression, safety) with
// confidence intervals on release 0 and every Every-th release. Each
// measurement is one EvaluationRecord on the evaluations topic, in release
// order, which the gate operator decides on. Evaluation attempts run in
// process under their own run id and never reach a training topic.
//
// The stage is deterministic in its input: a redelivered release gives
// the same record (the gate skips versions it already decided).
//
// A run with a round limit ends with a final evaluation: once the
// operator is told every round is trained (RunTrained, from `trajflow run
// --rounds`), its next Tick evaluates the last release with every suite
// unless that release had them already, in a record marked Final, as the
// demo evaluates its last release at the end.
package eval

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/evaluation"
	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// StageConfig configures the evaluation operator.
type StageConfig struct {
	Plane  *evaluation.Plane
	Topics pipeline.Topics
	RunID  string
	// Every: every suite runs on release 0 and on every release whose
	// version is a multiple of Every (the contract's dispatch.eval_every);
	// a rollback's release, which republishes evaluated parameters, never.
	Every int64
	// Epochs is loss.optimizer.epochs: an update's optimizer tokens are
	// its trained tokens times the epochs.
	Epochs int
}

// Stage is the evaluation operator.
type Stage struct {
	cfg   StageConfig
	files pipeline.ReleaseStore
	last  int64 // newest version measured (-1: none)
	// lastRel is the newest release measured, lastKL its KL and lastFull
	// whether its record had every suite; finalFor is the version the
	// final record was written for (-1: none).
	lastRel  schemas.PolicyRelease
	lastKL   schemas.Estimate
	lastFull bool
	finalFor int64
	trained  atomic.Bool // RunTrained was called
}

// NewStage validates cfg and returns the stage.
func NewStage(cfg StageConfig) (*Stage, error) {
	switch {
	case cfg.Plane == nil:
		return nil, errors.New("eval: no evaluation plane")
	case cfg.Every < 1:
		return nil, fmt.Errorf("eval: every %d: want an evaluation every 1 or more releases (dispatch.eval_every)", cfg.Every)
	case cfg.Epochs < 1:
		return nil, fmt.Errorf("eval: epochs %d: want 1 or more (loss.optimizer.epochs)", cfg.Epochs)
	}
	return &Stage{cfg: cfg, last: -1, finalFor: -1}, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "eval" }

// Topics implements pipeline.Stage: the policy topic.
func (s *Stage) Topics() []string { return s.cfg.Topics.Names(pipeline.InputsOf(s.Name())) }

// rebuildScan is how many records of the evaluations and policy topics a
// restarted stage reads back (the newest of each partition).
const rebuildScan = 1000

// Start takes the release store the checkpoints and update records are
// read from, and reads back the newest release this run measured (the
// evaluations topic) with its manifest (the policy topic), so that a
// restarted stage neither measures it again nor misses the final
// evaluation.
func (s *Stage) Start(ctx context.Context, env *pipeline.Env) error {
	files, err := env.Releases()
	if err != nil {
		return fmt.Errorf("eval: %w", err)
	}
	s.files = files
	err = env.Scan(ctx, s.cfg.Topics.Evaluations, rebuildScan, func(m pipeline.Message) error {
		rec, err := schemas.DecodeEvaluation(m.Value)
		if err != nil || rec.RunID != s.cfg.RunID || rec.PolicyVersion < s.last {
			return nil // not a record of this run's newest release
		}
		if rec.PolicyVersion > s.last {
			s.last, s.lastFull = rec.PolicyVersion, false
		}
		s.lastFull = s.lastFull || (rec.Evaluation != nil && !rec.Final)
		if rec.Final {
			s.finalFor = rec.PolicyVersion
		} else {
			s.lastKL = rec.KL
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("eval: read back %s: %w", s.cfg.Topics.Evaluations, err)
	}
	if s.last < 0 {
		return nil
	}
	// The compacted topic keeps the newest release; when that is newer
	// than the last measured, it is measured next (its offset was not
	// committed) and becomes the last.
	err = env.Scan(ctx, s.cfg.Topics.Policy, rebuildScan, func(m pipeline.Message) error {
		if rel, err := schemas.DecodeRelease(m.Value); err == nil && rel.Ready && rel.PolicyVersion == s.last {
			s.lastRel = rel
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("eval: read back %s: %w", s.cfg.Topics.Policy, err)
	}
	return nil
}

// Process implements pipeline.Stage: a ready release newer than the last
// one measured gives its evaluation record; older releases (the compacted
// topic replayed) and releases not ready give nothing.
func (s *Stage) Process(ctx context.Context, m pipeline.Message) (pipeline.Result, error) {
	rel, newer, err := stagekit.NewerRelease(&m, s.last)
	if err != nil || !newer {
		return pipeline.Result{}, err
	}
	v := rel.PolicyVersion
	rec, err := s.measure(ctx, rel, m)
	if err != nil {
		return pipeline.Result{}, err // infrastructure (a release file): redelivered after a restart
	}
	out, err := s.output(rec)
	if err != nil {
		return pipeline.Result{}, err
	}
	s.last, s.lastRel, s.lastKL, s.lastFull = v, rel, rec.KL, rec.Evaluation != nil
	return pipeline.Result{Outputs: []pipeline.Output{out}}, nil
}

// output is the evaluations-topic record of rec.
func (s *Stage) output(rec schemas.EvaluationRecord) (pipeline.Output, error) {
	b, err := schemas.EncodeEvaluation(rec)
	if err != nil {
		return pipeline.Output{}, err
	}
	id := fmt.Sprintf("%s/eval/%d", s.cfg.RunID, rec.PolicyVersion)
	if rec.Final {
		id += "/final"
	}
	return pipeline.Output{Topic: s.cfg.Topics.Evaluations, Key: []byte(s.cfg.RunID), Value: b,
		Headers: stagekit.Headers(schemas.KindEvaluation, id)}, nil
}

// RunTrained tells the stage that every round of the run is trained and
// every release measured: its next Tick writes the final evaluation. Safe
// to call from any goroutine.
func (s *Stage) RunTrained() { s.trained.Store(true) }

// Tick implements pipeline.Ticker: after RunTrained, the final evaluation
// of the last release measured, once per release, unless its record had
// every suite (its ruling is then the final one).
func (s *Stage) Tick(ctx context.Context, now time.Time) (pipeline.Result, error) {
	v := s.last
	if !s.trained.Load() || v <= 0 || s.finalFor >= v || s.lastRel.PolicyVersion != v {
		return pipeline.Result{}, nil
	}
	s.finalFor = v
	if s.lastFull {
		return pipeline.Result{}, nil
	}
	pol, err := s.policy(s.lastRel)
	if err != nil {
		return pipeline.Result{}, err
	}
	// The KL was measured with the release's first record.
	rec := schemas.EvaluationRecord{RunID: s.cfg.RunID, PolicyVersion: v, KL: s.lastKL, Final: true, At: now.UnixMicro()}
	if err := s.suites(ctx, pol, &rec); err != nil {
		return pipeline.Result{}, err
	}
	out, err := s.output(rec)
	if err != nil {
		return pipeline.Result{}, err
	}
	return pipeline.Result{Outputs: []pipeline.Output{out}}, nil
}

// policy loads the policy of release rel.
func (s *Stage) policy(rel schemas.PolicyRelease) (*model.Policy, error) {
	ckpt, err := s.files.Read(rel.CheckpointURI)
	if err != nil {
		return nil, fmt.Errorf("eval: release %d: %w: %w", rel.PolicyVersion, gpu.ErrRelease, err)
	}
	return gpu.PolicyFromRelease(rel, ckpt)
}

// measure evaluates release rel.
func (s *Stage) measure(ctx context.Context, rel schemas.PolicyRelease, m pipeline.Message) (schemas.EvaluationRecord, error) {
	v := rel.PolicyVersion
	rec := schemas.EvaluationRecord{RunID: s.cfg.RunID, PolicyVersion: v, At: m.Time.UnixMicro()}
	pol, err := s.policy(rel)
	if err != nil {
		return rec, err
	}
	full := v == 0
	if v > 0 {
		u, err := gpu.ReadUpdate(s.files, v)
		if err != nil {
			return rec, fmt.Errorf("eval: release %d: %w", v, err)
		}
		rec.RolledBackTo = u.RolledBackTo
		rec.OptimizerTokens = u.Metrics.Tokens * int64(s.cfg.Epochs)
		rec.StepSeconds = u.StepSeconds
		if rec.KL, err = s.cfg.Plane.KL(ctx, pol); err != nil {
			return rec, err
		}
		full = u.RolledBackTo == nil && v%s.cfg.Every == 0
	}
	if full {
		if err := s.suites(ctx, pol, &rec); err != nil {
			return rec, err
		}
	}
	return rec, nil
}

// suites runs every suite on pol into rec.
func (s *Stage) suites(ctx context.Context, pol *model.Policy, rec *schemas.EvaluationRecord) error {
	rep, err := s.cfg.Plane.Evaluate(ctx, pol)
	if err != nil {
		return err
	}
	rec.Evaluation, rec.Suites = &rep.Evaluation, rep.Suites
	if rec.PolicyVersion == 0 {
		rec.KL = rep.Evaluation.Metrics[evaluation.MetricKLToReference]
	}
	return nil
}
