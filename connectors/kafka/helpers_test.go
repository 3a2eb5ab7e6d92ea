package kafka

import (
	"context"
	"log/slog"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
)

// testCtx bounds a test's network work.
func testCtx(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// testLogger sends broker logs at warn and above to the test log.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }

func startTestBroker(t *testing.T, cfg BrokerConfig) *Broker {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	b, err := StartBroker(testCtx(t, 10*time.Second), cfg)
	if err != nil {
		t.Fatalf("StartBroker: %v", err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

func createTopics(t *testing.T, addr string, specs ...TopicSpec) {
	t.Helper()
	if err := CreateTopics(testCtx(t, 10*time.Second), ClientConfig{}, []string{addr}, specs); err != nil {
		t.Fatalf("CreateTopics: %v", err)
	}
}

// newWriter is a synchronous acks=all writer, as the runtime uses.
func newWriter(t *testing.T, cc ClientConfig, topic string, maxMessageBytes int) *kafkago.Writer {
	t.Helper()
	tr, err := cc.Transport()
	if err != nil {
		t.Fatalf("Transport: %v", err)
	}
	w := &kafkago.Writer{
		Addr:         kafkago.TCP(cc.Brokers...),
		Topic:        topic,
		Balancer:     &kafkago.Hash{},
		RequiredAcks: kafkago.RequireAll,
		BatchTimeout: 5 * time.Millisecond,
		BatchBytes:   WriterBatchBytes(maxMessageBytes),
		MaxAttempts:  3,
		Transport:    tr,
	}
	t.Cleanup(func() { _ = w.Close(); tr.CloseIdleConnections() })
	return w
}

// committed reads a group's committed offsets for partitions 0..n-1.
func committed(t *testing.T, ctx context.Context, addr, group, topic string, n int) map[int]int64 {
	t.Helper()
	cl, done := freshClient(addr)
	defer done()
	parts := make([]int, n)
	for i := range parts {
		parts[i] = i
	}
	resp, err := cl.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: parts}})
	if err != nil {
		t.Fatalf("OffsetFetch: %v", err)
	}
	if resp.Error != nil {
		t.Fatalf("OffsetFetch: %v", resp.Error)
	}
	out := map[int]int64{}
	for _, p := range resp.Topics[topic] {
		if p.Error != nil {
			t.Fatalf("OffsetFetch %s/%d: %v", topic, p.Partition, p.Error)
		}
		out[p.Partition] = p.CommittedOffset
	}
	return out
}

// offsets returns first and last (high watermark) offsets of partition p.
func offsets(t *testing.T, ctx context.Context, addr, topic string, p int) (first, last int64) {
	t.Helper()
	cl, done := freshClient(addr)
	defer done()
	resp, err := cl.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{
		topic: {kafkago.FirstOffsetOf(p), kafkago.LastOffsetOf(p)},
	}})
	if err != nil {
		t.Fatalf("ListOffsets: %v", err)
	}
	for _, po := range resp.Topics[topic] {
		if po.Partition == p {
			if po.Error != nil {
				t.Fatalf("ListOffsets %s/%d: %v", topic, p, po.Error)
			}
			return po.FirstOffset, po.LastOffset
		}
	}
	t.Fatalf("ListOffsets: no answer for %s/%d", topic, p)
	return 0, 0
}

// freshClient is a client with its own transport: kafka-go's DefaultTransport
// pools connections, and the first request on a pooled connection to a
// restarted broker fails with io.ErrUnexpectedEOF.
func freshClient(addr string) (*kafkago.Client, func()) {
	tr := &kafkago.Transport{}
	return &kafkago.Client{Addr: kafkago.TCP(addr), Transport: tr}, tr.CloseIdleConnections
}
