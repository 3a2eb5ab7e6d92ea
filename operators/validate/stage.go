package validate

import (
	"context"
	"time"

	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// StageConfig configures the validate operator.
type StageConfig struct {
	Options Options
	Topics  pipeline.Topics
	Now     func() time.Time
}

// Stage is the validate operator (docs/PIPELINE.md §9): every trajectory row is
// checked; valid rows go on to the valid topic (in one message per input
// message, same key), every other row goes to quarantine alone with its
// reason, with a census event, and incidents also to the incidents topic.
type Stage struct{ cfg StageConfig }

// NewStage returns the stage.
func NewStage(cfg StageConfig) *Stage {
	return &Stage{cfg: cfg}
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "validate" }

// Topics implements pipeline.Stage.
func (s *Stage) Topics() []string { return s.cfg.Topics.Names(pipeline.InputsOf(s.Name())) }

// Start takes the runtime's clock when none is configured.
func (s *Stage) Start(_ context.Context, env *pipeline.Env) error {
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
	defer stagekit.TraceAttempts(ctx, s.Name(), "rollout", time.Now(), len(rows), func(i int) string { return rows[i].RecordID })
	if err := stagekit.CheckID(&m, stagekit.MessageID("rollout", rows[0].GroupID)); err != nil {
		return pipeline.Result{}, err
	}
	var res pipeline.Result
	valid := make([]schemas.Trajectory, 0, len(rows))
	var ids []string
	absent := stagekit.Absent{}
	now := s.now().UnixMicro()
	for i := range rows {
		t := &rows[i]
		v := Check(t, s.cfg.Options)
		if v.OK() {
			valid = append(valid, *t)
			ids = append(ids, t.RecordID)
			continue
		}
		outs, err := stagekit.RefuseRow(schemas.Trajectories, s.cfg.Topics, s.Name(), m, i, *t, stagekit.Refused{
			RunID: t.RunID, AttemptID: t.RecordID, TaskID: t.TaskID, GroupID: t.GroupID,
			Reason: v.Reason, Detail: v.Detail, Infra: v.Infra(), Incident: v.Class == Incident, At: now, Turns: t.Turns,
		})
		if err != nil {
			return pipeline.Result{}, err
		}
		res.Outputs = append(res.Outputs, outs...)
		absent.Add(t.GroupID, t.Member, t.GroupSize)
	}
	switch {
	case len(valid) == len(rows):
		// Every row is valid: the input bytes are the output (a decoded
		// stream re-encodes to the same rows), so skip the encode.
		res.Outputs = append(res.Outputs, pipeline.Output{
			Topic: s.cfg.Topics.Valid, Key: m.Key, Value: m.Value,
			Headers: stagekit.Headers(schemas.KindTrajectory, stagekit.MessageID(s.Name(), ids...)),
		})
	case len(valid) > 0:
		out, err := stagekit.Encode(schemas.Trajectories, s.cfg.Topics.Valid, string(m.Key), stagekit.MessageID(s.Name(), ids...), valid)
		if err != nil {
			return pipeline.Result{}, err
		}
		// The refused members never reach advantage: declare them, so their
		// groups close without waiting for the partial-group timeout.
		res.Outputs = append(res.Outputs, stagekit.WithAbsent(out, absent))
	}
	return res, nil
}

// now is the stage's clock (stagekit.Now).
func (s *Stage) now() time.Time { return stagekit.Now(s.cfg.Now) }
