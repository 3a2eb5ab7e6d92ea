package pipeline

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	produceapi "github.com/segmentio/kafka-go/protocol/produce"

	tfkafka "github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/internal/nettest"
)

// queuedFailures is a group reader whose first fetches return the
// failures kafka-go's reader queued while a broker was down, then the
// records; commits are recorded.
type queuedFailures struct {
	mu        sync.Mutex
	failures  int
	failure   error // nil: a refused dial
	records   []kafka.Message
	committed []kafka.Message
}

func (r *queuedFailures) FetchMessage(ctx context.Context) (kafka.Message, error) {
	r.mu.Lock()
	if r.failures > 0 {
		r.failures--
		err := r.failure
		r.mu.Unlock()
		if err == nil {
			err = fmt.Errorf("failed to dial: failed to open connection to 127.0.0.1:1: %w", syscall.ECONNREFUSED)
		}
		return kafka.Message{}, err
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
//
// A bare context.Canceled that is not the operator's own is the same kind
// of failure: kafka-go's partition reader of a generation that ended (the
// group's coordinator lost) can queue its cancelled dial (seen once in a
// fault run, where it restarted pack).
func TestOperatorDrainsQueuedFetchFailures(t *testing.T) {
	for _, tt := range []struct {
		name    string
		failure error
		n       int
	}{
		{"refused dials", nil, 200},
		{"a generation's cancelled dial", context.Canceled, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			addr := startCluster(t, "in", "out", "quarantine")
			r := &queuedFailures{failures: tt.n, failure: tt.failure, records: []kafka.Message{
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
		})
	}
}

// noLeaderFor fails the first n produce requests the way kafka-go's
// transport does when its cached metadata names no leader for the
// partition, then passes requests on.
type noLeaderFor struct {
	next kafka.RoundTripper
	mu   sync.Mutex
	n    int
	seen int
}

func (f *noLeaderFor) RoundTrip(ctx context.Context, addr net.Addr, req kafka.Request) (kafka.Response, error) {
	if p, ok := req.(*produceapi.Request); ok {
		f.mu.Lock()
		fail := f.n > 0
		if fail {
			f.n--
			f.seen++
		}
		f.mu.Unlock()
		if fail {
			return nil, produceapi.NewError(protocol.NewErrNoLeader(p.Topics[0].Topic, p.Topics[0].Partitions[0].Partition))
		}
	}
	return f.next.RoundTrip(ctx, addr, req)
}

// TestOperatorRetriesProduceWithoutLeader: right after a partition leader
// moves, kafka-go's writer can route a batch by metadata that names no
// leader, and it does not retry that ("topic partition has no leader").
// The runtime retries the batch in place, in order, instead of stopping
// the operator: every output arrives, in input order per key, and the
// inputs are committed.
func TestOperatorRetriesProduceWithoutLeader(t *testing.T) {
	addr := startCluster(t, "in", "out", "quarantine")
	var vals [][]byte
	for i := 0; i < 40; i++ {
		vals = append(vals, []byte(fmt.Sprintf("rec-%03d", i)))
	}
	produce(t, addr, "in", vals...)
	op, err := NewOperator(testConfig(addr), upper{})
	if err != nil {
		t.Fatal(err)
	}
	base := &kafka.Transport{}
	defer base.CloseIdleConnections()
	flaky := &noLeaderFor{next: base, n: 6}
	op.transport = flaky
	runUntil(t, op, func() bool { return lastOffsets(t, addr, "out") >= 40 })
	if flaky.seen != 6 {
		t.Fatalf("%d produce requests failed without a leader, want 6", flaky.seen)
	}
	out := drain(t, addr, "out", 40)
	last := map[string]string{}
	for _, m := range out {
		k := string(m.Key)
		if prev, ok := last[k]; ok && string(m.Value) < prev {
			t.Fatalf("key %s: %q after %q: a retried batch was reordered", k, m.Value, prev)
		}
		last[k] = string(m.Value)
	}
	if got := committed(t, addr, "trajflow-upper", "in"); got != 40 {
		t.Fatalf("committed offsets sum = %d, want 40", got)
	}
}

func TestProduceTransient(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{produceapi.NewError(protocol.NewErrNoLeader("t", 0)), true},
		{fmt.Errorf("kafka.(*Client).Produce: %w", produceapi.NewError(protocol.NewErrNoPartition("t", 3))), true},
		{syscall.ECONNREFUSED, true},
		{kafka.NotEnoughReplicas, true},
		{kafka.MessageSizeTooLarge, false},
		{kafka.TopicAuthorizationFailed, false},
		{errors.New("something else"), false},
	} {
		if got := produceTransient(tc.err); got != tc.want {
			t.Errorf("produceTransient(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
	var temp interface{ Temporary() bool }
	if err := error(temporaryError{syscall.ECONNRESET}); !errors.As(err, &temp) || !temp.Temporary() || !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("temporaryError %v is not temporary or hides its cause", err)
	}
}

// refuseProduce fails every produce request with err.
type refuseProduce struct {
	next kafka.RoundTripper
	err  error
}

func (f refuseProduce) RoundTrip(ctx context.Context, addr net.Addr, req kafka.Request) (kafka.Response, error) {
	if _, ok := req.(*produceapi.Request); ok {
		return nil, f.err
	}
	return f.next.RoundTrip(ctx, addr, req)
}

// TestOperatorStopsOnFatalProduceWhileIdle: a produce that fails for good
// ends Run with its error even when no further record arrives (the fetch
// waiting for one is interrupted), so that the operator can be restarted
// instead of hanging.
func TestOperatorStopsOnFatalProduceWhileIdle(t *testing.T) {
	addr := startCluster(t, "in", "out", "quarantine")
	r := &queuedFailures{records: []kafka.Message{{Topic: "in", Partition: 0, Offset: 0, Key: []byte("k"), Value: []byte("v")}}}
	op, err := NewOperator(testConfig(addr), upper{})
	if err != nil {
		t.Fatal(err)
	}
	op.newReader = func(kafka.ReaderConfig) groupReader { return r }
	base := &kafka.Transport{}
	defer base.CloseIdleConnections()
	op.transport = refuseProduce{next: base, err: kafka.TopicAuthorizationFailed}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = op.Run(ctx)
	if ctx.Err() != nil {
		t.Fatal("Run did not return after a fatal produce error (it waited for a record that never came)")
	}
	if !errors.Is(err, kafka.TopicAuthorizationFailed) {
		t.Fatalf("Run = %v, want the produce error", err)
	}
	if got := r.committedThrough("in", 0); got >= 0 {
		t.Fatalf("committed through %d although the output failed", got)
	}
}

// TestTransient: broker and network failures that heal are retried in
// place; a refusal of the client's credentials or trust (kafka.Refused),
// or a request the broker can never accept, is not.
func TestTransient(t *testing.T) {
	cert := &x509.Certificate{}
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"connection refused", fmt.Errorf("dial: %w", syscall.ECONNREFUSED), true},
		{"leader moving", kafka.NotLeaderForPartition, true},
		{"group loading", errors.New("[14] Group Load In Progress: the coordinator is loading"), true},
		{"sasl refused", fmt.Errorf("dial: %w", kafka.SASLAuthenticationFailed), false},
		{"untrusted certificate", &net.OpError{Op: "dial", Err: &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{Cert: cert}}}, false},
		{"message too large", kafka.MessageSizeTooLarge, false},
		{"another protocol", fmt.Errorf("pipeline: kafka: no broker answered (1 addresses): a: %w", tfkafka.ErrNotKafka), false},
	} {
		if got := transient(tc.err); got != tc.want {
			t.Errorf("%s: transient(%v) = %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}

// TestOperatorStopsOnAnotherProtocol: an operator whose broker address
// is a server of another protocol (here an SSH server's banner) stops at
// once with an error that says so and names the address, instead of
// waiting for a broker that will never answer there.
func TestOperatorStopsOnAnotherProtocol(t *testing.T) {
	addr := nettest.Greeter(t, []byte("SSH-2.0-OpenSSH_9.2p1\r\n"))
	op, err := NewOperator(testConfig(addr), upper{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = op.Run(ctx)
	if !errors.Is(err, tfkafka.ErrNotKafka) || !strings.Contains(err.Error(), addr) || ctx.Err() != nil {
		t.Fatalf("Run against a server of another protocol at %s: %v (context %v), want ErrNotKafka at once", addr, err, ctx.Err())
	}
}
