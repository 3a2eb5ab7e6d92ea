package kafka

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
)

func TestCreateTopicsIdempotentAndMismatch(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{})
	cc := ClientConfig{Brokers: []string{b.Addr()}}
	ctx := testCtx(t, 15*time.Second)
	specs := []TopicSpec{
		{Name: "tasks", Partitions: 4},
		{Name: "policy", Compacted: true},
		{Name: "census", Partitions: 2, RetentionMs: 3600_000, MaxMessageBytes: 1 << 20, ReplicationFactor: 1},
	}
	if err := CreateTopics(ctx, cc, nil, specs); err != nil {
		t.Fatalf("first CreateTopics: %v", err)
	}
	if err := CreateTopics(ctx, cc, nil, specs); err != nil {
		t.Fatalf("second CreateTopics of the same specs must succeed: %v", err)
	}
	got, err := ListTopics(ctx, cc, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := []TopicSpec{
		{Name: "census", Partitions: 2, ReplicationFactor: 1, MinInsyncReplicas: 1, RetentionMs: 3600_000, MaxMessageBytes: 1 << 20},
		{Name: "policy", Partitions: 1, ReplicationFactor: 1, MinInsyncReplicas: 1, RetentionMs: -1, MaxMessageBytes: DefaultMaxMessageBytes, Compacted: true},
		{Name: "tasks", Partitions: 4, ReplicationFactor: 1, MinInsyncReplicas: 1, RetentionMs: 7 * 24 * 3600_000, MaxMessageBytes: DefaultMaxMessageBytes},
	}
	if len(got) != len(want) {
		t.Fatalf("ListTopics = %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("topic %d = %+v, want %+v", i, got[i], want[i])
		}
	}

	for _, tc := range []struct {
		name string
		spec TopicSpec
		diff string // substring of the mismatch, "" = compatible
	}{
		{"same", TopicSpec{Name: "tasks", Partitions: 4}, ""},
		{"smaller max accepted", TopicSpec{Name: "tasks", Partitions: 4, MaxMessageBytes: 1 << 20}, ""},
		{"partitions", TopicSpec{Name: "tasks", Partitions: 8}, "partitions: have 4, want 8"},
		{"replication", TopicSpec{Name: "tasks", Partitions: 4, ReplicationFactor: 3}, "replication factor: have 1, want 3"},
		{"not compacted", TopicSpec{Name: "tasks", Partitions: 4, Compacted: true}, "compacted: have false, want true"},
		{"retention", TopicSpec{Name: "census", Partitions: 2, RetentionMs: 60_000, MaxMessageBytes: 1 << 20}, "retention.ms: have 3600000, want 60000"},
		{"max too small", TopicSpec{Name: "census", Partitions: 2}, "max.message.bytes: have 1048576, want at least 67108864"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CreateTopics(ctx, cc, nil, []TopicSpec{tc.spec})
			if tc.diff == "" {
				if err != nil {
					t.Fatalf("want compatible, got %v", err)
				}
				return
			}
			var me *TopicMismatchError
			if !errors.Is(err, ErrTopicMismatch) || !errors.As(err, &me) {
				t.Fatalf("want a *TopicMismatchError, got %v", err)
			}
			if me.Topic != tc.spec.Name || !strings.Contains(err.Error(), tc.diff) {
				t.Fatalf("mismatch %v does not report %q", err, tc.diff)
			}
		})
	}
	// A new topic next to a mismatching one is still created.
	err = CreateTopics(ctx, cc, nil, []TopicSpec{{Name: "tasks", Partitions: 2}, {Name: "fresh"}})
	if !errors.Is(err, ErrTopicMismatch) {
		t.Fatalf("want mismatch, got %v", err)
	}
	if got, _ := ListTopics(ctx, cc, nil); len(got) != 4 {
		t.Fatalf("topic fresh not created: %+v", got)
	}
}

func TestCreateTopicsRejectsBadSpecs(t *testing.T) {
	ctx := testCtx(t, 5*time.Second)
	cc := ClientConfig{Brokers: []string{"127.0.0.1:1"}} // never dialled: specs fail first
	for _, tc := range []struct {
		name string
		spec TopicSpec
	}{
		{"empty name", TopicSpec{}},
		{"dot", TopicSpec{Name: ".."}},
		{"slash", TopicSpec{Name: "a/b"}},
		{"space", TopicSpec{Name: "a b"}},
		{"too long", TopicSpec{Name: strings.Repeat("x", 250)}},
		{"negative partitions", TopicSpec{Name: "a", Partitions: -1}},
		{"negative replication", TopicSpec{Name: "a", ReplicationFactor: -1}},
		{"bad retention", TopicSpec{Name: "a", RetentionMs: -2}},
		{"negative max", TopicSpec{Name: "a", MaxMessageBytes: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := CreateTopics(ctx, cc, nil, []TopicSpec{tc.spec}); err == nil {
				t.Fatalf("spec %+v accepted", tc.spec)
			}
		})
	}
	if err := CreateTopics(ctx, cc, nil, []TopicSpec{{Name: "a"}, {Name: "a"}}); err == nil {
		t.Fatal("duplicate spec accepted")
	}
	if err := CreateTopics(ctx, ClientConfig{}, nil, []TopicSpec{{Name: "a"}}); !errors.Is(err, ErrInvalidConfig) {
		t.Fatalf("no brokers: got %v", err)
	}
}

