package pack

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"

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
	// CountDecidedGroups is stop-and-synchronize mode (docs/PIPELINE.md §15,
	// contract dispatch.mode sync): Options.BatchGroups counts every group
	// decided in the window, admitted or filtered, and a window whose
	// groups were all filtered still closes, with a WindowRecord and no
	// batch, so the dispatcher can start the next round.
	CountDecidedGroups bool
	// Deadlines is earliest-deadline-first admission (asynchronous mode,
	// docs/ARCHITECTURE.md "Pacing"): the open window keeps a place for
	// every running, undecided group (census "started" events) whose last
	// chance to train within Options.MaxLag is this window's batch, and a
	// younger group that would take it waits, held, for a later window.
	// Needs Options.BatchGroups.
	Deadlines bool
	// DeadlineWait is how long younger groups wait for the reserved groups
	// that have not come before the reservations are given up (default
	// 30 s): a group that never reaches pack holds no window for ever.
	DeadlineWait time.Duration
	Now          func() time.Time
}

// WindowRecord is the lineage of one closed window (schemas.WindowRecord),
// produced on the windows topic.
type WindowRecord = schemas.WindowRecord

// Stage is the pack operator: the lag-aware admission window (docs/PIPELINE.md §15),
// reconstruction and packing (docs/PIPELINE.md §11). It consumes the scored topic,
// the policy topic (to know the trainer's version) and the census (the
// failed generation its windows account for, docs/SYSTEMS.md §17). Every record the
// open window decided — admitted or filtered — is held until the window
// closes; the batch, its lineage record and the census events are then
// produced, and the window's inputs are released together. Holding the
// filtered ones too is what makes the window rebuildable: a filtered group
// counts towards the window's decided groups, so an offset committed
// before its window closed would leave a restarted pack unable to ever
// fill that window again (the round would never complete).
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
	opened    time.Time // the open window's first decision
	// closedGroups are the groups of the closed windows read back at start
	// (the windows topic's tail), with the trainer version of each one's
	// window: a redelivered message of one is decided. closedRecords are
	// the decisions those window records list, by record id: the census
	// events of a redelivered closed group are written again from them
	// (see closedCensus).
	closedGroups  map[string]int64
	closedRecords map[string]closedDecision
	// bounded deduplication memory (see remember)
	recent *idset.Ring
	env    *pipeline.Env // counts the duplicates dropped
	// statistics of the records decided in the open window: cost holds
	// each one's cost by id (len(cost) is their number); carry is the
	// cost of the closed windows of batch index nextIndex that packed no
	// batch (every record filtered): the next batch's cost header
	// includes it (docs/SYSTEMS.md §17).
	rewardSum float64
	successes int
	cost      map[string]schemas.EpisodeCost
	carry     schemas.WindowCost
	// failures: the failed generation the census reported while the
	// window was open (schemas.FailureCost), the ids of those events (the
	// window record lists them) and their held messages; failSeen (bounded
	// by failRing) holds the events already counted, so that one
	// redelivered after its window closed is not counted twice.
	failed     schemas.EpisodeCost
	failedIDs  []string
	failedHeld []pipeline.Ref
	failSeen   *idset.Set
	failRing   *idset.Ring
	// Deadlines: the running groups (dl, nil when off), the
	// scored messages waiting for a later window (deferred, in arrival
	// order, held), when the last of them was admitted or first deferred
	// (waitSince), and the trainer's newest release: its version and how
	// many batches it had consumed (expected).
	dl        *deadlines
	deferred  []deferred
	waitSince time.Time
	released  int64
	consumed  int64
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
	if cfg.DeadlineWait <= 0 {
		cfg.DeadlineWait = 30 * time.Second
	}
	s := &Stage{cfg: cfg, win: w, held: map[pipeline.Ref]struct{}{}, cost: map[string]schemas.EpisodeCost{}, recent: idset.NewRing(cfg.DedupMemory),
		failSeen: idset.New(), failRing: idset.NewRing(cfg.DedupMemory)}
	if cfg.Deadlines {
		if cfg.Options.BatchGroups <= 0 {
			return nil, fmt.Errorf("%w: deadline admission needs packing.batch_groups", ErrOptions)
		}
		s.dl = newDeadlines(cfg.Options.MaxLag, 1<<16)
	}
	return s, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "pack" }

