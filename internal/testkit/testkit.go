// Package testkit starts brokers, creates a run's topics, feeds synthetic
// rollouts and waits for the accounting to settle; shared by the
// conformance tests and benchmarks.
package testkit

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// Run is a run's contract, topics and broker address.
type Run struct {
	Contract *contract.Contract
	Topics   pipeline.Topics
	Addr     string
	// PartialGroupTimeout is the advantage stage's partial-group timeout
	// for StartOperator: 0 means 5 s, negative none (a group closes only
	// when complete or when its absent members are declared).
	PartialGroupTimeout time.Duration
}

// LoadContract loads and resolves a contract file.
func LoadContract(t testing.TB, path string) *contract.Contract {
	t.Helper()
	c, err := contract.Load(path)
	if err != nil {
		t.Fatalf("load contract: %v", err)
	}
	if err := c.Resolve(); err != nil {
		t.Fatalf("resolve contract: %v", err)
	}
	return c
}

// StartBroker starts an in-memory embedded broker on 127.0.0.1, closed
// when the test ends, and returns its address.
func StartBroker(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := kafka.StartBroker(ctx, kafka.BrokerConfig{})
	if err != nil {
		t.Fatalf("start broker: %v", err)
	}
	t.Cleanup(func() { b.Close() })
	return b.Addr()
}

// StartRun starts an in-memory embedded broker (unless addr is given) and
// creates the run's topics.
func StartRun(t testing.TB, c *contract.Contract, addr string) *Run {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if addr == "" {
		addr = StartBroker(t)
	}
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		t.Fatal(err)
	}
	if err := kafka.CreateTopics(ctx, kafka.ClientConfig{}, []string{addr}, operators.TopicSpecs(c, topics)); err != nil {
		t.Fatalf("create topics: %v", err)
	}
	return &Run{Contract: c, Topics: topics, Addr: addr}
}

// Synth returns the synthetic distribution matching the run's contract.
func (r *Run) Synth(meanTokens float64, maxTokens int) synth.Config {
	s := synth.Default()
	s.RunID = r.Contract.RunID
	s.ContractHash = r.Contract.Hash()
	s.GroupSize = r.Contract.Sampler.GroupSize
	s.MaxTurns = r.Contract.Sampler.MaxTurns
	s.MeanTokens = meanTokens
	s.MaxTokens = maxTokens
	s.PolicyVersion = 0
	s.MeanLag = 0
	return s
}

// Produce writes groups [from, to) of s to the trajectories topic, one
// message per group keyed by group id, and returns their attempt ids.
func (r *Run) Produce(t testing.TB, s synth.Config, from, to int64) []string {
	t.Helper()
	tr := &kafkago.Transport{} // not DefaultTransport, whose pools outlive the writer
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{
		Addr: kafkago.TCP(r.Addr), Topic: r.Topics.Trajectories, Balancer: &kafkago.Murmur2Balancer{},
		RequiredAcks: kafkago.RequireAll, BatchTimeout: 2 * time.Millisecond,
		BatchBytes: kafka.WriterBatchBytes(r.Contract.Topics.MaxMessageBytes), Transport: tr,
	}
	defer w.Close()
	var ids []string
	var msgs []kafkago.Message
	for g := from; g < to; g++ {
		rows := s.Group(g)
		b, err := schemas.Trajectories.Encode(nil, rows)
		if err != nil {
			t.Fatalf("encode group %d: %v", g, err)
		}
		for _, row := range rows {
			ids = append(ids, row.RecordID)
		}
		msgs = append(msgs, kafkago.Message{Key: []byte(rows[0].GroupID), Value: b})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for len(msgs) > 0 {
		n := min(len(msgs), 64)
		if err := w.WriteMessages(ctx, msgs[:n]...); err != nil {
			t.Fatalf("produce: %v", err)
		}
		msgs = msgs[n:]
	}
	return ids
}

// Config returns an operator config for the run.
func (r *Run) Config(name, stateDir string) pipeline.Config {
	return pipeline.Config{
		Brokers: []string{r.Addr}, GroupID: r.Contract.RunID + "." + name,
		QuarantineTopic: r.Topics.Quarantine, MaxMessageBytes: r.Contract.Topics.MaxMessageBytes,
		StateDir: stateDir, Logger: testLogger(),
		CommitInterval: 50 * time.Millisecond, Instance: name,
	}
}

// Audit reads the run's accounting.
func (r *Run) Audit(ctx context.Context) (*audit.Report, error) {
	cfg := r.Config("audit", "")
	return audit.Collect(ctx, &cfg, r.Topics)
}

// WaitAccounted polls the accounting until every launched id is admitted,
// filtered or quarantined, or the timeout passes; it returns the last
// counts.
func (r *Run) WaitAccounted(t testing.TB, launched []string, timeout time.Duration) audit.Counts {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var c audit.Counts
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		rep, err := r.Audit(ctx)
		cancel()
		if err != nil {
			t.Fatalf("audit: %v", err)
		}
		c = rep.Account(launched)
		if c.Lost == 0 || time.Now().After(deadline) {
			return c
		}
		time.Sleep(300 * time.Millisecond)
	}
}

// StartOperator runs the stage in a goroutine until the returned stop
// function is called; stop returns Run's error (nil after a graceful stop).
func (r *Run) StartOperator(t testing.TB, name, stateDir string) (stop func() error) {
	t.Helper()
	partial := r.PartialGroupTimeout
	switch {
	case partial == 0:
		partial = 5 * time.Second
	case partial < 0:
		partial = 0 // off
	}
	op, err := operators.NewOperator(name, operators.Deps{Contract: r.Contract, Topics: r.Topics, VocabSize: 32000, WindowMaxWait: time.Second, PartialGroupTimeout: partial}, r.Config(name, stateDir))
	if err != nil {
		t.Fatalf("operator %s: %v", name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- op.Run(ctx) }()
	var stopped bool
	var result error
	stop = func() error {
		if stopped {
			return result
		}
		stopped = true
		cancel()
		err := <-done
		if err == pipeline.ErrStopped {
			err = nil
		}
		result = err
		return err
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("operator %s: %v", name, err)
		}
	})
	return stop
}

// Describe formats counts for test logs.
func Describe(c audit.Counts) string { return fmt.Sprint(c) }

// testLogger discards logs unless TRAJFLOW_TEST_LOG is set.
func testLogger() *slog.Logger {
	if os.Getenv("TRAJFLOW_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// ProduceRaw writes each value to topic as is, keyed by its map key.
func (r *Run) ProduceRaw(t testing.TB, topic string, values map[string][]byte) {
	t.Helper()
	tr := &kafkago.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{Addr: kafkago.TCP(r.Addr), Topic: topic, Balancer: &kafkago.Murmur2Balancer{},
		RequiredAcks: kafkago.RequireAll, BatchTimeout: 2 * time.Millisecond, Transport: tr}
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for k, v := range values {
		if err := w.WriteMessages(ctx, kafkago.Message{Key: []byte(k), Value: v}); err != nil {
			t.Fatalf("produce %s: %v", k, err)
		}
	}
}

// ReadAll reads every record of topic.
func (r *Run) ReadAll(t testing.TB, topic string) []pipeline.Message {
	t.Helper()
	cfg := r.Config("read", "")
	var out []pipeline.Message
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := pipeline.ScanTail(ctx, &cfg, topic, 0, func(m pipeline.Message) error { out = append(out, m); return nil }); err != nil {
		t.Fatalf("read %s: %v", topic, err)
	}
	return out
}
