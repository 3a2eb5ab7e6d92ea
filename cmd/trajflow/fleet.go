package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// runProgress is where a run stands, read from its windows and policy
// topics: the groups pack decided, the batches it closed and the last
// release the trainer published.
type runProgress struct {
	Decided, Want int // groups decided (distinct), groups of every round (0: no round limit)
	Windows       int // distinct window records
	Batches       int // distinct batches
	Version       int64
	Release       schemas.PolicyRelease // the last ready release
	// Gate is the gate's last decision on a release (the final one of
	// its version first), Halted dispatch's acknowledgement of a stop
	// (nil: none): a halted run is done once the rounds it launched are
	// decided and trained.
	Gate, Halted *schemas.GateDecision
	// Final is set once the gate ruled on the run's final evaluation.
	Final bool
	// Stopped is set by status when no operator of the fleet answers.
	Stopped bool
}

// trained reports whether a run with a round limit has decided every
// group and trained every batch: the last release's consumed batches
// (schemas.PolicyRelease.Consumed), not its version — after a gate's
// rollback the version runs one ahead, and a run read as trained by it
// still has its last batch in the trainer (the eval operator would write
// the final evaluation of the release before the last).
func (p runProgress) trained() bool {
	return p.Want > 0 && p.Decided >= p.Want && p.Release.Consumed() >= int64(p.Batches)
}

// done reports whether a run with a round limit is over: trained and,
// with a gate (a decision on the decisions topic) and no stop, ruled on
// its last release with every suite — the release's own evaluation, or
// the final one the eval operator writes once the run is trained.
func (p runProgress) done() bool {
	if !p.trained() {
		return false
	}
	if p.Gate == nil || p.Halted != nil || p.Final {
		return true
	}
	return p.Gate.PolicyVersion >= p.Version && p.Gate.Evaluated
}

// runTrainer is a stage told when the run is trained, before it is over
// (the eval operator: it then writes the final evaluation).
type runTrainer interface {
	RunTrained()
}

// readProgress scans the windows, policy and decisions topics of topics.
// want is the number of groups of the run (rounds x perRound, perRound
// the contract's dispatch.groups_per_update; 0 without a round limit); a
// stop lowers it to the rounds dispatch launched.
func readProgress(ctx context.Context, cfg *pipeline.Config, topics pipeline.Topics, want, perRound int) (runProgress, error) {
	p := runProgress{Want: want}
	groups, batches, windows := map[string]bool{}, map[string]bool{}, map[string]bool{}
	err := pipeline.ScanTail(ctx, cfg, topics.Windows, 0, func(m pipeline.Message) error {
		w, err := schemas.DecodeWindow(m.Value)
		if err != nil {
			return nil // not a window record: nothing to count
		}
		windows[fmt.Sprint(w.BatchIndex, w.BatchID, w.Groups)] = true
		for _, g := range w.Groups {
			groups[g] = true
		}
		if w.BatchID != "" {
			batches[w.BatchID] = true
		}
		return nil
	})
	if err != nil {
		return p, fmt.Errorf("read %s: %w", topics.Windows, err)
	}
	err = pipeline.ScanTail(ctx, cfg, topics.Policy, 0, func(m pipeline.Message) error {
		if rel, err := schemas.DecodeRelease(m.Value); err == nil && rel.Ready && rel.PolicyVersion >= p.Version {
			p.Version, p.Release = rel.PolicyVersion, rel
		}
		return nil
	})
	if err != nil {
		return p, fmt.Errorf("read %s: %w", topics.Policy, err)
	}
	err = pipeline.ScanTail(ctx, cfg, topics.Decisions, 0, func(m pipeline.Message) error {
		d, err := schemas.DecodeGateDecision(m.Value)
		switch {
		case err != nil:
		case d.Action == schemas.GateHalted:
			p.Halted = &d
		case p.Gate == nil || d.PolicyVersion > p.Gate.PolicyVersion || (d.PolicyVersion == p.Gate.PolicyVersion && !p.Gate.Final):
			p.Gate = &d
		}
		if err == nil && d.Final {
			p.Final = true
		}
		return nil
	})
	if err != nil {
		return p, fmt.Errorf("read %s: %w", topics.Decisions, err)
	}
	if p.Halted != nil {
		p.Want = int(p.Halted.RoundsDispatched) * perRound
	}
	p.Decided, p.Batches, p.Windows = len(groups), len(batches), len(windows)
	return p, nil
}

// caughtStage is a stage that says whether it processed every offset
// below given ends (the snapshot stage: it commits only when it writes a
// file, so its group's offsets lag behind what it holds).
type caughtStage interface {
	Caught(ends map[string]map[int]int64) bool
}

// endWatch stops an operator of a run with a round limit once the run is
// done (every group decided, every batch trained and, with a gate, the
// final ruling made: runProgress.done) and the operator has drained its
// inputs: its group committed every record of them, or, for the snapshot
// stage, it holds every record. Both must hold on two polls in a row, so
// that a record produced in between is not left behind. A stage that
// waits to be told the run is trained (runTrainer: the eval operator,
// which then writes the final evaluation) is told once the run is trained
// and its inputs drained.
type endWatch struct {
	cc     kafka.ClientConfig
	cfg    *pipeline.Config
	topics pipeline.Topics
	group  string
	want   int
	// perRound is the contract's dispatch.groups_per_update.
	perRound int
	every    time.Duration
	op       atomic.Pointer[pipeline.Operator] // the operator now running
	log      *slog.Logger
	ended    atomic.Bool
	final    runProgress
}

// run polls until ctx ends or the operator may stop, then calls stop.
func (w *endWatch) run(ctx context.Context, stop func()) {
	streak := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(w.every):
		}
		ok, p, err := w.check(ctx)
		if err != nil {
			if ctx.Err() == nil {
				w.log.Debug("end of run not checked", "err", err)
			}
			streak = 0
			continue
		}
		if !ok {
			streak = 0
			continue
		}
		if streak++; streak >= 2 {
			w.final = p
			w.ended.Store(true)
			w.log.Info("run done and inputs drained; stopping", "groups", p.Decided, "batches", p.Batches, "policy_version", p.Version)
			stop()
			return
		}
	}
}

func (w *endWatch) check(ctx context.Context) (bool, runProgress, error) {
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	p, err := readProgress(cctx, w.cfg, w.topics, w.want, w.perRound)
	if err != nil || !p.trained() {
		return false, p, err
	}
	op := w.op.Load()
	if op == nil {
		return false, p, nil
	}
	select {
	case <-op.Ready():
	default:
		return false, p, nil
	}
	inputs := op.Stage().Topics()
	if cs, ok := op.Stage().(caughtStage); ok {
		ends := map[string]map[int]int64{}
		lags, err := kafka.GroupLag(cctx, w.cc, w.cc.Brokers, w.group, inputs)
		if err != nil {
			return false, p, err
		}
		for _, l := range lags {
			if ends[l.Topic] == nil {
				ends[l.Topic] = map[int]int64{}
			}
			ends[l.Topic][l.Partition] = l.End
		}
		return cs.Caught(ends) && p.done(), p, nil
	}
	lags, err := kafka.GroupLag(cctx, w.cc, w.cc.Brokers, w.group, inputs)
	if err != nil {
		return false, p, err
	}
	for _, l := range lags {
		if l.Lag() > 0 {
			return false, p, nil
		}
	}
	if rt, ok := op.Stage().(runTrainer); ok {
		rt.RunTrained() // every release measured: the final evaluation is due
	}
	return p.done(), p, nil
}
