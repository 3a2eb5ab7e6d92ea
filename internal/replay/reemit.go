package replay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
)

// Reemit produces every message of the snapshot in runDir into its topic,
// partition and order, with its key and headers (for re-running any stage
// from a snapshot), creating the run's topics on the cluster of cc first.
// It returns the number of messages produced.
func Reemit(ctx context.Context, runDir, contractPath string, cc kafka.ClientConfig) (int, error) {
	snap, err := parquet.ReadRun(ctx, runDir, nil, parquet.ReadOptions{})
	if err != nil {
		return 0, err
	}
	c, err := loadContract(runDir, contractPath, snap.Info)
	if err != nil {
		return 0, err
	}
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return 0, err
	}
	if err := kafka.CreateTopics(ctx, cc, cc.Brokers, operators.TopicSpecs(c, topics)); err != nil {
		return 0, err
	}
	transport, err := cc.Transport()
	if err != nil {
		return 0, err
	}
	// Closed at the end: a kafka-go transport's connection pools outlive
	// its writers and keep dialing the brokers' addresses until closed.
	defer transport.CloseIdleConnections()
	if err := refuseUsed(ctx, cc, transport, snap); err != nil {
		return 0, err
	}
	codecs, err := kafka.TopicCompression(c.Topics.Compression, topics.Name)
	if err != nil {
		return 0, err
	}
	// One writer per compression codec, as the operators produce.
	writers := map[kafkago.Compression]*kafkago.Writer{}
	writerOf := func(topic string) *kafkago.Writer {
		codec := codecs[topic]
		if w, ok := writers[codec]; ok {
			return w
		}
		w := &kafkago.Writer{
			Addr: kafkago.TCP(cc.Brokers...), RequiredAcks: kafkago.RequireAll, BatchTimeout: 5 * time.Millisecond,
			BatchBytes: kafka.WriterBatchBytes(c.Topics.MaxMessageBytes), Compression: codec,
			Balancer: kafkago.BalancerFunc(func(m kafkago.Message, parts ...int) int {
				if p, ok := m.WriterData.(int); ok && slices.Contains(parts, p) {
					return p
				}
				return parts[0]
			}),
			Transport: transport,
		}
		writers[codec] = w
		return w
	}
	defer func() {
		for _, w := range writers {
			w.Close()
		}
	}()
	shorts := make([]string, 0, len(snap.Topics))
	for s := range snap.Topics {
		shorts = append(shorts, s)
	}
	slices.Sort(shorts)
	n := 0
	for _, s := range shorts {
		k, err := produce(ctx, writerOf(snap.FullTopics[s]), snap.FullTopics[s], snap.Topics[s])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// ErrTopicUsed marks a re-emit into a topic that already holds records.
var ErrTopicUsed = errors.New("replay: topic already holds records")

// refuseUsed refuses a re-emit into topics that already hold records (a
// second re-emit, or the live run itself): each message would be there
// twice, and every stage downstream would see it twice.
func refuseUsed(ctx context.Context, cc kafka.ClientConfig, transport *kafkago.Transport, snap *parquet.Run) error {
	dialer, err := cc.Dialer()
	if err != nil {
		return err
	}
	cfg := &pipeline.Config{Brokers: cc.Brokers, Dialer: dialer, Transport: transport}
	var used []string
	for short, full := range snap.FullTopics {
		if len(snap.Topics[short]) == 0 {
			continue
		}
		n := 0
		err := pipeline.ScanTail(ctx, cfg, full, 1, func(pipeline.Message) error {
			n++
			return nil
		})
		if err != nil {
			return fmt.Errorf("re-emit: read %s: %w", full, err)
		}
		if n > 0 {
			used = append(used, full)
		}
	}
	if len(used) > 0 {
		slices.Sort(used)
		return fmt.Errorf("%w: %s on %s already hold records of run %s; re-emitting would write every message twice: "+
			"re-emit into an empty cluster, or delete those topics first", ErrTopicUsed, strings.Join(used, ", "),
			strings.Join(cc.Brokers, ","), snap.Info.Run)
	}
	return nil
}

// produce writes msgs to topic, each to its recorded partition, 256 at a
// time.
func produce(ctx context.Context, w *kafkago.Writer, topic string, msgs []parquet.Message) (int, error) {
	n := 0
	for len(msgs) > 0 {
		k := min(len(msgs), 256)
		batch := make([]kafkago.Message, k)
		for i, m := range msgs[:k] {
			batch[i] = kafkago.Message{Topic: topic, Key: m.Key, Value: m.Value, Time: m.Time, WriterData: m.Partition}
			for _, h := range m.Headers {
				batch[i].Headers = append(batch[i].Headers, kafkago.Header{Key: h.Key, Value: h.Value})
			}
		}
		if err := w.WriteMessages(ctx, batch...); err != nil {
			return n, fmt.Errorf("re-emit %s: %w", topic, err)
		}
		n += k
		msgs = msgs[k:]
	}
	return n, nil
}
