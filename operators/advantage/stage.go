package advantage

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/trajflow/trajflow/connectors/state"
	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// StageConfig configures the advantage operator.
type StageConfig struct {
	Options Options
	Topics  pipeline.Topics
	// PartialTimeout closes a group that is still incomplete this long after
	// its first member arrived (the declared partial-group policy then
	// decides: MinGroupSize). 0 disables the timeout.
	PartialTimeout time.Duration
	// Remember is how many emitted group ids are kept to recognize a
	// redelivered tail of an already-scored group (default 100000).
	Remember int
	// RebuildScan is how many records per partition of the scored topic are
	// read back to rebuild that memory when the local state is lost
	// (default 10000).
	RebuildScan int64
	Now         func() time.Time
}

// Stage is the advantage operator: it assembles rewarded trajectories into
// groups by group id (the Kafka key), holds every member's input record
// until its group is complete, then scores the group with ScoreGroup and
// produces one scored message per group (docs/PIPELINE.md §10).
//
// State: open groups live in memory and are rebuilt from redelivery (held
// records are never committed). The ids of emitted groups are kept in
// Badger under StateDir and rebuilt from the scored topic when lost, so a
// redelivered member of an emitted group never reopens it.
type Stage struct {
	cfg     StageConfig
	asm     *Assembler
	store   *state.Store
	emitted state.IDSet   // emitted groups read back from the scored topic
	env     *pipeline.Env // counts the duplicates dropped
	// msgGroups counts, per held input message, the groups it still feeds.
	msgGroups map[pipeline.Ref]int
	groupMsgs map[string][]pipeline.Ref
	opened    map[string]time.Time
}

// NewStage validates cfg and returns the stage.
func NewStage(cfg StageConfig) (*Stage, error) {
	if err := cfg.Options.Validate(); err != nil {
		return nil, err
	}
	if cfg.Remember <= 0 {
		cfg.Remember = 100000
	}
	if cfg.RebuildScan <= 0 {
		cfg.RebuildScan = 10000
	}
	return &Stage{
		cfg:       cfg,
		asm:       NewAssembler(cfg.Remember),
		msgGroups: map[pipeline.Ref]int{},
		groupMsgs: map[string][]pipeline.Ref{},
		opened:    map[string]time.Time{},
	}, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "advantage" }

// Topics implements pipeline.Stage.
func (s *Stage) Topics() []string { return s.cfg.Topics.Names(pipeline.InputsOf(s.Name())) }

const emittedPrefix = "advantage/emitted/"

