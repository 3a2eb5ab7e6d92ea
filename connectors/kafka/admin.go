package kafka

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	kafkago "github.com/segmentio/kafka-go"
)

// ErrTopicMismatch is wrapped by the error CreateTopics returns when a topic
// already exists with settings incompatible with its TopicSpec.
var ErrTopicMismatch = errors.New("kafka: existing topic does not match its spec")

// TopicSpec declares a topic. Zero fields take documented defaults, so a spec
// read back by ListTopics (which fills every field with the actual value)
// and a declared spec can be compared with Compatible.
type TopicSpec struct {
	Name string
	// Partitions is the partition count; 0 means 1.
	Partitions int
	// ReplicationFactor is the replica count; 0 means the broker default
	// (default.replication.factor; 1 on the embedded broker).
	ReplicationFactor int
	// MinInsyncReplicas is the topic's min.insync.replicas: the replicas
	// that must hold a record before an acks=all write succeeds. 0 leaves
	// the broker default (min.insync.replicas, 1 unless configured);
	// otherwise it must not exceed a set ReplicationFactor.
	MinInsyncReplicas int
	// RetentionMs is the topic's retention.ms; 0 leaves the broker
	// default, -1 keeps records forever.
	RetentionMs int64
	// MaxMessageBytes is the topic's max.message.bytes, the largest
	// record batch a produce may carry; 0 means DefaultMaxMessageBytes.
	MaxMessageBytes int
	// Compacted selects cleanup.policy=compact (policy releases). A
	// compacted topic without RetentionMs is created with retention.ms and
	// retention.bytes of -1 so that no time or size deletion ever removes
	// the latest value of a key; with RetentionMs the policy is
	// "compact,delete".
	Compacted bool
}

// normalized applies the defaults and validates the spec.
func (s TopicSpec) normalized() (TopicSpec, error) {
	if err := validateTopicName(s.Name); err != nil {
		return s, err
	}
	switch {
	case s.Partitions < 0:
		return s, fmt.Errorf("topic %q: negative partitions %d", s.Name, s.Partitions)
	case s.Partitions == 0:
		s.Partitions = 1
	}
	if s.ReplicationFactor < 0 || s.ReplicationFactor > 32767 {
		return s, fmt.Errorf("topic %q: bad replication factor %d", s.Name, s.ReplicationFactor)
	}
	switch {
	case s.MinInsyncReplicas < 0:
		return s, fmt.Errorf("topic %q: negative min.insync.replicas %d", s.Name, s.MinInsyncReplicas)
	case s.ReplicationFactor > 0 && s.MinInsyncReplicas > s.ReplicationFactor:
		return s, fmt.Errorf("topic %q: min.insync.replicas %d exceeds the replication factor %d: no acks=all write could succeed",
			s.Name, s.MinInsyncReplicas, s.ReplicationFactor)
	}
	if s.RetentionMs < -1 {
		return s, fmt.Errorf("topic %q: bad retention.ms %d", s.Name, s.RetentionMs)
	}
	switch {
	case s.MaxMessageBytes < 0:
		return s, fmt.Errorf("topic %q: negative max.message.bytes %d", s.Name, s.MaxMessageBytes)
	case s.MaxMessageBytes == 0:
		s.MaxMessageBytes = DefaultMaxMessageBytes
	}
	return s, nil
}

// validateTopicName applies Kafka's rules: 1-249 characters of [a-zA-Z0-9._-],
// not "." or "..".
func validateTopicName(n string) error {
	if n == "" || n == "." || n == ".." || len(n) > 249 {
		return fmt.Errorf("illegal topic name %q", n)
	}
	for _, r := range n {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("illegal topic name %q: character %q", n, r)
		}
	}
	return nil
}

func (s TopicSpec) cleanupPolicy() string {
	switch {
	case s.Compacted && s.RetentionMs != 0:
		return "compact,delete"
	case s.Compacted:
		return "compact"
	}
	return "delete"
}

