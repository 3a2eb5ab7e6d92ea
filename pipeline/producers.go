package pipeline

import (
	"context"
	"errors"
	"time"

	"github.com/segmentio/kafka-go"

	tfkafka "github.com/trajflow/trajflow/connectors/kafka"
)

// newWriter is the operator's async writer of one compression codec.
func (o *Operator) newWriter(codec kafka.Compression, transport kafka.RoundTripper) *kafka.Writer {
	const writeBackoffMax = time.Second
	return &kafka.Writer{
		Addr:            kafka.TCP(o.cfg.Brokers...),
		Balancer:        pinnedBalancer{},
		RequiredAcks:    kafka.RequireAll,
		Async:           true,
		BatchSize:       256,
		BatchBytes:      tfkafka.WriterBatchBytes(o.cfg.MaxMessageBytes),
		BatchTimeout:    o.cfg.BatchTimeout,
		Compression:     codec,
		WriteBackoffMin: 100 * time.Millisecond,
		WriteBackoffMax: writeBackoffMax,
		WriteTimeout:    tfkafka.ProduceTimeout,
		ReadTimeout:     tfkafka.ProduceTimeout,
		// kafka-go retries a failed batch in place, in order, while the
		// error is temporary: enough attempts to ride through a leader
		// election (about the broker session timeout) and a broker restart.
		MaxAttempts: max(10, int(o.cfg.ProduceRetryWindow/writeBackoffMax)+4),
		Completion:  o.completion,
		Transport:   transport,
	}
}

// producers are an operator's writers: one per compression codec its
// topics use (Config.Compression), the uncompressed one first. A topic's
// records all go through one writer, which keeps their order; records of
// different topics have no order to keep.
type producers struct {
	writers []*kafka.Writer
	byTopic map[string]int // compressed topics: index in writers
}

// newProducers builds the writers of codecs with build.
func newProducers(codecs map[string]kafka.Compression, build func(kafka.Compression) *kafka.Writer) producers {
	p := producers{writers: []*kafka.Writer{build(0)}, byTopic: map[string]int{}}
	of := map[kafka.Compression]int{0: 0}
	for topic, c := range codecs {
		i, ok := of[c]
		if !ok {
			i = len(p.writers)
			of[c] = i
			p.writers = append(p.writers, build(c))
		}
		p.byTopic[topic] = i
	}
	return p
}

// of is the writer of topic.
func (p producers) of(topic string) *kafka.Writer { return p.writers[p.byTopic[topic]] }

// write hands msgs to their writers (async: it returns once they are
// queued). On an error it returns the records no writer took.
func (p producers) write(ctx context.Context, msgs []kafka.Message) ([]kafka.Message, error) {
	if len(p.writers) == 1 { // nothing compressed
		if err := p.writers[0].WriteMessages(ctx, msgs...); err != nil {
			return msgs, err
		}
		return nil, nil
	}
	// Split by writer, each part in the order of msgs.
	parts := make([][]kafka.Message, len(p.writers))
	for _, m := range msgs {
		i := p.byTopic[m.Topic]
		parts[i] = append(parts[i], m)
	}
	var unsent []kafka.Message
	var err error
	for i, part := range parts {
		if len(part) == 0 {
			continue
		}
		if err == nil {
			err = p.writers[i].WriteMessages(ctx, part...)
		}
		if err != nil {
			unsent = append(unsent, part...)
		}
	}
	return unsent, err
}

// close flushes every writer and waits for their Completion calls.
func (p producers) close() error {
	var errs []error
	for _, w := range p.writers {
		errs = append(errs, w.Close())
	}
	return errors.Join(errs...)
}
