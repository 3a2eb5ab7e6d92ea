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
package eval

import (
	"context"
	"errors"
	"fmt"

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
	return &Stage{cfg: cfg, last: -1}, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "eval" }

// Topics implements pipeline.Stage: the policy topic.
func (s *Stage) Topics() []string { return s.cfg.Topics.Names(pipeline.InputsOf(s.Name())) }

// Start takes the release store the checkpoints and update records are
// read from.
func (s *Stage) Start(_ context.Context, env *pipeline.Env) error {
	files, err := env.Releases()
	if err != nil {
		return fmt.Errorf("eval: %w", err)
	}
	s.files = files
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
	b, err := schemas.EncodeEvaluation(rec)
	if err != nil {
		return pipeline.Result{}, err
	}
	s.last = v
	id := fmt.Sprintf("%s/eval/%d", s.cfg.RunID, v)
	return pipeline.Result{Outputs: []pipeline.Output{{Topic: s.cfg.Topics.Evaluations, Key: []byte(s.cfg.RunID), Value: b,
		Headers: stagekit.Headers(schemas.KindEvaluation, id)}}}, nil
}

// measure evaluates release rel.
func (s *Stage) measure(ctx context.Context, rel schemas.PolicyRelease, m pipeline.Message) (schemas.EvaluationRecord, error) {
	v := rel.PolicyVersion
	rec := schemas.EvaluationRecord{RunID: s.cfg.RunID, PolicyVersion: v, At: m.Time.UnixMicro()}
	ckpt, err := s.files.Read(rel.CheckpointURI)
	if err != nil {
		return rec, fmt.Errorf("eval: release %d: %w: %w", v, gpu.ErrRelease, err)
	}
	pol, err := gpu.PolicyFromRelease(rel, ckpt)
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