// configEntries are the topic configs CreateTopics sets (s normalized).
func (s TopicSpec) configEntries() []kafkago.ConfigEntry {
	ce := []kafkago.ConfigEntry{
		{ConfigName: "cleanup.policy", ConfigValue: s.cleanupPolicy()},
		{ConfigName: "max.message.bytes", ConfigValue: strconv.Itoa(s.MaxMessageBytes)},
	}
	if s.MinInsyncReplicas > 0 {
		ce = append(ce, kafkago.ConfigEntry{ConfigName: "min.insync.replicas", ConfigValue: strconv.Itoa(s.MinInsyncReplicas)})
	}
	switch {
	case s.RetentionMs != 0:
		ce = append(ce, kafkago.ConfigEntry{ConfigName: "retention.ms", ConfigValue: strconv.FormatInt(s.RetentionMs, 10)})
	case s.Compacted:
		ce = append(ce,
			kafkago.ConfigEntry{ConfigName: "retention.ms", ConfigValue: "-1"},
			kafkago.ConfigEntry{ConfigName: "retention.bytes", ConfigValue: "-1"})
	}
	return ce
}

// Compatible reports how an existing topic (as returned by ListTopics)
// differs from the declared spec; nil means compatible. Rules: the partition
// count must be equal (keys map to partitions by count, so group_id
// co-location depends on it); the replication factor must be equal when the
// spec sets one, and so must min.insync.replicas; compaction must agree;
// retention.ms must be equal when the spec sets it; max.message.bytes may be larger than declared but not
// smaller. The spec's zero fields take their defaults first.
func (s TopicSpec) Compatible(existing TopicSpec) []string {
	want, err := s.normalized()
	if err != nil {
		return []string{err.Error()}
	}
	var diffs []string
	if existing.Partitions != want.Partitions {
		diffs = append(diffs, fmt.Sprintf("partitions: have %d, want %d", existing.Partitions, want.Partitions))
	}
	if want.ReplicationFactor > 0 && existing.ReplicationFactor != want.ReplicationFactor {
		diffs = append(diffs, fmt.Sprintf("replication factor: have %d, want %d", existing.ReplicationFactor, want.ReplicationFactor))
	}
	if want.MinInsyncReplicas > 0 && existing.MinInsyncReplicas != want.MinInsyncReplicas {
		diffs = append(diffs, fmt.Sprintf("min.insync.replicas: have %d, want %d", existing.MinInsyncReplicas, want.MinInsyncReplicas))
	}
	if existing.Compacted != want.Compacted {
		diffs = append(diffs, fmt.Sprintf("compacted: have %t, want %t", existing.Compacted, want.Compacted))
	}
	if want.RetentionMs != 0 && existing.RetentionMs != want.RetentionMs {
		diffs = append(diffs, fmt.Sprintf("retention.ms: have %d, want %d", existing.RetentionMs, want.RetentionMs))
	}
	if existing.MaxMessageBytes < want.MaxMessageBytes {
		diffs = append(diffs, fmt.Sprintf("max.message.bytes: have %d, want at least %d", existing.MaxMessageBytes, want.MaxMessageBytes))
	}
	return diffs
}

// TopicMismatchError lists how one existing topic differs from its spec.
// It wraps ErrTopicMismatch.
type TopicMismatchError struct {
	Topic       string
	Differences []string
}

func (e *TopicMismatchError) Error() string {
	return fmt.Sprintf("topic %q exists with incompatible settings: %s", e.Topic, strings.Join(e.Differences, "; "))
}

// Unwrap returns ErrTopicMismatch.
func (e *TopicMismatchError) Unwrap() error { return ErrTopicMismatch }

// adminClient builds a kafka-go client for brokers (dial.Brokers when
// empty) bootstrapped from the first of them that answers (DialFirst): a
// kafka-go client given every address would try them in random order
// within one shared dial timeout, so a single broker that accepts
// connections without serving could fail the call.
func adminClient(ctx context.Context, dial ClientConfig, brokers []string) (*kafkago.Client, *kafkago.Transport, error) {
	if len(brokers) == 0 {
		brokers = dial.Brokers
	}
	if len(brokers) == 0 {
		return nil, nil, fmt.Errorf("%w: no broker addresses", ErrInvalidConfig)
	}
	d, err := dial.Dialer()
	if err != nil {
		return nil, nil, err
	}
	conn, addr, err := DialFirst(ctx, d, brokers)
	if err != nil {
		return nil, nil, err
	}
	conn.Close()
	tr, err := dial.Transport()
	if err != nil {
		return nil, nil, err
	}
	return &kafkago.Client{Addr: kafkago.TCP(addr), Transport: tr}, tr, nil
}

