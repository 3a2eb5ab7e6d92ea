package kafka

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
)

// groupReader is a consumer-group reader committing explicitly, as the
// operator runtime uses it.
func groupReader(t *testing.T, cc ClientConfig, group, topic string) *kafkago.Reader {
	t.Helper()
	d, err := cc.Dialer()
	if err != nil {
		t.Fatalf("Dialer: %v", err)
	}
	r := kafkago.NewReader(kafkago.ReaderConfig{
		Brokers:           cc.Brokers,
		GroupID:           group,
		Topic:             topic,
		Dialer:            d,
		MinBytes:          1,
		MaxBytes:          1 << 20,
		MaxWait:           100 * time.Millisecond,
		CommitInterval:    0, // CommitMessages commits synchronously
		HeartbeatInterval: 200 * time.Millisecond,
		SessionTimeout:    6 * time.Second, // kfake's minimum
		RebalanceTimeout:  5 * time.Second,
		JoinGroupBackoff:  100 * time.Millisecond,
		StartOffset:       kafkago.FirstOffset,
	})
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func writeN(t *testing.T, w *kafkago.Writer, from, to int) {
	t.Helper()
	ctx := testCtx(t, 10*time.Second)
	var msgs []kafkago.Message
	for i := from; i < to; i++ {
		msgs = append(msgs, kafkago.Message{Key: fmt.Appendf(nil, "g%d", i%7), Value: fmt.Appendf(nil, "v%03d", i)})
	}
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatalf("WriteMessages [%d,%d): %v", from, to, err)
	}
}

// TestKafkaGoGroupCommitRestart produces with acks=all, consumes part of a
// topic with a consumer-group reader committing explicitly, restarts the
// broker on the same DataDir and address, and checks that topics, data and
// committed offsets survived and that the group resumes exactly after its
// commits.
func TestKafkaGoGroupCommitRestart(t *testing.T) {
	dir := t.TempDir()
	b := startTestBroker(t, BrokerConfig{DataDir: dir})
	addr := b.Addr()
	cc := ClientConfig{Brokers: []string{addr}, ClientID: "test"}
	const topic, group, total, first = "trajectories", "validate", 30, 17
	createTopics(t, addr, TopicSpec{Name: topic, Partitions: 3})

	w := newWriter(t, cc, topic, DefaultMaxMessageBytes)
	writeN(t, w, 0, total)

	r := groupReader(t, cc, group, topic)
	ctx := testCtx(t, 20*time.Second)
	consumed := map[string]bool{}
	want := map[int]int64{} // partition -> next offset to commit
	for len(consumed) < first {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			t.Fatalf("FetchMessage after %d: %v", len(consumed), err)
		}
		if consumed[string(m.Value)] {
			t.Fatalf("duplicate %s before any restart", m.Value)
		}
		consumed[string(m.Value)] = true
		if err := r.CommitMessages(ctx, m); err != nil {
			t.Fatalf("CommitMessages: %v", err)
		}
		want[m.Partition] = m.Offset + 1
	}
	if err := r.Close(); err != nil {
		t.Fatalf("reader Close: %v", err)
	}
	got := committed(t, ctx, addr, group, topic, 3)
	for p, o := range want {
		if got[p] != o {
			t.Fatalf("before restart: partition %d committed %d, want %d (all %v)", p, got[p], o, got)
		}
	}

	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil { // idempotent
		t.Fatalf("second Close: %v", err)
	}
	b2 := startTestBroker(t, BrokerConfig{DataDir: dir, Addr: addr})
	if b2.Addr() != addr {
		t.Fatalf("restarted on %s, want %s", b2.Addr(), addr)
	}

	topics, err := ListTopics(ctx, cc, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(topics) != 1 || topics[0].Name != topic || topics[0].Partitions != 3 || topics[0].MaxMessageBytes != DefaultMaxMessageBytes {
		t.Fatalf("topics after restart: %+v", topics)
	}
	got = committed(t, ctx, addr, group, topic, 3)
	for p, o := range want {
		if got[p] != o {
			t.Fatalf("after restart: partition %d committed %d, want %d (all %v)", p, got[p], o, got)
		}
	}
	for p := range 3 {
		_, last := offsets(t, ctx, addr, topic, p)
		if o, ok := want[p]; ok && last < o {
			t.Fatalf("partition %d high watermark %d below committed %d: data lost", p, last, o)
		}
	}

	// The writer from before the restart reconnects by itself.
	writeN(t, w, total, total+5)

	r2 := groupReader(t, cc, group, topic)
	for len(consumed) < total+5 {
		m, err := r2.FetchMessage(ctx)
		if err != nil {
			t.Fatalf("FetchMessage after restart, %d consumed: %v", len(consumed), err)
		}
		if consumed[string(m.Value)] {
			t.Fatalf("%s redelivered although its offset %d/%d was committed", m.Value, m.Partition, m.Offset)
		}
		consumed[string(m.Value)] = true
		if err := r2.CommitMessages(ctx, m); err != nil {
			t.Fatalf("CommitMessages after restart: %v", err)
		}
	}
	for i := range total + 5 {
		if !consumed[fmt.Sprintf("v%03d", i)] {
			t.Fatalf("v%03d never consumed", i)
		}
	}
}

