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
	byTopic map[string]*kafka.Writer // compressed topics
}

// newProducers builds the writers of codecs with build.
func newProducers(codecs map[string]kafka.Compression, build func(kafka.Compression) *kafka.Writer) producers {
	p := producers{writers: []*kafka.Writer{build(0)}, byTopic: map[string]*kafka.Writer{}}
	of := map[kafka.Compression]*kafka.Writer{0: p.writers[0]}
	for topic, c := range codecs {
		w, ok := of[c]
		if !ok {
			w = build(c)
			of[c] = w
			p.writers = append(p.writers, w)
		}
		p.byTopic[topic] = w
	}
	return p
}

// of is the writer of topic.
func (p producers) of(topic string) *kafka.Writer {
	if w, ok := p.byTopic[topic]; ok {
		return w
	}
	return p.writers[0]
}

// write hands msgs to their writers (async: it returns once they are
// queued). On an error it returns the records no writer took.
func (p producers) write(ctx context.Context, msgs []kafka.Message) ([]kafka.Message, error) {
	first := p.of(msgs[0].Topic)
	same := true
	for i := range msgs[1:] {
		if p.of(msgs[i+1].Topic) != first {
			same = false
			break
		}
	}
	if same {
		if err := first.WriteMessages(ctx, msgs...); err != nil {
			return msgs, err
		}
		return nil, nil
	}
	// Split by writer, each part in the order of msgs.
	var unsent []kafka.Message
	var errs []error
	for _, w := range p.writers {
		var part []kafka.Message
		for _, m := range msgs {
			if p.of(m.Topic) == w {
				part = append(part, m)
			}
		}
		if len(part) == 0 {
			continue
		}
		if len(errs) > 0 {
			unsent = append(unsent, part...)
			continue
		}
		if err := w.WriteMessages(ctx, part...); err != nil {
			unsent = append(unsent, part...)
			errs = append(errs, err)
		}
	}
	return unsent, errors.Join(errs...)
}

// close flushes every writer and waits for their Completion calls.
func (p producers) close() error {
	var errs []error
	for _, w := range p.writers {
		errs = append(errs, w.Close())
	}
	return errors.Join(errs...)
}