// Topics implements pipeline.Stage.
func (s *Stage) Topics() []string { return s.cfg.Topics.Names(pipeline.InputsOf(s.Name())) }

const seenPrefix = "pack/admitted/"

// Start restores the admitted ids and the next batch index.
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
	s.admitted = st.IDSet(seenPrefix, s.cfg.DedupHorizon)
	batches := 0
	onTopic := map[string]bool{}
	err = env.Scan(ctx, s.cfg.Topics.Batches, s.cfg.RebuildScan, func(m pipeline.Message) error {
		b, err := schemas.PackedBatches.DecodeShared(nil, m.Value)
		if err != nil {
			return fmt.Errorf("pack: batches topic at %s: %w", m.Ref, err)
		}
		batches++
		onTopic[b.BatchID] = true
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
	// Groups of closed windows. A pack that closed a window and died
	// before the window's inputs were committed (its group coordinator
	// lost at that moment, say) is redelivered them. Their admitted
	// records are known from the batches topic, but the filtered ones are
	// on no topic a restart reads: taken as new, a filtered group would
	// count in the open window, next to part of the next round, which
	// could then never be decided in full. So a redelivered group listed
	// by a closed window is decided (closedCensus), but for its records no
	// closed window decided: a window that fills in the middle of a
	// group's message closes, and the rest of the message opens the next
	// one. A window whose batch is not on the batches topic (its write was
	// lost with the pack) did not close: its records are decided again.
	windows, undecodable := 0, 0
	s.closedGroups, s.closedRecords = map[string]int64{}, map[string]closedDecision{}
	err = env.Scan(ctx, s.cfg.Topics.Windows, s.cfg.RebuildScan, func(m pipeline.Message) error {
		w, err := schemas.DecodeWindow(m.Value)
		if err != nil {
			undecodable++
			return nil
		}
		if w.BatchID != "" && !onTopic[w.BatchID] {
			return nil
		}
		if w.BatchID == "" && w.BatchIndex == s.nextIndex && w.Cost != nil {
			s.carry.Add(*w.Cost)
		}
		windows++
		for _, id := range w.FailedEvents {
			s.sawFailure(id)
		}
		for _, g := range w.Groups {
			s.closedGroups[g] = w.TrainerVersion
		}
		for i, id := range w.Admitted {
			d := closedDecision{kind: schemas.CensusAdmitted, batch: w.BatchID, version: w.TrainerVersion}
			if i < len(w.AdmittedTokens) {
				d.tokens = w.AdmittedTokens[i]
			}
			if i < len(w.AdmittedStaleTokens) {
				d.stale = w.AdmittedStaleTokens[i]
			}
			s.closedRecords[id] = d
		}
		for _, f := range w.Filtered {
			s.closedRecords[f.RecordID] = closedDecision{kind: schemas.CensusFiltered, reason: f.Filter, stale: f.StaleTokens, version: w.TrainerVersion}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("pack: rebuild from windows: %w", err)
	}
	if s.dl != nil {
		// The census is re-read from its committed offset, which a held
		// failure event may keep well behind: the "started" events of
		// groups closed windows decided reserve nothing.
		for g := range s.closedGroups {
			s.dl.decided(g)
		}
	}
	env.Logger.Info("pack state restored", "batches_scanned", batches, "windows_scanned", windows,
		"undecodable_window_records", undecodable, "next_batch", s.nextIndex)
	return nil
}

// closedDecision is a decision a closed window's record lists: the
// census event it wrote for one record.
type closedDecision struct {
	kind, reason, batch    string
	tokens, stale, version int64
}

// closedCensus decides the redelivered rows of a group a window closed
// before this start decided, and returns the rows no closed window
// decided, for the open window. A decided row enters no window again, and
// its census event is written again (into res): the window record, batch
// and census events of a window are separate writes, and a pack killed
// after the record and batch were acknowledged but before all of its
// census events were (each on its attempt's partition) left attempts
// trained or filtered with no census decision, which the accounting of
// `trajflow bench --processes --kill pack` found lost (2–7 attempts in
// every run). The events carry the ids of the first writing, so the census
// counts each once.
//
// Admitted and close-filtered rows are listed by their window record. A
// row filtered when it was added is listed nowhere: judged again at the
// closed window's trainer version it is filtered again (a record stale
// then is stale at any later version), and decided. A row still judged
// admissible belongs to a later window of the group that did not close (a
// window full in the middle of a group's message closes, and the rest of
// the message starts the next one; that window's batch was lost with the
// pack): it is returned to be decided again.
func (s *Stage) closedCensus(res *pipeline.Result, rows []schemas.Scored, version int64) ([]schemas.Scored, error) {
	var rest []schemas.Scored
	now := s.now()
	for i := range rows {
		r := &rows[i]
		d, ok := s.closedRecords[r.RecordID]
		if !ok {
			_, f, err := Reconstruct(r, version, s.cfg.Options)
			if err != nil || f == FilterNone {
				rest = append(rest, *r)
				continue
			}
			d = closedDecision{kind: schemas.CensusFiltered, reason: string(f), version: version}
			if f == FilterStale {
				d.stale = actionTokens(r)
			}
		}
		s.win.MarkSeen(r.RecordID)
		s.remember(r.RecordID)
		ev, err := s.census(r.RecordID, r.TaskID, r.GroupID, d.kind, d.reason, d.batch, d.tokens, d.stale, d.version, now)
		if err != nil {
			return nil, err
		}
		res.Outputs = append(res.Outputs, ev)
	}
	return rest, nil
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
		var res pipeline.Result
		if rel.Ready && rel.PolicyVersion >= s.released {
			s.released, s.consumed = rel.PolicyVersion, max(s.consumed, rel.Consumed())
			if err := s.drain(ctx, &res); err != nil {
				return pipeline.Result{}, err
			}
			s.keepHeld(&res)
		}
		return res, nil
	}
	if m.Topic == s.cfg.Topics.Census {
		return s.censusEvent(ctx, m)
	}
	rows, err := stagekit.Decode(schemas.ScoredTrajectories, m)
	if err != nil {
		return pipeline.Result{}, err
	}
	if err := stagekit.CheckID(&m, schemas.DerivedID("advantage", rows[0].GroupID)); err != nil {
		return pipeline.Result{}, err
	}
	var res pipeline.Result
	if version, closed := s.closedGroups[rows[0].GroupID]; closed {
		var err error
		if rows, err = s.closedCensus(&res, rows, version); err != nil || len(rows) == 0 {
			return res, err
		}
	} else if oldest := oldestVersion(rows); s.mustWait(rows[0].GroupID, oldest) {
		if len(s.deferred) == 0 {
			s.waitSince = s.now()
		}
		m.Key, m.Value = slices.Clone(m.Key), slices.Clone(m.Value)
		m.Headers = slices.Clone(m.Headers)
		s.deferred = append(s.deferred, deferred{m: m, group: rows[0].GroupID, oldest: oldest})
		return pipeline.Result{Hold: true}, nil
	}
	if err := s.admit(ctx, &res, m, rows); err != nil {
		return pipeline.Result{}, err
	}
	if err := s.drain(ctx, &res); err != nil {
		return pipeline.Result{}, err
	}
	s.keepHeld(&res)
	if s.holds(m.Ref) {
		res.Hold = true
	}
	return res, nil
}

// keepHeld removes from res.Release the messages still held: rows of a
// message that joined the open window after an earlier window closed in
// the same call (a window full in the middle of the message) stay held
// for the open window.
func (s *Stage) keepHeld(res *pipeline.Result) {
	kept := res.Release[:0]
	for _, r := range res.Release {
		if !s.holds(r) {
			kept = append(kept, r)
		}
	}
	res.Release = kept
}

// holds reports whether message r is held: decided in the open window, or
// deferred to a later one.
func (s *Stage) holds(r pipeline.Ref) bool {
	if _, ok := s.held[r]; ok {
		return true
	}
	return slices.ContainsFunc(s.deferred, func(d deferred) bool { return d.m.Ref == r })
}

// admit decides the rows of scored message m (one group's records) in the
// open window, closing it first when it does not accept them and after
// them when it is full.
func (s *Stage) admit(ctx context.Context, res *pipeline.Result, m pipeline.Message, rows []schemas.Scored) error {
	if s.dl != nil {
		s.dl.decided(rows[0].GroupID)
	}
	now := s.now()
	for i := range rows {
		r := &rows[i]
		if !s.win.Accepts(r.GroupID) {
			if err := s.close(ctx, res, "full"); err != nil {
				return err
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
			return err
		} else if dup {
			s.env.DuplicateDropped(r.RecordID)
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
				return err // Accepts was checked: a defect, not bad input
			}
			outs, rerr := stagekit.RefuseRow(schemas.ScoredTrajectories, s.cfg.Topics, s.Name(), m, i, *r, stagekit.Refused{
				RunID: r.RunID, AttemptID: r.RecordID, TaskID: r.TaskID, GroupID: r.GroupID,
				Reason: reason, Detail: err.Error(), Infra: reason != "eval_task_id",
				Incident: reason == "eval_task_id", At: now.UnixMicro(), Turns: r.Turns,
			})
			if rerr != nil {
				return rerr
			}
			res.Outputs = append(res.Outputs, outs...)
			stagekit.TraceAttempt(ctx, s.Name(), "advantage", now, r.RecordID,
				attribute.String("trajflow.decision", schemas.CensusQuarantined), attribute.String("trajflow.reason", reason))
			s.remember(r.RecordID)
			continue
		}
		if out.Outcome == Admitted || out.Outcome == Filtered {
			s.remember(r.RecordID)
			s.cost[r.RecordID] = schemas.EpisodeCostOf(r.Turns)
			s.rewardSum += r.RewardTotal
			if r.RewardTotal > 0 {
				s.successes++
			}
			// Held until the window is decided, admitted or filtered: the
			// decision lives in the open window only.
			if len(s.held) == 0 {
				s.opened = now
			}
			s.held[m.Ref] = struct{}{}
		}
		switch out.Outcome {
		case Duplicate:
			s.env.DuplicateDropped(r.RecordID)
		case Filtered:
			s.env.Metrics().Filtered(string(out.Filter))
			stagekit.TraceAttempt(ctx, s.Name(), "advantage", now, r.RecordID,
				attribute.String("trajflow.decision", schemas.CensusFiltered), attribute.String("trajflow.filter", string(out.Filter)))
			stale := int64(0)
			if out.Filter == FilterStale {
				stale = actionTokens(r)
			}
			ev, err := s.census(r.RecordID, r.TaskID, r.GroupID, schemas.CensusFiltered, string(out.Filter), "", 0, stale, s.win.TrainerVersion(), now)
			if err != nil {
				return err
			}
			res.Outputs = append(res.Outputs, ev)
		}
	}
	if s.win.Ready() {
		return s.close(ctx, res, "full")
	}
	return nil
}

// censusEvent reads one census event. In deadline mode a rollout's
// "started" event tracks its group (deadlines) and a group quarantined
// upstream is no longer waited for. An event reporting failed generation
// of the run (schemas.FailureCost) is counted in the open window and held
// until the window closes: its cost rides on the window record and the
// next batch's cost header (docs/SYSTEMS.md §17). An event already counted
// in a closed window, and any other event, is passed over; a record that
// is not a census event is refused.
func (s *Stage) censusEvent(ctx context.Context, m pipeline.Message) (pipeline.Result, error) {
	ev, err := stagekit.CensusOf(&m)
	if err != nil {
		return pipeline.Result{}, err
	}
	if ev.RunID != s.cfg.RunID {
		return pipeline.Result{}, nil
	}
	var res pipeline.Result
	if s.dl != nil {
		switch {
		case ev.Kind == schemas.CensusStarted:
			s.dl.started(ev.GroupID, ev.PolicyVersion)
		case ev.Kind == schemas.CensusQuarantined && ev.Stage != s.Name():
			s.dl.decided(ev.GroupID)
			if err := s.drain(ctx, &res); err != nil {
				return pipeline.Result{}, err
			}
			s.keepHeld(&res)
		}
	}
	c, ok := schemas.FailureCost(ev)
	if !ok || s.failSeen.Has(ev.EventID) {
		return res, nil
	}
	s.sawFailure(ev.EventID)
	s.failed.Add(c)
	s.failedIDs = append(s.failedIDs, ev.EventID)
	s.failedHeld = append(s.failedHeld, m.Ref)
	res.Hold = true
	return res, nil
}

// expected is the trainer version the open window's batch will be trained
// at: the newest release's, plus one for every batch packed before it that
// the trainer has not consumed yet.
func (s *Stage) expected() int64 {
	return s.released + max(s.nextIndex-s.consumed, 0)
}

// deferred is a scored message held for a later window (deadline mode),
// with its group and the oldest behavior version of its turns.
type deferred struct {
	m      pipeline.Message
	group  string
	oldest int64
}

// oldestVersion is the oldest behavior version among the turns of rows
// (-1 when they have none).
func oldestVersion(rows []schemas.Scored) int64 {
	oldest := int64(-1)
	for i := range rows {
		for _, t := range rows[i].Turns {
			if oldest < 0 || t.PolicyVersion < oldest {
				oldest = t.PolicyVersion
			}
		}
	}
	return oldest
}

// mustWait reports whether group, whose oldest turn was sampled at version
// oldest, must wait for a later window (deadline mode): it could still be
// trained within MaxLag after this window's batch, and the places this
// window has left are reserved for running groups whose last chance it is.
func (s *Stage) mustWait(group string, oldest int64) bool {
	if s.dl == nil || s.win.HasGroup(group) {
		return false
	}
	e := s.expected()
	if oldest < 0 || oldest+s.cfg.Options.MaxLag <= e {
		return false // its last chance, or already past it: now
	}
	r := s.dl.reserved(e)
	return r > 0 && s.win.Count()+r >= s.cfg.Options.BatchGroups
}

// drain admits the deferred messages that need not wait any more, in the
// order they came.
func (s *Stage) drain(ctx context.Context, res *pipeline.Result) error {
	for i := 0; i < len(s.deferred); {
		d := s.deferred[i]
		if s.mustWait(d.group, d.oldest) {
			i++
			continue
		}
		rows, err := stagekit.Decode(schemas.ScoredTrajectories, d.m)
		if err != nil {
			return fmt.Errorf("pack: deferred message at %s: %w", d.m.Ref, err)
		}
		s.deferred = slices.Delete(s.deferred, i, i+1)
		s.waitSince = s.now()
		if err := s.admit(ctx, res, d.m, rows); err != nil {
			return err
		}
		i = 0 // a close changes what waits: start over
	}
	return nil
}

// sawFailure remembers a counted failure event, forgetting the oldest
// beyond DedupMemory.
func (s *Stage) sawFailure(id string) {
	k := s.failSeen.Add(id)
	if oldest, dropped := s.failRing.Push(k); dropped {
		s.failSeen.Delete(oldest)
	}
}

// Tick closes a window whose oldest decision (admitted or filtered) is
// older than MaxWait, and gives up the reservations that deferred groups
// have waited DeadlineWait for.
func (s *Stage) Tick(ctx context.Context, now time.Time) (pipeline.Result, error) {
	var res pipeline.Result
	if len(s.deferred) > 0 && now.Sub(s.waitSince) >= s.cfg.DeadlineWait {
		e := s.expected()
		n := s.dl.expire(e)
		s.env.Logger.Warn("pack: reserved groups did not come; the groups waiting for them go on",
			"given_up", n, "waiting", len(s.deferred), "trainer_version", e, "waited", now.Sub(s.waitSince).String())
		s.waitSince = now
		if err := s.drain(ctx, &res); err != nil {
			return pipeline.Result{}, err
		}
		s.keepHeld(&res)
	}
	if s.cfg.MaxWait > 0 && len(s.held) > 0 && now.Sub(s.opened) >= s.cfg.MaxWait {
		if err := s.close(ctx, &res, "timeout"); err != nil {
			return pipeline.Result{}, err
		}
		if err := s.drain(ctx, &res); err != nil {
			return pipeline.Result{}, err
		}
		s.keepHeld(&res)
	}
	return res, nil
}

// close packs the open window into res; each decided attempt's trace gets
// pack's span, with its decision.
func (s *Stage) close(ctx context.Context, res *pipeline.Result, by string) error {
	groups := s.win.DecidedGroups()
	if len(s.win.Pending()) == 0 && len(groups) == 0 {
		return nil
	}
	index := s.nextIndex
	batch, closed := s.win.Close(index, s.cfg.RunID, s.cfg.ContractHash, s.win.TrainerVersion())
	now := s.now()
	rec := WindowRecord{
		BatchID: schemas.BatchID(s.cfg.RunID, index), BatchIndex: index, RunID: s.cfg.RunID,
		ContractHash: s.cfg.ContractHash, TrainerVersion: batch.TrainerVersion, ClosedBy: by,
		Filtered: decisions(closed.Filtered), Tokens: closed.Stats.Tokens, TrainedTokens: closed.Stats.TrainedTokens,
		Rows: closed.Stats.Rows, Efficiency: closed.Stats.Efficiency,
		Groups: groups, Records: len(s.cost),
	}
	if n := len(s.cost); n > 0 {
		rec.RewardMean = s.rewardSum / float64(n)
		rec.SuccessRate = float64(s.successes) / float64(n)
	}
	s.rewardSum, s.successes = 0, 0
	cost := schemas.WindowCost{Windows: 1}
	for _, a := range closed.Admitted {
		cost.Admitted.Add(s.cost[a.RecordID])
		delete(s.cost, a.RecordID)
	}
	for _, id := range slices.Sorted(maps.Keys(s.cost)) { // decided, not admitted: filtered
		cost.Filtered.Add(s.cost[id])
	}
	clear(s.cost)
	cost.Failed, rec.FailedEvents = s.failed, s.failedIDs
	s.failed, s.failedIDs = schemas.EpisodeCost{}, nil
	rec.Cost = &cost
	for _, a := range closed.Admitted {
		rec.Admitted = append(rec.Admitted, a.RecordID)
		rec.AdmittedTokens = append(rec.AdmittedTokens, int64(a.Tokens))
		rec.AdmittedStaleTokens = append(rec.AdmittedStaleTokens, int64(a.Stale))
		lag := batch.TrainerVersion - a.PolicyVersion
		if lag > rec.MaxLag {
			rec.MaxLag = lag
		}
		s.env.Metrics().Admitted(lag)
	}
	if len(batch.Rows) == 0 {
		rec.BatchID = ""
	} else if kept := closed.Stats.NewestKept(s.cfg.Options.StalePolicy); kept >= 0 {
		rec.MinLag = batch.TrainerVersion - kept
	}
	lin, err := schemas.EncodeWindow(rec)
	if err != nil {
		return fmt.Errorf("pack: encode window record: %w", err)
	}
	wid := schemas.DerivedID("window", s.cfg.RunID+"/"+strings.Join(groups, ",")+"/"+strings.Join(rec.Admitted, ","))
	res.Outputs = append(res.Outputs, pipeline.Output{Topic: s.cfg.Topics.Windows, Key: []byte(s.cfg.RunID), Value: lin,
		Headers: stagekit.Headers(schemas.KindWindowRecord, wid)})
	if len(batch.Rows) == 0 {
		s.carry.Add(cost)
	} else {
		s.env.Metrics().Batch(closed.Stats.Efficiency, closed.Stats.Tokens)
		total := s.carry
		total.Add(cost)
		hc, err := schemas.EncodeWindowCost(total)
		if err != nil {
			return fmt.Errorf("pack: batch %d: %w", index, err)
		}
		b, release, err := schemas.PackedBatches.EncodePooled(batch)
		if err != nil {
			return fmt.Errorf("pack: encode batch %d: %w", index, err)
		}
		s.carry = schemas.WindowCost{}
		res.Outputs = append(res.Outputs, pipeline.Output{
			Topic: s.cfg.Topics.Batches, Key: []byte(batch.BatchID), Value: b,
			Headers: append(stagekit.Headers(schemas.KindPackedBatch, batch.BatchID),
				pipeline.Header{Key: schemas.HeaderWindowCost, Value: hc}),
			Release: release,
			// Written once the window record is acknowledged: a pack that
			// dies in between leaves a window whose batch is missing,
			// which a restart decides again (Start), never a batch whose
			// window record is missing, whose groups no record would
			// ever name as decided.
			After: true,
		})
		s.nextIndex++
	}
	for _, a := range closed.Admitted {
		ev, err := s.census(a.RecordID, "", a.GroupID, schemas.CensusAdmitted, "", batch.BatchID, int64(a.Tokens), int64(a.Stale), s.win.TrainerVersion(), now)
		if err != nil {
			return err
		}
		res.Outputs = append(res.Outputs, ev)
	}
	stagekit.TraceAttempts(ctx, s.Name(), "advantage", now, len(closed.Admitted), func(i int) string { return closed.Admitted[i].RecordID },
		attribute.String("trajflow.decision", schemas.CensusAdmitted), attribute.String("trajflow.batch_id", batch.BatchID))
	for _, d := range rec.Filtered {
		stagekit.TraceAttempt(ctx, s.Name(), "advantage", now, d.RecordID,
			attribute.String("trajflow.decision", schemas.CensusFiltered), attribute.String("trajflow.filter", d.Filter))
		ev, err := s.census(d.RecordID, "", d.GroupID, schemas.CensusFiltered, d.Filter, "", 0, d.StaleTokens, s.win.TrainerVersion(), now)
		if err != nil {
			return err
		}
		res.Outputs = append(res.Outputs, ev)
	}
	for ref := range s.held {
		res.Release = append(res.Release, ref)
	}
	clear(s.held)
	res.Release = append(res.Release, s.failedHeld...)
	s.failedHeld = nil
	return nil
}

// decisions converts the window's filtered records to the lineage form.
func decisions(ds []Decision) []schemas.WindowDecision {
	out := make([]schemas.WindowDecision, len(ds))
	for i, d := range ds {
		out[i] = schemas.WindowDecision{RecordID: d.RecordID, GroupID: d.GroupID, Filter: string(d.Filter)}
		if d.Filter == FilterStale {
			out[i].StaleTokens = int64(d.Tokens)
		}
	}
	return out
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

func (s *Stage) census(id, task, group, kind, reason, batch string, tokens, stale, version int64, now time.Time) (pipeline.Output, error) {
	return stagekit.Census(s.cfg.Topics.Census, schemas.CensusEvent{
		RunID: s.cfg.RunID, AttemptID: id, TaskID: task, GroupID: group, Kind: kind, Stage: "pack",
		Reason: reason, BatchID: batch, Tokens: tokens, StaleTokens: stale, PolicyVersion: version, At: now.UnixMicro(),
	})
}

// actionTokens is the number of policy-sampled tokens of r.
func actionTokens(r *schemas.Scored) int64 {
	n := 0
	for i := range r.Turns {
		n += len(r.Turns[i].ActionIDs)
	}
	return int64(n)
}

// now is the stage's clock (stagekit.Now).
func (s *Stage) now() time.Time { return stagekit.Now(s.cfg.Now) }