// Start opens the state store and loads (or rebuilds) the emitted groups.
func (s *Stage) Start(ctx context.Context, env *pipeline.Env) error {
	s.env = env
	if s.cfg.Now == nil {
		s.cfg.Now = env.Now
	}
	st, err := env.State()
	if err != nil {
		return err
	}
	s.store = st
	s.emitted = st.IDSet(emittedPrefix, 0)
	// The emitted set is always read back from the scored topic, never
	// trusted from local state alone: emit marks a group in Badger when the
	// scored output is handed to the producer, before it is acknowledged, so
	// after a SIGKILL in between the local mark exists while the output
	// does not, and trusting it would drop the group's redelivered members
	// (lost attempts; seen in the kill tests of integration/). Redelivered
	// members of a group whose output did reach the topic are still
	// recognized; a re-emitted duplicate is deduplicated by pack.
	n := 0
	err = env.Scan(ctx, s.cfg.Topics.Scored, s.cfg.RebuildScan, func(m pipeline.Message) error {
		if len(m.Key) > 0 {
			s.asm.Remember(string(m.Key))
			n++
			return s.emitted.Add(string(m.Key))
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("advantage: rebuild emitted groups: %w", err)
	}
	env.Logger.Info("advantage state rebuilt from scored topic", "groups", n)
	return nil
}

// emittedBefore reports whether groupID was emitted before this start
// beyond the scanned tail: the local state keeps every group id read back
// from the scored topic (and only those), so it outlives the in-memory
// memory and the scan horizon.
func (s *Stage) emittedBefore(groupID string) (bool, error) {
	if s.store == nil || s.asm.Known(groupID) {
		return false, nil
	}
	return s.emitted.Has(groupID)
}

// Process implements pipeline.Stage.
func (s *Stage) Process(ctx context.Context, m pipeline.Message) (pipeline.Result, error) {
	rows, err := stagekit.Decode(schemas.RewardedTrajectories, m)
	if err != nil {
		return pipeline.Result{}, err
	}
	if err := stagekit.CheckID(&m, stagekit.MessageID("reward", recordIDs(rows)...)); err != nil {
		return pipeline.Result{}, err
	}
	for i := range rows {
		if err := CheckMember(&rows[i]); err != nil {
			return pipeline.Result{}, pipeline.Refuse("bad_group_member", "row %d: %v", i, err)
		}
	}
	absent, err := stagekit.AbsentOf(&m)
	if err != nil {
		return pipeline.Result{}, err
	}
	var res pipeline.Result
	res.Hold = true
	held := false
	for i, r := range rows {
		if seen, err := s.emittedBefore(r.GroupID); err != nil {
			return pipeline.Result{}, err
		} else if seen {
			s.asm.Remember(r.GroupID) // Offer counts it late
		}
		out, group, err := s.asm.Offer(r)
		if out == Malformed {
			// The same record id delivered again with other content: the
			// first delivery stands, this one goes to quarantine.
			outs, rerr := stagekit.RefuseRow(schemas.RewardedTrajectories, s.cfg.Topics, s.Name(), m, i, r, stagekit.Refused{
				RunID: r.RunID, AttemptID: r.RecordID, TaskID: r.TaskID, GroupID: r.GroupID,
				Reason: "conflicting_duplicate", Detail: err.Error(), At: s.now().UnixMicro(),
			})
			if rerr != nil {
				return pipeline.Result{}, rerr
			}
			res.Outputs = append(res.Outputs, outs...)
			continue
		}
		if out == Duplicate || out == Late {
			s.env.DuplicateDropped(r.RecordID)
		}
		done := group != nil
		if out == Added || done {
			held = true
			// One hold per (message, group): the message is released when
			// every group it feeds has been emitted.
			if refs := s.groupMsgs[r.GroupID]; len(refs) == 0 || refs[len(refs)-1] != m.Ref {
				s.groupMsgs[r.GroupID] = append(refs, m.Ref)
				s.msgGroups[m.Ref]++
			}
			if _, ok := s.opened[r.GroupID]; !ok {
				s.opened[r.GroupID] = s.now()
			}
		}
		if done {
			if err := s.emit(ctx, &res, r.GroupID, group); err != nil {
				return pipeline.Result{}, err
			}
		}
	}
	// Members refused upstream close their groups now (docs/PIPELINE.md §9,
	// declared partial-group policy), in group order for determinism.
	for _, g := range slices.Sorted(maps.Keys(absent)) {
		for _, member := range absent[g] {
			if group, done := s.asm.Absent(g, member); done {
				if err := s.emit(ctx, &res, g, group); err != nil {
					return pipeline.Result{}, err
				}
			}
		}
	}
	switch {
	case !held:
		// Every row was a duplicate or belongs to an emitted group: nothing
		// to hold.
		res.Hold = false
	case s.msgGroups[m.Ref] > 0:
		// A group of m was emitted in this call but another still holds m:
		// m must not be released with the emitted group's members.
		res.Release = slices.DeleteFunc(res.Release, func(r pipeline.Ref) bool { return r == m.Ref })
	}
	return res, nil
}

// recordIDs are the record ids of rows, in order.
func recordIDs(rows []schemas.Rewarded) []string {
	ids := make([]string, len(rows))
	for i := range rows {
		ids[i] = rows[i].RecordID
	}
	return ids
}

// emit scores a finished group and appends its output and releases to res;
// each member's attempt trace gets advantage's span.
func (s *Stage) emit(ctx context.Context, res *pipeline.Result, groupID string, group []schemas.Rewarded) error {
	defer stagekit.TraceAttempts(ctx, s.Name(), "reward", time.Now(), len(group), func(i int) string { return group[i].RecordID },
		attribute.String("trajflow.group_id", groupID))
	scored, err := ScoreGroup(s.cfg.Options, group)
	switch {
	case errors.Is(err, ErrOptions):
		return err
	case err != nil:
		// A group that cannot be scored (for example returns that overflow
		// float32) goes to quarantine member by member, as an
		// infrastructure failure; the stage goes on.
		var src pipeline.Message
		if refs := s.groupMsgs[groupID]; len(refs) > 0 {
			src.Ref = refs[0]
		}
		src.Key = []byte(groupID)
		for i, r := range group {
			outs, rerr := stagekit.RefuseRow(schemas.RewardedTrajectories, s.cfg.Topics, s.Name(), src, i, r, stagekit.Refused{
				RunID: r.RunID, AttemptID: r.RecordID, TaskID: r.TaskID, GroupID: groupID,
				Reason: "unscorable_group", Detail: err.Error(), Infra: true, At: s.now().UnixMicro(), Turns: r.Turns,
			})
			if rerr != nil {
				return rerr
			}
			res.Outputs = append(res.Outputs, outs...)
		}
	default:
		out, err := stagekit.Encode(schemas.ScoredTrajectories, s.cfg.Topics.Scored, groupID, schemas.DerivedID("advantage", groupID), scored)
		if err != nil {
			return err
		}
		res.Outputs = append(res.Outputs, out)
	}
	for _, ref := range s.groupMsgs[groupID] {
		s.msgGroups[ref]--
		if s.msgGroups[ref] <= 0 {
			delete(s.msgGroups, ref)
			res.Release = append(res.Release, ref)
		}
	}
	delete(s.groupMsgs, groupID)
	delete(s.opened, groupID)
	return nil
}

// Tick closes groups older than the partial-group timeout.
func (s *Stage) Tick(ctx context.Context, now time.Time) (pipeline.Result, error) {
	var res pipeline.Result
	if s.cfg.PartialTimeout <= 0 {
		return res, nil
	}
	for _, g := range s.asm.Open() {
		if now.Sub(s.opened[g.GroupID]) < s.cfg.PartialTimeout {
			continue
		}
		members, ok := s.asm.Close(g.GroupID)
		if !ok {
			continue
		}
		if err := s.emit(ctx, &res, g.GroupID, members); err != nil {
			return pipeline.Result{}, err
		}
	}
	return res, nil
}

// now is the stage's clock (stagekit.Now).
func (s *Stage) now() time.Time { return stagekit.Now(s.cfg.Now) }
