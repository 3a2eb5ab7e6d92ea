package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// runSnapshot is a snapshot operator running alongside a run (the demo's
// lineage: `trajflow demo --out D` then `trajflow replay D`).
type runSnapshot struct {
	stage   *parquet.Stage
	cancel  context.CancelFunc
	done    chan error
	stopped bool
	err     error
	brokers []string
	specs   []struct {
		name  string
		parts int
	}
}

// startRunSnapshot starts the snapshot operator writing the run's topics
// under dir. The run is new: a snapshot of an earlier run of the same id in
// dir is removed first (its offsets would otherwise count as written).
func startRunSnapshot(c *contract.Contract, topics pipeline.Topics, deps operators.Deps, brokers []string, dir string, log *slog.Logger) (*runSnapshot, error) {
	if err := os.RemoveAll(parquet.RunDir(dir, c.RunID)); err != nil {
		return nil, fmt.Errorf("snapshot: clear the earlier run: %w", err)
	}
	deps.SnapshotDir = dir
	st, err := operators.New("snapshot", deps)
	if err != nil {
		return nil, err
	}
	ps, ok := st.(*parquet.Stage)
	if !ok {
		return nil, fmt.Errorf("snapshot stage is a %T", st)
	}
	op, err := pipeline.NewOperator(pipeline.Config{
		Brokers: brokers, GroupID: c.RunID + ".snapshot", QuarantineTopic: topics.Quarantine,
		MaxMessageBytes: c.Topics.MaxMessageBytes, StateDir: filepath.Join(dir, "state", "snapshot"),
		Logger: log.With("stage", "snapshot"), Instance: "snapshot",
		CommitInterval: 100 * time.Millisecond, TickInterval: 200 * time.Millisecond,
	}, st)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &runSnapshot{stage: ps, cancel: cancel, done: make(chan error, 1), brokers: brokers}
	for _, spec := range operators.TopicSpecs(c, topics) {
		s.specs = append(s.specs, struct {
			name  string
			parts int
		}{spec.Name, spec.Partitions})
	}
	go func() { s.done <- op.Run(ctx) }()
	return s, nil
}

// stop stops the operator gracefully (buffered messages are written).
func (s *runSnapshot) stop() error {
	if s.stopped {
		return s.err
	}
	s.stopped = true
	s.cancel()
	if err := <-s.done; !errors.Is(err, pipeline.ErrStopped) {
		s.err = fmt.Errorf("snapshot: %w", err)
	}
	return s.err
}

// finish waits until the snapshot has consumed every message the run's
// topics hold now, then stops it, so the files hold the whole run.
func (s *runSnapshot) finish(ctx context.Context, timeout time.Duration) error {
	ends, err := topicEnds(ctx, s.brokers, s.specs)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	for !s.stage.Caught(ends) {
		select {
		case err := <-s.done:
			s.stopped = true
			return fmt.Errorf("snapshot stopped early: %w", err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("snapshot: not caught up with the run's topics after %v", timeout)
		}
	}
	return s.stop()
}

// topicEnds returns the high-water mark of every partition.
func topicEnds(ctx context.Context, brokers []string, specs []struct {
	name  string
	parts int
}) (map[string]map[int]int64, error) {
	out := map[string]map[int]int64{}
	for _, spec := range specs {
		out[spec.name] = map[int]int64{}
		for p := range spec.parts {
			cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			end, err := pipeline.EndOffset(cctx, &pipeline.Config{Brokers: brokers}, spec.name, p)
			cancel()
			if err != nil {
				return nil, fmt.Errorf("snapshot: end offset of %s/%d: %w", spec.name, p, err)
			}
			out[spec.name][p] = end
		}
	}
	return out, nil
}
