package pack

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/trajflow/trajflow/connectors/state"
	"github.com/trajflow/trajflow/internal/idset"
	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// StageConfig configures the pack operator.
type StageConfig struct {
	Options      Options
	Topics       pipeline.Topics
	RunID        string
	ContractHash string
	// MaxWait closes a non-empty window this long after its first
	// admission even if it is not full (asynchronous mode; the decision is
	// recorded in the window lineage). 0 disables it.
	MaxWait time.Duration
	// RebuildScan is how many batches per partition of the batches topic
	// are read back at start to restore the admitted ids (default 1000).
	RebuildScan int64
	// DedupMemory is how many decided ids are kept in memory (default
	// 1<<20, about 50 MB); older ones are forgotten.
	DedupMemory int
	// DedupHorizon bounds how long admitted ids are remembered in the local
	// state beyond the scanned tail (default 7 days).
	DedupHorizon time.Duration
	// CountDecidedGroups is stop-and-synchronize mode (pipeline §15,
	// contract dispatch.mode sync): Options.BatchGroups counts every group
	// decided in the window, admitted or filtered, and a window whose
	// groups were all filtered still closes, with a WindowRecord and no
	// batch, so the dispatcher can start the next round.
	CountDecidedGroups bool
	Now                func() time.Time
}

// WindowRecord is the lineage of one closed window, produced as JSON on the
// windows topic: what was admitted (in batch order), what was filtered and
// why, and the trainer version the lag rule used. Replay reproduces a
// batch from its admitted ids and trainer version.
type WindowRecord struct {
	BatchID        string     `json:"batch_id"`
	BatchIndex     int64      `json:"batch_index"`
	RunID          string     `json:"run_id"`
	ContractHash   string     `json:"contract_hash"`
	TrainerVersion int64      `json:"trainer_version"`
	ClosedBy       string     `json:"closed_by"` // "full", "timeout", "flush"
	Admitted       []string   `json:"admitted"`
	Filtered       []Decision `json:"filtered"`
	Tokens         int64      `json:"tokens"`
	TrainedTokens  int64      `json:"trained_tokens"`
	Rows           int        `json:"rows"`
	Efficiency     float64    `json:"efficiency"`
	// Groups are the groups with a member decided in the window (admitted
	// or filtered when added), sorted: the dispatcher knows a round is
	// complete when every group of it appears in some window record.
	Groups []string `json:"groups"`
	// Records is the number of records decided in the window (admitted or
	// filtered when added); RewardMean their mean RewardTotal and
	// SuccessRate the fraction with RewardTotal > 0.
	Records     int     `json:"records"`
	RewardMean  float64 `json:"reward_mean"`
	SuccessRate float64 `json:"success_rate"`
	// MaxLag is the largest policy lag (TrainerVersion minus the oldest
	// behavior version of a segment) among the admitted segments.
	MaxLag int64 `json:"max_lag"`
}

// Stage is the pack operator: the lag-aware admission window (DESIGN.md),
// reconstruction and packing (pipeline §11). It consumes the scored topic
// and the policy topic (to know the trainer's version). Every admitted
// record is held until its window closes; the batch, its lineage record
// and the census events are then produced, and the window's inputs are
// released together.
//
// Deduplication: a trajectory id is admitted at most once. Admitted ids
// are restored at start from the batches topic itself (the source of
// truth) and, beyond the scanned tail, from the local state, which only
// ever holds ids read back from the topic.
type Stage struct {
	cfg       StageConfig
	win       *Window
	store     *state.Store
	admitted  state.IDSet // admitted ids read back from the batches topic
	nextIndex int64
	held      map[pipeline.Ref]struct{}
	opened    time.Time
	// bounded deduplication memory (see remember)
	recent *idset.Ring
	// statistics of the records decided in the open window
	records   int
	rewardSum float64
	successes int
}

