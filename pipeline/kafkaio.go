package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"

	tfkafka "github.com/trajflow/trajflow/connectors/kafka"
)

// This file holds everything the runtime says to Kafka besides the consumer
// group and the producer: dialing any bootstrap address, waiting for
// topics, tail scans and side-input readers, and the classification of
// broker errors into transient (retried in place) and fatal.

// dialAny connects to the first bootstrap address that answers, trying
// every one of them in order (tfkafka.DialFirst): a broker that is down or
// hung never makes the others unusable, and the error names each address
// and why it failed.
func dialAny(ctx context.Context, d *kafka.Dialer, brokers []string) (*kafka.Conn, error) {
	c, _, err := tfkafka.DialFirst(ctx, d, brokers)
	if err != nil {
		return nil, fmt.Errorf("pipeline: %w", err)
	}
	return c, nil
}

// transient reports whether err is a broker or network failure that heals
// by itself (a leader or coordinator moving, a broker restarting, a
// connection reset): the runtime retries it in place, keeping the stage's
// state and its group membership, instead of stopping the operator.
// A refused credential or certificate (connectors/kafka.Refused) and a
// server that answers in another protocol (connectors/kafka.ErrNotKafka)
// are not transient: waiting does not change those answers, so the
// operator stops and says why.
// Every caller checks its own context first, so a context error here is
// kafka-go's own: a deadline, or the cancelled dial that a partition
// reader of an ended generation hands to the next fetch (its send races
// its context's end in one select).
func transient(err error) bool {
	if err == nil || tfkafka.Refused(err) || errors.Is(err, tfkafka.ErrNotKafka) {
		return false
	}
	var ke kafka.Error
	if errors.As(err, &ke) {
		switch ke {
		case kafka.TopicAuthorizationFailed, kafka.GroupAuthorizationFailed, kafka.ClusterAuthorizationFailed,
			kafka.SASLAuthenticationFailed, kafka.UnsupportedSASLMechanism, kafka.IllegalSASLState,
			kafka.MessageSizeTooLarge, kafka.RecordListTooLarge, kafka.InvalidTopic, kafka.InvalidRequiredAcks,
			kafka.UnsupportedVersion, kafka.InvalidConfiguration, kafka.UnsupportedForMessageFormat,
			kafka.InvalidRecord:
			return false
		}
		return true
	}
	var ne net.Error
	if errors.As(err, &ne) {
		return true
	}
	for _, e := range []error{io.EOF, io.ErrUnexpectedEOF, io.ErrClosedPipe, syscall.ECONNREFUSED,
		syscall.ECONNRESET, syscall.EPIPE, syscall.ECONNABORTED, syscall.EHOSTUNREACH, syscall.ENETUNREACH,
		context.DeadlineExceeded, context.Canceled} {
		if errors.Is(err, e) {
			return true
		}
	}
	// kafka-go reports some broker conditions only in text (group load in
	// progress before a coordinator answers, a metadata refresh racing a
	// leader change).
	msg := err.Error()
	for _, s := range []string{"connection refused", "connection reset", "broken pipe", "no broker reachable",
		"no broker answered", "i/o timeout", "unexpected EOF", "Group Load In Progress", "Not Coordinator", "Leader Not Available",
		"Not Leader", "Coordinator Not Available", "Rebalance In Progress"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// groupReader is what an operator needs of its consumer-group reader
// (kafka-go's *kafka.Reader).
type groupReader interface {
	FetchMessage(ctx context.Context) (kafka.Message, error)
	CommitMessages(ctx context.Context, msgs ...kafka.Message) error
	Close() error
}

// fetchRetryPause is the pause after a transient fetch failure: kafka-go's
// reader paces its own retries, so the runtime only yields (see fetchLoop).
const fetchRetryPause = 10 * time.Millisecond

// produceRetry is the writer's transport: it passes every request on and
// marks the failures that heal by themselves as temporary, so that
// kafka-go's writer retries the batch in place and in order (its attempt
// loop retries only errors it knows as temporary). kafka-go fails a write
// at once when its cached metadata names no leader for the partition (a
// leader just moved, an election in progress: "topic partition has no
// leader"), which would otherwise stop the operator; the cache is refreshed
// every tfkafka.MetadataTTL, and a retry then finds the new leader.
type produceRetry struct{ next kafka.RoundTripper }

// RoundTrip implements kafka.RoundTripper.
func (p produceRetry) RoundTrip(ctx context.Context, addr net.Addr, req kafka.Request) (kafka.Response, error) {
	resp, err := p.next.RoundTrip(ctx, addr, req)
	if err != nil && ctx.Err() == nil && produceTransient(err) {
		return resp, temporaryError{err}
	}
	return resp, err
}

// produceTransient reports whether a failed produce request may succeed
// when retried: the broker and network failures of transient, and the
// client-side routing failures of a partition whose leader is unknown for
// the moment.
func produceTransient(err error) bool {
	for _, e := range []error{protocol.ErrNoLeader, protocol.ErrNoPartition, protocol.ErrNoTopic} {
		if errors.Is(err, e) {
			return true
		}
	}
	return transient(err)
}

// temporaryError marks an error as one that kafka-go may retry.
type temporaryError struct{ err error }

func (e temporaryError) Error() string   { return e.err.Error() }
func (e temporaryError) Unwrap() error   { return e.err }
func (e temporaryError) Temporary() bool { return true }

// backoffRetry is the runtime's retry policy for transient broker errors:
// 100 ms doubling to 2 s.
var backoffRetry = Backoff{Initial: 100 * time.Millisecond, Max: 2 * time.Second}

// sleepCtx waits d or until ctx ends (false).
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// logLimiter lets a repeated warning through once per interval, counting
// what it held back.
type logLimiter struct {
	mu       sync.Mutex
	every    time.Duration
	last     time.Time
	withheld int
}

// allow reports whether to log now, and how many calls were held back
// since the last one logged.
func (l *logLimiter) allow(now time.Time) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.last.IsZero() && now.Sub(l.last) < l.every {
		l.withheld++
		return false, 0
	}
	n := l.withheld
	l.last, l.withheld = now, 0
	return true, n
}

// waitTopics returns once every topic exists, polling the metadata of any
// reachable broker without creating anything. A consumer group member that
// joins while its topic is missing keeps the empty assignment after the
// topic is created (kafka-go computes it once per generation), so an
// operator started before `trajflow topics create` would never consume; it
// waits here instead. Brokers that cannot be reached are waited for too
// (logged, naming each address and why), so a fleet may start before its
// cluster.
func waitTopics(ctx context.Context, cfg *Config, topics []string, log *slog.Logger) error {
	dialer := cfg.dialer()
	lim := logLimiter{every: 10 * time.Second}
	for attempt := 0; ; attempt++ {
		missing, err := missingTopics(ctx, dialer, cfg.Brokers, topics)
		switch {
		case err == nil && len(missing) == 0:
			return nil
		case ctx.Err() != nil:
			return ErrStopped
		case err != nil && !transient(err):
			return fmt.Errorf("pipeline: input topics: %w", err)
		}
		if ok, _ := lim.allow(time.Now()); ok {
			if err != nil {
				log.Warn("brokers unreachable; retrying", "brokers", strings.Join(cfg.Brokers, ","), "err", err)
			} else {
				log.Warn("waiting for topics to be created (trajflow topics create)", "missing", missing)
			}
		}
		d := 500 * time.Millisecond
		if err != nil {
			d = backoffRetry.Delay(attempt + 1)
		}
		if !sleepCtx(ctx, d) {
			return ErrStopped
		}
	}
}

// missingTopics lists the topics the cluster does not have.
func missingTopics(ctx context.Context, dialer *kafka.Dialer, brokers []string, topics []string) ([]string, error) {
	conn, err := dialAny(ctx, dialer, brokers)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	var missing []string
	for _, t := range topics {
		parts, err := conn.ReadPartitions(t)
		switch {
		case errors.Is(err, kafka.UnknownTopicOrPartition), err == nil && len(parts) == 0:
			missing = append(missing, t)
		case err != nil:
			return nil, fmt.Errorf("partitions of %s from %s: %w", t, conn.RemoteAddr(), err)
		}
	}
	return missing, nil
}

// kafkaScanner implements Scanner over the cluster of cfg.
type kafkaScanner struct{ cfg *Config }

// KafkaScanner is a Scanner over the cluster cfg names (its brokers,
// dialer and message size).
func KafkaScanner(cfg *Config) Scanner { return kafkaScanner{cfg} }

// ScanTail implements Scanner.
func (s kafkaScanner) ScanTail(ctx context.Context, topic string, last int64, fn func(Message) error) error {
	return ScanTail(ctx, s.cfg, topic, last, fn)
}

// ScanTail calls fn for the last `last` records of every partition of topic
// (all records when last <= 0), partition by partition in offset order. It
// reads without a consumer group and commits nothing: stages use it (through
// Env.Scan) to rebuild state from their own output topic when their local
// state is lost. Transient broker errors are retried from the next unread
// offset, so fn sees every record of the range exactly once.
func ScanTail(ctx context.Context, cfg *Config, topic string, last int64, fn func(Message) error) error {
	dialer := cfg.dialer()
	var parts []kafka.Partition
	for attempt := 0; ; attempt++ {
		conn, err := dialAny(ctx, dialer, cfg.Brokers)
		if err == nil {
			parts, err = conn.ReadPartitions(topic)
			conn.Close()
		}
		if err == nil {
			break
		}
		if ctx.Err() != nil || !transient(err) || attempt >= 20 {
			return fmt.Errorf("pipeline: scan %s: partitions: %w", topic, err)
		}
		if !sleepCtx(ctx, backoffRetry.Delay(attempt+1)) {
			return fmt.Errorf("pipeline: scan %s: %w", topic, ctx.Err())
		}
	}
	for _, p := range parts {
		if err := scanPartition(ctx, cfg, dialer, topic, p.ID, last, fn); err != nil {
			return err
		}
	}
	return nil
}

// partitionOffsets returns the first and end offsets of a partition from its
// leader (any bootstrap address may be used to find it).
func partitionOffsets(ctx context.Context, cfg *Config, dialer *kafka.Dialer, topic string, partition int) (first, end int64, err error) {
	var errs []error
	for _, b := range cfg.Brokers {
		leader, derr := dialer.DialLeader(ctx, "tcp", b, topic, partition)
		if derr != nil {
			errs = append(errs, fmt.Errorf("%s: %w", b, derr))
			continue
		}
		first, end, err = leader.ReadOffsets()
		leader.Close()
		if err == nil {
			return first, end, nil
		}
		errs = append(errs, fmt.Errorf("%s: offsets: %w", b, err))
	}
	return 0, 0, fmt.Errorf("leader of %s/%d: %w", topic, partition, errors.Join(errs...))
}

// EndOffset returns the end offset (high-water mark) of a partition, from
// its leader, found through any bootstrap address of cfg.
func EndOffset(ctx context.Context, cfg *Config, topic string, partition int) (int64, error) {
	_, end, err := partitionOffsets(ctx, cfg, cfg.dialer(), topic, partition)
	if err != nil {
		return 0, fmt.Errorf("pipeline: %w", err)
	}
	return end, nil
}

func scanPartition(ctx context.Context, cfg *Config, dialer *kafka.Dialer, topic string, partition int, last int64, fn func(Message) error) error {
	var first, end int64
	var err error
	for attempt := 0; ; attempt++ {
		if first, end, err = partitionOffsets(ctx, cfg, dialer, topic, partition); err == nil {
			break
		}
		if ctx.Err() != nil || !transient(err) || attempt >= 20 {
			return fmt.Errorf("pipeline: scan %s/%d: %w", topic, partition, err)
		}
		if !sleepCtx(ctx, backoffRetry.Delay(attempt+1)) {
			return fmt.Errorf("pipeline: scan %s/%d: %w", topic, partition, ctx.Err())
		}
	}
	next := first
	if last > 0 && end-last > next {
		next = end - last
	}
	for failures := 0; next < end; {
		n, err := scanRange(ctx, cfg, topic, partition, next, end, fn)
		next += n
		switch {
		case err == nil:
			return nil
		case errors.Is(err, errFn):
			return errors.Unwrap(err)
		case ctx.Err() != nil:
			return fmt.Errorf("pipeline: scan %s/%d: %w", topic, partition, ctx.Err())
		case !transient(err) || failures >= 20:
			return fmt.Errorf("pipeline: scan %s/%d at %d: %w", topic, partition, next, err)
		}
		if n > 0 {
			failures = 0
		}
		failures++
		if !sleepCtx(ctx, backoffRetry.Delay(failures)) {
			return fmt.Errorf("pipeline: scan %s/%d: %w", topic, partition, ctx.Err())
		}
	}
	return nil
}

// errFn wraps an error returned by a scan's callback (never retried).
var errFn = errors.New("scan callback")

// scanRange reads [from, end) and returns how far it got: the offset after
// the last record fn took, minus from.
func scanRange(ctx context.Context, cfg *Config, topic string, partition int, from, end int64, fn func(Message) error) (int64, error) {
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: cfg.Brokers, Topic: topic, Partition: partition, Dialer: cfg.dialer(),
		MinBytes: 1, MaxBytes: max(cfg.MaxMessageBytes, 1<<20) + (1 << 20), MaxWait: scanMaxWait,
		MaxAttempts: 3,
	})
	defer r.Close()
	if err := r.SetOffset(from); err != nil {
		return 0, fmt.Errorf("seek %d: %w", from, err)
	}
	var n int64
	for {
		km, err := r.FetchMessage(ctx)
		if err != nil {
			return n, err
		}
		if km.Offset < from+n {
			continue // re-read after a reconnect
		}
		if err := fn(fromKafka(&km)); err != nil {
			return n, fmt.Errorf("%w: %w", errFn, err)
		}
		n = km.Offset + 1 - from
		if km.Offset+1 >= end {
			return n, nil
		}
	}
}