// TestOverSizeProduce checks both places an over-size message is caught:
// by kafka-go before any I/O (BatchBytes from WriterBatchBytes) and by the
// broker (topic max.message.bytes) when a writer's BatchBytes is too large.
// Both must be recognisable with IsMessageTooLarge, and the topic must stay
// usable.
func TestOverSizeProduce(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{})
	cc := ClientConfig{Brokers: []string{b.Addr()}}
	const limit = 256 << 10
	createTopics(t, b.Addr(), TopicSpec{Name: "valid", MaxMessageBytes: limit})
	ctx := testCtx(t, 15*time.Second)
	big := kafkago.Message{Key: []byte("k"), Value: bytes.Repeat([]byte{'x'}, limit+1)}
	small := kafkago.Message{Key: []byte("k"), Value: []byte("ok")}

	t.Run("writer", func(t *testing.T) {
		w := newWriter(t, cc, "valid", limit)
		err := w.WriteMessages(ctx, small, big)
		var mtl kafkago.MessageTooLargeError
		if !errors.As(err, &mtl) || !IsMessageTooLarge(err) {
			t.Fatalf("want kafka.MessageTooLargeError, got %T %v", err, err)
		}
		if len(mtl.Remaining) != 1 || string(mtl.Remaining[0].Value) != "ok" {
			t.Fatalf("Remaining = %d messages", len(mtl.Remaining))
		}
		if err := w.WriteMessages(ctx, mtl.Remaining...); err != nil {
			t.Fatalf("rest of the batch: %v", err)
		}
	})
	t.Run("broker", func(t *testing.T) {
		w := newWriter(t, cc, "valid", 4*limit)
		start := time.Now()
		err := w.WriteMessages(ctx, big)
		var we kafkago.WriteErrors
		if !errors.As(err, &we) || len(we) != 1 || !IsMessageTooLarge(we[0]) || !IsMessageTooLarge(err) {
			t.Fatalf("want WriteErrors{MessageSizeTooLarge}, got %T %v", err, err)
		}
		if !errors.Is(we[0], kafkago.MessageSizeTooLarge) {
			t.Fatalf("element error %v is not MessageSizeTooLarge", we[0])
		}
		t.Logf("broker rejection after %s: %v", time.Since(start), err)
		if err := w.WriteMessages(ctx, small); err != nil {
			t.Fatalf("topic unusable after rejection: %v", err)
		}
	})
	if _, last := offsets(t, ctx, b.Addr(), "valid", 0); last != 2 {
		t.Fatalf("high watermark %d, want 2 (only the small messages)", last)
	}
	for _, err := range []error{nil, errors.New("x"), kafkago.LeaderNotAvailable, kafkago.WriteErrors{nil, kafkago.RequestTimedOut}} {
		if IsMessageTooLarge(err) {
			t.Errorf("IsMessageTooLarge(%v) = true", err)
		}
	}
}

// TestLargeMessageRoundTrip sends a message larger than kafka-go's default
// BatchBytes (1 MiB) and larger than the reader's MaxBytes: the broker
// returns a first batch even above the fetch limit, and the reader gets it.
func TestLargeMessageRoundTrip(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{})
	cc := ClientConfig{Brokers: []string{b.Addr()}}
	createTopics(t, b.Addr(), TopicSpec{Name: "batches"})
	ctx := testCtx(t, 15*time.Second)
	val := bytes.Repeat([]byte("0123456789abcdef"), 3<<20/16) // 3 MiB
	w := newWriter(t, cc, "batches", 0)
	if err := w.WriteMessages(ctx, kafkago.Message{Key: []byte("g"), Value: val}); err != nil {
		t.Fatalf("write 3 MiB: %v", err)
	}
	r := groupReader(t, cc, "train", "batches") // MaxBytes 1 MiB
	m, err := r.FetchMessage(ctx)
	if err != nil {
		t.Fatalf("fetch 3 MiB: %v", err)
	}
	if !bytes.Equal(m.Value, val) {
		t.Fatalf("value of %d bytes differs", len(m.Value))
	}
}

func TestWriterBatchBytes(t *testing.T) {
	for _, tc := range []struct {
		in   int
		want int64
	}{
		{0, DefaultMaxMessageBytes - 4096},
		{1 << 20, 1<<20 - 4096},
		{8192, 4096},
		{100, 50},
	} {
		if got := WriterBatchBytes(tc.in); got != tc.want {
			t.Errorf("WriterBatchBytes(%d) = %d, want %d", tc.in, got, tc.want)
		}
	}
}

func TestRetriable(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{refused, true},
		{fmt.Errorf("create topics: %w", refused), true},
		{io.ErrUnexpectedEOF, true},
		{kafkago.LeaderNotAvailable, true},
		{kafkago.NotController, true},
		{errors.Join(errors.New("x"), fmt.Errorf("topic %q: %w", "t", kafkago.NotController)), true},
		{kafkago.GroupIdNotFound, false},
		{kafkago.InvalidReplicationFactor, false},
		{kafkago.SASLAuthenticationFailed, false},
		{&TopicMismatchError{Topic: "t"}, false},
		{context.Canceled, false},
		{fmt.Errorf("wait: %w", context.DeadlineExceeded), false},
	} {
		if got := retriable(tc.err); got != tc.want {
			t.Errorf("retriable(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
