package loop

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
)

// fleet is the loop's operators, each running in a goroutine it owns.
type fleet struct {
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	errs    chan error
	stopped bool
}

// startOperators starts every operator of the loop, each a Kafka consumer
// group of its own, through operators.NewOperator.
func (r *runner) startOperators() (*fleet, error) {
	ctx, cancel := context.WithCancel(context.Background())
	stages := r.stages()
	f := &fleet{cancel: cancel, errs: make(chan error, len(stages)+max(0, r.o.RolloutWorkers-1))}
	r.opsStart = time.Now()
	for _, inst := range instances(stages, r.o.RolloutWorkers) {
		name := inst.stage
		op, err := operators.NewOperator(name, r.deps, pipeline.Config{
			Brokers: r.brokers, StateDir: filepath.Join(r.o.Out, "state", inst.name),
			Logger: r.log.With("stage", name), Instance: "demo-" + inst.name,
			CommitInterval: 100 * time.Millisecond, TickInterval: 50 * time.Millisecond, BatchTimeout: time.Millisecond,
			Metrics: r.o.Metrics,
		})
		if err != nil {
			f.stop()
			return nil, err
		}
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			if err := op.Run(ctx); err != nil && !errors.Is(err, pipeline.ErrStopped) {
				f.errs <- fmt.Errorf("operator %s: %w", name, err)
			}
		}()
	}
	return f, nil
}

// stop stops every operator gracefully (each drains its outputs and
// commits) and returns the first failure of one; it may be called again.
func (f *fleet) stop() error {
	if !f.stopped {
		f.stopped = true
		f.cancel()
		f.wg.Wait()
	}
	select {
	case err := <-f.errs:
		return err
	default:
		return nil
	}
}

// snapshot is the snapshot operator running alongside the loop (the
// lineage of `trajflow demo --out D`, read by `trajflow replay D` and
// `trajflow census D`).
type snapshot struct {
	stage   *parquet.Stage
	cancel  context.CancelFunc
	done    chan error
	stopped bool
	err     error
	brokers []string
	specs   []kafka.TopicSpec
}

// startSnapshot starts the snapshot operator writing the run's topics
// under the output directory. The run is new: a snapshot of an earlier run
// of the same id there is removed first (its offsets would otherwise count
// as written).
func (r *runner) startSnapshot() (*snapshot, error) {
	dir := r.o.Out
	if err := os.RemoveAll(parquet.RunDir(dir, r.c.RunID)); err != nil {
		return nil, fmt.Errorf("snapshot: clear the earlier run: %w", err)
	}
	deps := r.deps
	deps.SnapshotDir = dir
	op, err := operators.NewOperator("snapshot", deps, pipeline.Config{
		Brokers: r.brokers, StateDir: filepath.Join(dir, "state", "snapshot"),
		Logger: r.log.With("stage", "snapshot"), Instance: "snapshot",
		CommitInterval: 100 * time.Millisecond, TickInterval: 200 * time.Millisecond,
		Metrics: r.o.Metrics,
	})
	if err != nil {
		return nil, err
	}
	ps, ok := op.Stage().(*parquet.Stage)
	if !ok {
		return nil, fmt.Errorf("snapshot stage is a %T", op.Stage())
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &snapshot{stage: ps, cancel: cancel, done: make(chan error, 1), brokers: r.brokers,
		specs: operators.TopicSpecs(r.c, r.topics)}
	go func() { s.done <- op.Run(ctx) }()
	return s, nil
}

// stop stops the operator gracefully (buffered messages are written).
func (s *snapshot) stop() error {
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
func (s *snapshot) finish(ctx context.Context, timeout time.Duration) error {
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
func topicEnds(ctx context.Context, brokers []string, specs []kafka.TopicSpec) (map[string]map[int]int64, error) {
	out := map[string]map[int]int64{}
	for _, spec := range specs {
		out[spec.Name] = map[int]int64{}
		for p := range spec.Partitions {
			cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			end, err := pipeline.EndOffset(cctx, &pipeline.Config{Brokers: brokers}, spec.Name, p)
			cancel()
			if err != nil {
				return nil, fmt.Errorf("snapshot: end offset of %s/%d: %w", spec.Name, p, err)
			}
			out[spec.Name][p] = end
		}
	}
	return out, nil
}

// instance is one operator of the loop.
type instance struct{ stage, name string }

// instances lists the operators of stages, with `workers` rollout
// operators in one consumer group (rollout, rollout-1, ...).
func instances(stages []string, workers int) []instance {
	var out []instance
	for _, st := range stages {
		out = append(out, instance{st, st})
		if st == "rollout" {
			for i := 1; i < workers; i++ {
				out = append(out, instance{st, fmt.Sprintf("%s-%d", st, i)})
			}
		}
	}
	return out
}