// fromKafka converts a kafka-go message.
func fromKafka(km *kafka.Message) Message {
	m := Message{
		Ref:           Ref{km.Topic, km.Partition, km.Offset},
		Key:           km.Key,
		Value:         km.Value,
		HighWaterMark: km.HighWaterMark,
		Time:          km.Time,
	}
	if len(km.Headers) > 0 {
		m.Headers = make([]Header, len(km.Headers))
		for i, h := range km.Headers {
			m.Headers[i] = Header{h.Key, h.Value}
		}
	}
	return m
}

// scanMaxWait is the MaxWait of a scan's reader. A scan stops at the end
// offset it read first, so no fetch of it waits for new records but the
// reader's read-ahead after the last one, which Close waits for; unlike a
// long-running consumer (tfkafka.FetchMaxWait) it keeps that wait short.
const scanMaxWait = 100 * time.Millisecond

// followSide tails every partition of topic from its first offset until
// ctx ends, calling fn for each record in offset order. Broker failures are
// retried from the next unread offset (fn never sees a record twice); only
// fn's error ends it early.
func followSide(ctx context.Context, cfg *Config, topic string, log *slog.Logger, fn func(Message) error) error {
	dialer := cfg.dialer()
	var parts []kafka.Partition
	for attempt := 0; ; attempt++ {
		conn, err := dialAny(ctx, dialer, cfg.Brokers)
		if err == nil {
			parts, err = conn.ReadPartitions(topic)
			conn.Close()
		}
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return nil
		}
		log.Warn("side input: partitions; retrying", "topic", topic, "err", err)
		if !sleepCtx(ctx, backoffRetry.Delay(attempt+1)) {
			return nil
		}
	}
	var wg sync.WaitGroup
	errc := make(chan error, len(parts))
	for _, p := range parts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := followPartition(ctx, cfg, topic, p.ID, log, fn); err != nil {
				errc <- err
			}
		}()
	}
	wg.Wait()
	close(errc)
	return <-errc
}

func followPartition(ctx context.Context, cfg *Config, topic string, partition int, log *slog.Logger, fn func(Message) error) error {
	next := kafka.FirstOffset
	for failures := 0; ctx.Err() == nil; {
		r := kafka.NewReader(kafka.ReaderConfig{
			Brokers: cfg.Brokers, Topic: topic, Partition: partition, Dialer: cfg.dialer(),
			MinBytes: 1, MaxBytes: max(cfg.MaxMessageBytes, 1<<20) + (1 << 20), MaxWait: tfkafka.FetchMaxWait,
		})
		err := r.SetOffset(next)
		for err == nil {
			var km kafka.Message
			if km, err = r.FetchMessage(ctx); err != nil {
				break
			}
			failures = 0
			next = km.Offset + 1
			if ferr := fn(fromKafka(&km)); ferr != nil {
				r.Close()
				return ferr
			}
		}
		r.Close()
		if ctx.Err() != nil {
			return nil
		}
		failures++
		log.Warn("side input reader restarting", "topic", topic, "partition", partition, "err", err)
		if !sleepCtx(ctx, backoffRetry.Delay(failures)) {
			return nil
		}
	}
	return nil
}