// NewStage validates cfg and returns the stage.
func NewStage(cfg StageConfig) (*Stage, error) {
	w, err := NewWindow(cfg.Options, 0)
	if err != nil {
		return nil, err
	}
	w.CountDecidedGroups(cfg.CountDecidedGroups)
	w.ReuseColumns() // close encodes each batch before the next window closes
	if cfg.RebuildScan <= 0 {
		cfg.RebuildScan = 1000
	}
	if cfg.DedupMemory <= 0 {
		cfg.DedupMemory = 1 << 20
	}
	if cfg.DedupHorizon <= 0 {
		cfg.DedupHorizon = 7 * 24 * time.Hour
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Stage{cfg: cfg, win: w, held: map[pipeline.Ref]struct{}{}, recent: idset.NewRing(cfg.DedupMemory)}, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "pack" }

// Topics implements pipeline.Stage.
func (s *Stage) Topics() []string { return []string{s.cfg.Topics.Scored, s.cfg.Topics.Policy} }

const seenPrefix = "pack/admitted/"

// Start restores the admitted ids and the next batch index.
func (s *Stage) Start(ctx context.Context, env *pipeline.Env) error {
	st, err := state.Open(env.Config.StateDir, state.Options{Logger: env.Logger})
	if err != nil {
		return err
	}
	s.store = st
	s.admitted = st.IDSet(seenPrefix, s.cfg.DedupHorizon)
	batches := 0
	err = pipeline.ScanTail(ctx, env.Config, s.cfg.Topics.Batches, s.cfg.RebuildScan, func(m pipeline.Message) error {
		b, err := schemas.PackedBatches.DecodeShared(nil, m.Value)
		if err != nil {
			return fmt.Errorf("pack: batches topic at %s: %w", m.Ref, err)
		}
		batches++
		if b.BatchIndex >= s.nextIndex {
			s.nextIndex = b.BatchIndex + 1
		}
		for _, row := range b.Rows {
			for _, id := range row.SegTrajectoryIDs {
				s.win.MarkSeen(id)
				s.remember(id)
				if err := s.admitted.Add(id); err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("pack: rebuild from batches: %w", err)
	}
	env.Logger.Info("pack state restored", "batches_scanned", batches, "next_batch", s.nextIndex)
	return nil
}

// remember records a decided id in the bounded in-memory deduplication
// memory; the oldest ids beyond DedupMemory are forgotten (their inputs were
// committed long ago, so they are not redelivered; ids read back from the
// batches topic at a start stay in the local state for DedupHorizon).
func (s *Stage) remember(id string) {
	if oldest, dropped := s.recent.Push(idset.KeyOf(id)); dropped {
		s.win.Forget(oldest)
	}
}

// admittedBefore reports whether id was admitted to a batch before this
// start and beyond the in-memory deduplication memory.
func (s *Stage) admittedBefore(id string) (bool, error) {
	if s.store == nil || s.win.Seen(id) {
		return false, nil
	}
	return s.admitted.Has(id)
}

// Close releases the state store (none when the stage never started).
func (s *Stage) Close() error { return s.store.Close() }

// Process implements pipeline.Stage.
func (s *Stage) Process(ctx context.Context, m pipeline.Message) (pipeline.Result, error) {
	if m.Topic == s.cfg.Topics.Policy {
		rel, err := schemas.DecodeRelease(m.Value)
		if err != nil {
			return pipeline.Result{}, stagekit.DecodeRefusal(err)
		}
		if rel.Ready && rel.PolicyVersion > s.win.TrainerVersion() {
			s.win.SetTrainerVersion(rel.PolicyVersion)
		}
		return pipeline.Result{}, nil
	}
	rows, err := stagekit.Decode(schemas.ScoredTrajectories, m)
	if err != nil {
		return pipeline.Result{}, err
	}
	var res pipeline.Result
	now := s.cfg.Now()
	for i := range rows {
		r := &rows[i]
		if !s.win.Accepts(r.GroupID) {
			if err := s.close(&res, "full"); err != nil {
				return pipeline.Result{}, err
			}
		}
		// A record sampled at behavior version v proves the trainer
		// published v: the window never judges it against an older version
		// than that, whichever of the scored and policy topics was fetched
		// first (in stop-and-synchronize mode this makes the batch a pure
		// function of the round).
		if v := maxBehaviorVersion(r); v > s.win.TrainerVersion() && r.Split != schemas.SplitEval {
			s.win.SetTrainerVersion(v)
		}
		if dup, err := s.admittedBefore(r.RecordID); err != nil {
			return pipeline.Result{}, err
		} else if dup {
			s.win.MarkSeen(r.RecordID)
			s.remember(r.RecordID)
			continue
		}
		out, err := s.win.Add(*r)
		if err != nil {
			reason := "malformed_scored"
			if errors.Is(err, ErrEvalSplit) {
				reason = "eval_task_id"
			}
			if errors.Is(err, ErrWindowFull) {
				return pipeline.Result{}, err // Accepts was checked: a defect, not bad input
			}
			outs, rerr := stagekit.RefuseRow(schemas.ScoredTrajectories, s.cfg.Topics, s.Name(), m, i, *r, stagekit.Refused{
				RunID: r.RunID, AttemptID: r.RecordID, TaskID: r.TaskID, GroupID: r.GroupID,
				Reason: reason, Detail: err.Error(), Infra: reason != "eval_task_id",
				Incident: reason == "eval_task_id", At: now.UnixMicro(),
			})
			if rerr != nil {
				return pipeline.Result{}, rerr
			}
			res.Outputs = append(res.Outputs, outs...)
			s.remember(r.RecordID)
			continue
		}
		if out.Outcome == Admitted || out.Outcome == Filtered {
			s.remember(r.RecordID)
			s.records++
			s.rewardSum += r.RewardTotal
			if r.RewardTotal > 0 {
				s.successes++
			}
		}
		switch out.Outcome {
		case Admitted:
			if len(s.held) == 0 {
				s.opened = now
			}
			s.held[m.Ref] = struct{}{}
		case Filtered:
			ev, err := s.census(r.RecordID, r.TaskID, r.GroupID, schemas.CensusFiltered, string(out.Filter), "", 0, now)
			if err != nil {
				return pipeline.Result{}, err
			}
			res.Outputs = append(res.Outputs, ev)
		}
	}
	if s.win.Ready() {
		if err := s.close(&res, "full"); err != nil {
			return pipeline.Result{}, err
		}
	}
	if _, ok := s.held[m.Ref]; ok {
		// Rows of m joined the open window after an earlier window closed
		// in this same call: m stays held for the open window.
		res.Hold = true
		kept := res.Release[:0]
		for _, r := range res.Release {
			if r != m.Ref {
				kept = append(kept, r)
			}
		}
		res.Release = kept
	}
	return res, nil
}

// Tick closes a window that waited longer than MaxWait.
func (s *Stage) Tick(_ context.Context, now time.Time) (pipeline.Result, error) {
	var res pipeline.Result
	if s.cfg.MaxWait > 0 && len(s.held) > 0 && now.Sub(s.opened) >= s.cfg.MaxWait {
		err := s.close(&res, "timeout")
		return res, err
	}
	return res, nil
}

// close packs the open window into res.
func (s *Stage) close(res *pipeline.Result, by string) error {
	groups := s.win.DecidedGroups()
	if len(s.win.Pending()) == 0 && (!s.cfg.CountDecidedGroups || len(groups) == 0) {
		return nil
	}
	index := s.nextIndex
	batch, closed := s.win.Close(index, s.cfg.RunID, s.cfg.ContractHash, s.win.TrainerVersion())
	now := s.cfg.Now()
	rec := WindowRecord{
		BatchID: schemas.BatchID(s.cfg.RunID, index), BatchIndex: index, RunID: s.cfg.RunID,
		ContractHash: s.cfg.ContractHash, TrainerVersion: batch.TrainerVersion, ClosedBy: by,
		Filtered: closed.Filtered, Tokens: closed.Stats.Tokens, TrainedTokens: closed.Stats.TrainedTokens,
		Rows: closed.Stats.Rows, Efficiency: closed.Stats.Efficiency,
		Groups: groups, Records: s.records,
	}
	if s.records > 0 {
		rec.RewardMean = s.rewardSum / float64(s.records)
		rec.SuccessRate = float64(s.successes) / float64(s.records)
	}
	s.records, s.rewardSum, s.successes = 0, 0, 0
	for _, a := range closed.Admitted {
		rec.Admitted = append(rec.Admitted, a.RecordID)
		if lag := batch.TrainerVersion - a.PolicyVersion; lag > rec.MaxLag {
			rec.MaxLag = lag
		}
	}
	if len(batch.Rows) > 0 {
		b, release, err := schemas.PackedBatches.EncodePooled(batch)
		if err != nil {
			return fmt.Errorf("pack: encode batch %d: %w", index, err)
		}
		res.Outputs = append(res.Outputs, pipeline.Output{
			Topic: s.cfg.Topics.Batches, Key: []byte(batch.BatchID), Value: b,
			Headers: stagekit.Headers(schemas.KindPackedBatch, batch.BatchID), Release: release,
		})
		s.nextIndex++
	} else {
		rec.BatchID = ""
	}
	lin, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("pack: encode window record: %w", err)
	}
	res.Outputs = append(res.Outputs, pipeline.Output{Topic: s.cfg.Topics.Windows, Key: []byte(s.cfg.RunID), Value: lin})
	for _, a := range closed.Admitted {
		ev, err := s.census(a.RecordID, "", a.GroupID, schemas.CensusAdmitted, "", batch.BatchID, int64(a.Tokens), now)
		if err != nil {
			return err
		}
		res.Outputs = append(res.Outputs, ev)
	}
	for _, d := range closed.Filtered {
		ev, err := s.census(d.RecordID, "", d.GroupID, schemas.CensusFiltered, string(d.Filter), "", 0, now)
		if err != nil {
			return err
		}
		res.Outputs = append(res.Outputs, ev)
	}
	for ref := range s.held {
		res.Release = append(res.Release, ref)
	}
	clear(s.held)
	return nil
}

// maxBehaviorVersion is the newest policy version that sampled a turn of r
// (-1 when it has none).
func maxBehaviorVersion(r *schemas.Scored) int64 {
	v := int64(-1)
	for i := range r.Turns {
		v = max(v, r.Turns[i].PolicyVersion)
	}
	return v
}

func (s *Stage) census(id, task, group, kind, reason, batch string, tokens int64, now time.Time) (pipeline.Output, error) {
	return stagekit.Census(s.cfg.Topics.Census, schemas.CensusEvent{
		RunID: s.cfg.RunID, AttemptID: id, TaskID: task, GroupID: group, Kind: kind, Stage: "pack",
		Reason: reason, BatchID: batch, Tokens: tokens, PolicyVersion: s.win.TrainerVersion(), At: now.UnixMicro(),
	})
}
