package pipeline

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"
)

// ScanTail calls fn for the last `last` records of every partition of topic
// (all records when last <= 0), partition by partition in offset order. It
// reads without a consumer group and commits nothing: stages use it to
// rebuild state from their own output topic (for example the set of ids
// already admitted) when their local state is lost.
func ScanTail(ctx context.Context, cfg *Config, topic string, last int64, fn func(Message) error) error {
	dialer := cfg.dialer()
	conn, err := dialer.DialContext(ctx, "tcp", cfg.Brokers[0])
	if err != nil {
		return fmt.Errorf("pipeline: scan %s: dial: %w", topic, err)
	}
	parts, err := conn.ReadPartitions(topic)
	conn.Close()
	if err != nil {
		return fmt.Errorf("pipeline: scan %s: partitions: %w", topic, err)
	}
	for _, p := range parts {
		if err := scanPartition(ctx, cfg, dialer, topic, p.ID, last, fn); err != nil {
			return err
		}
	}
	return nil
}

func scanPartition(ctx context.Context, cfg *Config, dialer *kafka.Dialer, topic string, partition int, last int64, fn func(Message) error) error {
	var leader *kafka.Conn
	var err error
	for _, b := range cfg.Brokers {
		if leader, err = dialer.DialLeader(ctx, "tcp", b, topic, partition); err == nil {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("pipeline: scan %s/%d: dial leader: %w", topic, partition, err)
	}
	first, end, err := leader.ReadOffsets()
	leader.Close()
	if err != nil {
		return fmt.Errorf("pipeline: scan %s/%d: offsets: %w", topic, partition, err)
	}
	start := first
	if last > 0 && end-last > start {
		start = end - last
	}
	if start >= end {
		return nil
	}
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: cfg.Brokers, Topic: topic, Partition: partition, Dialer: cfg.Dialer,
		MinBytes: 1, MaxBytes: maxInt(cfg.MaxMessageBytes, 1<<20) + (1 << 20), MaxWait: scanMaxWait,
	})
	defer r.Close()
	if err := r.SetOffset(start); err != nil {
		return fmt.Errorf("pipeline: scan %s/%d: seek %d: %w", topic, partition, start, err)
	}
	for {
		km, err := r.FetchMessage(ctx)
		if err != nil {
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				return fmt.Errorf("pipeline: scan %s/%d: %w", topic, partition, err)
			}
			return fmt.Errorf("pipeline: scan %s/%d at %d: %w", topic, partition, start, err)
		}
		m := Message{Ref: Ref{km.Topic, km.Partition, km.Offset}, Key: km.Key, Value: km.Value, HighWaterMark: km.HighWaterMark, Time: km.Time}
		for _, h := range km.Headers {
			m.Headers = append(m.Headers, Header{h.Key, h.Value})
		}
		if err := fn(m); err != nil {
			return err
		}
		if km.Offset+1 >= end {
			return nil
		}
	}
}

// scanMaxWait is the MaxWait of a scan's reader. A scan stops at the end
// offset it read first, so no fetch of it waits for new records but the
// reader's read-ahead after the last one, which Close waits for; unlike a
// long-running consumer (tfkafka.FetchMaxWait) it keeps that wait short.
const scanMaxWait = 100 * time.Millisecond

func maxInt(a, b int) int {
	if a > b {
		return a
	}
	return b
}