// TestKafkaGoGroupRebalance runs two readers of one group over four
// partitions: the second joins while the first is consuming; every message
// must be consumed, and after both commit, the committed offsets reach the
// end of every partition.
func TestKafkaGoGroupRebalance(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{})
	addr := b.Addr()
	cc := ClientConfig{Brokers: []string{addr}}
	const topic, group, total = "scored", "pack", 40
	createTopics(t, addr, TopicSpec{Name: topic, Partitions: 4})
	w := newWriter(t, cc, topic, 0)
	writeN(t, w, 0, total/2)

	ctx := testCtx(t, 25*time.Second)
	type got struct {
		reader int
		m      kafkago.Message
	}
	ch := make(chan got, total*2)
	errc := make(chan error, 2)
	consume := func(id int, r *kafkago.Reader) {
		for {
			m, err := r.FetchMessage(ctx)
			if err != nil {
				errc <- err
				return
			}
			if err := r.CommitMessages(ctx, m); err != nil {
				errc <- fmt.Errorf("reader %d commit: %w", id, err)
				return
			}
			ch <- got{id, m}
		}
	}
	r1 := groupReader(t, cc, group, topic)
	go consume(1, r1)
	seen := map[string]int{}
	byReader := map[int]int{}
	recv := func(n int) {
		t.Helper()
		for len(seen) < n {
			select {
			case g := <-ch:
				seen[string(g.m.Value)]++
				byReader[g.reader]++
			case err := <-errc:
				t.Fatalf("consumer: %v", err)
			case <-ctx.Done():
				t.Fatalf("only %d of %d messages consumed (by reader %v)", len(seen), n, byReader)
			}
		}
	}
	recv(total / 2)
	r2 := groupReader(t, cc, group, topic)
	go consume(2, r2)
	start := time.Now()
	// Keep producing while the group rebalances, until the second reader
	// has been assigned partitions and consumed from them.
	n := total / 2
	for byReader[2] == 0 {
		if n >= 400 {
			t.Fatalf("second reader got nothing after %d messages, %s (by reader %v)", n, time.Since(start), byReader)
		}
		writeN(t, w, n, n+8)
		n += 8
		recv(n)
	}
	t.Logf("second reader consuming after %s; messages by reader %v; redelivered %d",
		time.Since(start), byReader, countDup(seen))
	// Every partition ends fully committed once the messages are in.
	deadline := time.Now().Add(5 * time.Second)
	for {
		c := committed(t, ctx, addr, group, topic, 4)
		ok := true
		for p := range 4 {
			if _, last := offsets(t, ctx, addr, topic, p); c[p] != last {
				ok = false
			}
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("committed offsets %v never reached the ends", c)
		}
		time.Sleep(50 * time.Millisecond)
	}
	_ = r1.Close()
	_ = r2.Close()
	select {
	case err := <-errc:
		if !errors.Is(err, ctx.Err()) && err.Error() != "context canceled" {
			t.Logf("consumer ended with %v", err)
		}
	default:
	}
}

func countDup(m map[string]int) int {
	n := 0
	for _, k := range slices.Sorted(maps.Keys(m)) {
		n += m[k] - 1
	}
	return n
}
