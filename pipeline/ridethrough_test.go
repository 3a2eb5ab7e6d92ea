package pipeline

import (
	"context"
	"fmt"
	"sync"
	"syscall"
	"testing"

	"github.com/segmentio/kafka-go"
)

// queuedFailures is a group reader whose first fetches return the
// failures kafka-go's reader queued while a broker was down, then the
// records; commits are recorded.
type queuedFailures struct {
	mu        sync.Mutex
	failures  int
	records   []kafka.Message
	committed []kafka.Message
}

func (r *queuedFailures) FetchMessage(ctx context.Context) (kafka.Message, error) {
	r.mu.Lock()
	if r.failures > 0 {
		r.failures--
		r.mu.Unlock()
		return kafka.Message{}, fmt.Errorf("failed to dial: failed to open connection to 127.0.0.1:1: %w", syscall.ECONNREFUSED)
	}
	if len(r.records) > 0 {
		m := r.records[0]
		r.records = r.records[1:]
		r.mu.Unlock()
		return m, nil
	}
	r.mu.Unlock()
	<-ctx.Done()
	return kafka.Message{}, ctx.Err()
}

func (r *queuedFailures) CommitMessages(_ context.Context, msgs ...kafka.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.committed = append(r.committed, msgs...)
	return nil
}

func (r *queuedFailures) Close() error { return nil }

func (r *queuedFailures) committedThrough(topic string, partition int) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	next := int64(-1)
	for _, m := range r.committed {
		if m.Topic == topic && m.Partition == partition {
			next = max(next, m.Offset+1)
		}
	}
	return next
}

// TestOperatorDrainsQueuedFetchFailures: kafka-go's group reader queues a
// failure for every retry it made while a partition leader was
// unreachable, among the records; once the cluster is back they are stale.
// The operator reads through them without a backoff each (200 failures at
// the former 2 s backoff took over six minutes) and processes the record
// behind them, keeping its state and its group membership.
func TestOperatorDrainsQueuedFetchFailures(t *testing.T) {
	addr := startCluster(t, "in", "out", "quarantine")
	r := &queuedFailures{failures: 200, records: []kafka.Message{
		{Topic: "in", Partition: 0, Offset: 0, Key: []byte("k"), Value: []byte("after the outage")},
	}}
	op, err := NewOperator(testConfig(addr), upper{})
	if err != nil {
		t.Fatal(err)
	}
	op.newReader = func(kafka.ReaderConfig) groupReader { return r }
	runUntil(t, op, func() bool { return r.committedThrough("in", 0) == 1 })
	out := drain(t, addr, "out", 1)
	if string(out[0].Value) != "AFTER THE OUTAGE" {
		t.Fatalf("output %q", out[0].Value)
	}
}
