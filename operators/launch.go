package operators

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/segmentio/kafka-go"

	tfkafka "github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// NewOperator is the one way to start an operator of a run — `trajflow
// run`, the demo, the fleet launcher, the bench and the tests all call it:
// it builds the stage registered under name and its runtime, filling what
// the run determines when rc leaves it empty: the consumer group
// "<run>.<name>", the quarantine topic, the topics' record size limit and
// compression, and the release store of d.ReleaseDir. Every error it returns wraps
// ErrConfig.
func NewOperator(name string, d Deps, rc pipeline.Config) (*pipeline.Operator, error) {
	st, err := New(name, d)
	if err != nil {
		return nil, err
	}
	c := d.Contract
	if rc.GroupID == "" {
		rc.GroupID = c.RunID + "." + name
	}
	if rc.QuarantineTopic == "" {
		rc.QuarantineTopic = d.Topics.Quarantine
	}
	if rc.MaxMessageBytes == 0 {
		rc.MaxMessageBytes = c.Topics.MaxMessageBytes
	}
	if rc.Compression == nil {
		if rc.Compression, err = Compression(c, d.Topics); err != nil {
			return nil, fmt.Errorf("%w: operators: %s: %w", ErrConfig, name, err)
		}
	}
	if rc.Releases == nil && d.ReleaseDir != "" {
		if rc.Releases, err = pipeline.NewDirReleases(d.ReleaseDir); err != nil {
			return nil, fmt.Errorf("%w: operators: %s: %w", ErrConfig, name, err)
		}
	}
	op, err := pipeline.NewOperator(rc, st)
	if err != nil {
		return nil, fmt.Errorf("%w: operators: %s: %w", ErrConfig, name, err)
	}
	return op, nil
}

// Compression is the producer codec of the run's topics (full name ->
// codec) that c's topics.compression declares: what every operator's
// writers use.
func Compression(c *contract.Contract, t pipeline.Topics) (map[string]kafka.Compression, error) {
	return tfkafka.TopicCompression(c.Topics.Compression, t.Name)
}

// Restarts is the restart policy of RunRestarting.
type Restarts struct {
	// Max is how many times run is called again after a failure (< 0:
	// without bound).
	Max int
	// Backoff is the wait before the first restart (default 1 s); it
	// doubles after every further failure up to MaxBackoff (default 10 s),
	// and starts again from Backoff after a run that lasted StableAfter
	// (default a minute).
	Backoff, MaxBackoff, StableAfter time.Duration
	// Logger reports every restart (nil: slog.Default()).
	Logger *slog.Logger
}

// RunRestarting calls run until it returns nil or ctx ends, restarting it
// after a failure with backoff: a fatal error of an operator (brokers
// unreachable past the client's retries, a lost group generation) ends it
// without committing anything more, and building it again is what a
// process restart would do (state rebuilt, uncommitted inputs
// redelivered). An error wrapping ErrConfig is returned at once: no
// restart can fix a configuration. It returns run's last error, or nil
// when ctx ends.
func RunRestarting(ctx context.Context, p Restarts, run func(ctx context.Context) error) error {
	if p.Backoff <= 0 {
		p.Backoff = time.Second
	}
	if p.MaxBackoff <= 0 {
		p.MaxBackoff = 10 * time.Second
	}
	if p.StableAfter <= 0 {
		p.StableAfter = time.Minute
	}
	if p.Logger == nil {
		p.Logger = slog.Default()
	}
	backoff := p.Backoff
	for attempt := 0; ; attempt++ {
		began := time.Now()
		err := run(ctx)
		switch {
		case err == nil || ctx.Err() != nil:
			return err
		case errors.Is(err, ErrConfig):
			return err
		case p.Max >= 0 && attempt >= p.Max:
			return err
		}
		if time.Since(began) > p.StableAfter {
			backoff = p.Backoff
		}
		p.Logger.Warn("operator failed; restarting", "err", err, "restart", attempt+1, "backoff", backoff)
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		backoff = min(2*backoff, p.MaxBackoff)
	}
}