// AdminRetryTimeout bounds how long an admin call (CreateTopics,
// ListTopics, GroupGaps, ListBrokers) retries after the cluster answered
// but a broker the call was routed to did not.
const AdminRetryTimeout = 30 * time.Second

// withAdminClient runs fn with a fresh client (adminClient), again with a
// new one (fresh metadata) while fn fails with a retriable error, with
// backoff, for at most AdminRetryTimeout and within ctx. The bootstrap
// broker answered, so such an error comes from the broker kafka-go routed
// a request to (the controller named by metadata — in KRaft a random live
// broker —, a group coordinator, a partition leader) having just died or
// moved. Errors of the bootstrap itself (no broker answers, TLS or SASL
// refused) are returned at once.
func withAdminClient(ctx context.Context, dial ClientConfig, brokers []string, fn func(*kafkago.Client) error) error {
	start := time.Now()
	backoff := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		client, tr, err := adminClient(ctx, dial, brokers)
		if err != nil {
			return err
		}
		err = fn(client)
		tr.CloseIdleConnections()
		if err == nil || ctx.Err() != nil || !retriable(err) {
			return err
		}
		if time.Since(start)+backoff > AdminRetryTimeout {
			return fmt.Errorf("after %d attempts in %s: %w", attempt, time.Since(start).Round(time.Millisecond), err)
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w (last: %w)", ctx.Err(), err)
		case <-t.C:
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

// retriable reports whether err is a connection failure or a Kafka error
// marked retriable (leader or coordinator moving, not the controller, ...).
func retriable(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var ke kafkago.Error
	if errors.As(err, &ke) {
		return ke.Temporary()
	}
	return connectionError(err)
}

// connectionError reports whether err is a failed or broken connection.
func connectionError(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// CreateTopics creates the topics of specs, with the configs the specs
// declare (cleanup.policy and max.message.bytes always, retention.ms and
// min.insync.replicas when set), through the first of brokers that answers
// (dial.Brokers when brokers is empty; see DialFirst). It is idempotent: a
// topic that already exists is accepted when spec.Compatible(existing) is
// empty and otherwise reported as a *TopicMismatchError (wrapping
// ErrTopicMismatch); existing topics are never altered, so a call that
// failed on a broker that died is retried whole (see AdminRetryTimeout). Before returning, it waits (bounded by ctx) until every topic of
// specs is visible in metadata with a leader for every partition, so a
// writer may produce at once. All problems are joined into the returned
// error.
func CreateTopics(ctx context.Context, dial ClientConfig, brokers []string, specs []TopicSpec) error {
	if len(specs) == 0 {
		return nil
	}
	norm := make([]TopicSpec, len(specs))
	seen := make(map[string]bool, len(specs))
	for i, s := range specs {
		n, err := s.normalized()
		if err != nil {
			return fmt.Errorf("create topics: %w", err)
		}
		if seen[n.Name] {
			return fmt.Errorf("create topics: topic %q declared twice", n.Name)
		}
		seen[n.Name] = true
		norm[i] = n
	}
	if err := withAdminClient(ctx, dial, brokers, func(client *kafkago.Client) error {
		return createTopicsWith(ctx, client, norm)
	}); err != nil {
		return fmt.Errorf("create topics: %w", err)
	}
	return nil
}

// createTopicsWith creates the normalized specs through client (see
// CreateTopics).
func createTopicsWith(ctx context.Context, client *kafkago.Client, norm []TopicSpec) error {
	req := &kafkago.CreateTopicsRequest{}
	for _, s := range norm {
		rf := s.ReplicationFactor
		if rf == 0 {
			rf = -1
		}
		req.Topics = append(req.Topics, kafkago.TopicConfig{
			Topic:             s.Name,
			NumPartitions:     s.Partitions,
			ReplicationFactor: rf,
			ConfigEntries:     s.configEntries(),
		})
	}
	resp, err := client.CreateTopics(ctx, req)
	if err != nil {
		return err
	}
	var errs []error
	var existing []string
	for _, s := range norm {
		terr, ok := resp.Errors[s.Name]
		switch {
		case !ok:
			errs = append(errs, fmt.Errorf("create topic %q: no answer from broker", s.Name))
		case terr == nil:
		case errors.Is(terr, kafkago.TopicAlreadyExists):
			existing = append(existing, s.Name)
		default:
			errs = append(errs, fmt.Errorf("create topic %q: %w", s.Name, terr))
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	names := make([]string, len(norm))
	for i, s := range norm {
		names[i] = s.Name
	}
	have, err := waitTopics(ctx, client, names)
	if err != nil {
		return err
	}
	for _, s := range norm {
		if !slices.Contains(existing, s.Name) {
			continue
		}
		if diffs := s.Compatible(have[s.Name]); len(diffs) > 0 {
			errs = append(errs, &TopicMismatchError{Topic: s.Name, Differences: diffs})
		}
	}
	return errors.Join(errs...)
}

// waitTopics polls until all names have metadata with a leader on every
// partition, then describes them. A broken connection is returned at once:
// the client's cached metadata may keep routing to a dead broker, and the
// caller retries with a fresh client.
func waitTopics(ctx context.Context, client *kafkago.Client, names []string) (map[string]TopicSpec, error) {
	backoff := 20 * time.Millisecond
	for {
		specs, err := describeTopics(ctx, client, names)
		if err == nil {
			return specs, nil
		}
		if connectionError(err) {
			return nil, err
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("waiting for topic metadata: %w (last: %w)", ctx.Err(), err)
		case <-t.C:
		}
		backoff = min(2*backoff, time.Second)
	}
}

// ListTopics returns every non-internal topic, sorted by name, as a
// TopicSpec holding the actual partition count, replication factor (replicas
// of partition 0), min.insync.replicas, retention.ms, max.message.bytes and
// compaction.
func ListTopics(ctx context.Context, dial ClientConfig, brokers []string) ([]TopicSpec, error) {
	var out []TopicSpec
	err := withAdminClient(ctx, dial, brokers, func(client *kafkago.Client) (err error) {
		out, err = listTopics(ctx, client)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list topics: %w", err)
	}
	return out, nil
}

func listTopics(ctx context.Context, client *kafkago.Client) ([]TopicSpec, error) {
	md, err := client.Metadata(ctx, &kafkago.MetadataRequest{})
	if err != nil {
		return nil, fmt.Errorf("metadata: %w", err)
	}
	var names []string
	for _, t := range md.Topics {
		if !t.Internal && t.Error == nil {
			names = append(names, t.Name)
		}
	}
	if len(names) == 0 {
		return nil, nil
	}
	specs, err := describeTopics(ctx, client, names)
	if err != nil {
		return nil, err
	}
	out := make([]TopicSpec, 0, len(specs))
	for _, s := range specs {
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b TopicSpec) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

var describedConfigs = []string{"cleanup.policy", "retention.ms", "max.message.bytes", "min.insync.replicas"}

// describeTopics reads metadata and configs of names; an error if any topic
// is missing, has a partition without a leader, or its configs cannot be
// read.
func describeTopics(ctx context.Context, client *kafkago.Client, names []string) (map[string]TopicSpec, error) {
	md, err := client.Metadata(ctx, &kafkago.MetadataRequest{Topics: names})
	if err != nil {
		return nil, fmt.Errorf("metadata: %w", err)
	}
	out := make(map[string]TopicSpec, len(names))
	for _, t := range md.Topics {
		if t.Error != nil {
			return nil, fmt.Errorf("metadata of topic %q: %w", t.Name, t.Error)
		}
		if len(t.Partitions) == 0 {
			return nil, fmt.Errorf("metadata of topic %q: no partitions", t.Name)
		}
		s := TopicSpec{Name: t.Name, Partitions: len(t.Partitions)}
		for _, p := range t.Partitions {
			if p.Error != nil {
				return nil, fmt.Errorf("metadata of %s/%d: %w", t.Name, p.ID, p.Error)
			}
			if p.Leader.Host == "" {
				return nil, fmt.Errorf("metadata of %s/%d: no leader", t.Name, p.ID)
			}
			if p.ID == 0 {
				s.ReplicationFactor = len(p.Replicas)
			}
		}
		out[t.Name] = s
	}
	for _, n := range names {
		if _, ok := out[n]; !ok {
			return nil, fmt.Errorf("metadata: topic %q not listed", n)
		}
	}
	dreq := &kafkago.DescribeConfigsRequest{}
	for _, n := range names {
		dreq.Resources = append(dreq.Resources, kafkago.DescribeConfigRequestResource{
			ResourceType: kafkago.ResourceTypeTopic,
			ResourceName: n,
			ConfigNames:  describedConfigs,
		})
	}
	dresp, err := client.DescribeConfigs(ctx, dreq)
	if err != nil {
		return nil, fmt.Errorf("describe configs: %w", err)
	}
	got := make(map[string]bool, len(names))
	for _, r := range dresp.Resources {
		if r.Error != nil {
			return nil, fmt.Errorf("describe configs of topic %q: %w", r.ResourceName, r.Error)
		}
		s, ok := out[r.ResourceName]
		if !ok {
			continue
		}
		for _, e := range r.ConfigEntries {
			switch e.ConfigName {
			case "cleanup.policy":
				s.Compacted = strings.Contains(e.ConfigValue, "compact")
			case "retention.ms":
				if s.RetentionMs, err = strconv.ParseInt(e.ConfigValue, 10, 64); err != nil {
					return nil, fmt.Errorf("topic %q: retention.ms %q: %w", r.ResourceName, e.ConfigValue, err)
				}
			case "max.message.bytes":
				if s.MaxMessageBytes, err = strconv.Atoi(e.ConfigValue); err != nil {
					return nil, fmt.Errorf("topic %q: max.message.bytes %q: %w", r.ResourceName, e.ConfigValue, err)
				}
			case "min.insync.replicas":
				if s.MinInsyncReplicas, err = strconv.Atoi(e.ConfigValue); err != nil {
					return nil, fmt.Errorf("topic %q: min.insync.replicas %q: %w", r.ResourceName, e.ConfigValue, err)
				}
			}
		}
		out[r.ResourceName] = s
		got[r.ResourceName] = true
	}
	for _, n := range names {
		if !got[n] {
			return nil, fmt.Errorf("describe configs: topic %q not answered", n)
		}
	}
	return out, nil
}

// WriterBatchBytes is the kafka.Writer.BatchBytes to use for a topic whose
// max.message.bytes is maxMessageBytes. kafka-go sizes batches by its own
// estimate of message size, which is slightly below the encoded v2 record
// batch the broker checks (61 bytes of batch header plus a few bytes per
// record), so a writer configured with exactly max.message.bytes can build a
// batch the broker rejects, failing every message in it. With this margin an
// over-size message is instead rejected locally, before any I/O, with
// kafka.MessageTooLargeError for that message alone.
func WriterBatchBytes(maxMessageBytes int) int64 {
	if maxMessageBytes <= 0 {
		maxMessageBytes = DefaultMaxMessageBytes
	}
	if maxMessageBytes > 8192 {
		return int64(maxMessageBytes - 4096)
	}
	return int64(maxMessageBytes / 2)
}

// IsMessageTooLarge reports whether err says a message was too large for
// the writer's BatchBytes (kafka.MessageTooLargeError, raised before any I/O)
// or for the broker (MESSAGE_TOO_LARGE or RECORD_LIST_TOO_LARGE). It looks
// inside kafka.WriteErrors, which kafka-go returns for synchronous writes
// and which does not unwrap: check each element of a WriteErrors to know
// which message failed. Such a message will never succeed on retry; the
// runtime routes it to quarantine.
func IsMessageTooLarge(err error) bool {
	if err == nil {
		return false
	}
	var we kafkago.WriteErrors
	if errors.As(err, &we) {
		for _, e := range we {
			if IsMessageTooLarge(e) {
				return true
			}
		}
		return false
	}
	var mtl kafkago.MessageTooLargeError
	return errors.As(err, &mtl) ||
		errors.Is(err, kafkago.MessageSizeTooLarge) ||
		errors.Is(err, kafkago.RecordListTooLarge)
}
