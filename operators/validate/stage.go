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

// Stage is the validate operator (pipeline §9): every trajectory row is
// checked; valid rows go on to the valid topic (in one message per input
// message, same key), every other row goes to quarantine alone with its
// reason, with a census event, and incidents also to the incidents topic.
type Stage struct{ cfg StageConfig }

// NewStage returns the stage.
func NewStage(cfg StageConfig) *Stage {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Stage{cfg: cfg}
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "validate" }

// Topics implements pipeline.Stage.
func (s *Stage) Topics() []string { return []string{s.cfg.Topics.Trajectories} }

// Process implements pipeline.Stage.
func (s *Stage) Process(_ context.Context, m pipeline.Message) (pipeline.Result, error) {
	rows, err := stagekit.Decode(schemas.Trajectories, m)
	if err != nil {
		return pipeline.Result{}, err
	}
	var res pipeline.Result
	valid := make([]schemas.Trajectory, 0, len(rows))
	var ids []string
	now := s.cfg.Now().UnixMicro()
	for i := range rows {
		t := &rows[i]
		v := Check(t, s.cfg.Options)
		if v.OK() {
			valid = append(valid, *t)
			ids = append(ids, t.RecordID)
			continue
		}
		q, err := stagekit.RowRefusal(schemas.Trajectories, s.cfg.Topics.Quarantine, s.Name(), m, i, *t, t.RecordID, v.Reason, v.Detail)
		if err != nil {
			return pipeline.Result{}, err
		}
		ev, err := stagekit.Census(s.cfg.Topics.Census, schemas.CensusEvent{
			RunID: t.RunID, AttemptID: t.RecordID, TaskID: t.TaskID, GroupID: t.GroupID,
			Kind: schemas.CensusQuarantined, Stage: s.Name(), Reason: v.Reason,
			Infra: v.Infra(), At: now,
		})
		if err != nil {
			return pipeline.Result{}, err
		}
		res.Outputs = append(res.Outputs, q, ev)
		if v.Class == Incident {
			inc, err := stagekit.IncidentOutput(s.cfg.Topics.Incidents, stagekit.Incident{
				RunID: t.RunID, AttemptID: t.RecordID, TaskID: t.TaskID, Stage: s.Name(),
				Reason: v.Reason, Detail: v.Detail, Source: m.Ref.String(), At: now,
			})
			if err != nil {
				return pipeline.Result{}, err
			}
			res.Outputs = append(res.Outputs, inc)
		}
	}
	if len(valid) > 0 {
		out, err := stagekit.Encode(schemas.Trajectories, s.cfg.Topics.Valid, string(m.Key), stagekit.MessageID(s.Name(), ids...), valid)
		if err != nil {
			return pipeline.Result{}, err
		}
		res.Outputs = append(res.Outputs, out)
	}
	return res, nil
}
