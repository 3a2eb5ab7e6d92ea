package kafka

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
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
	// Every partition ends fully committed once the messages are in. A
	// commit by the previous owner of a revoked partition can land after
	// the new owner's (kafka-go commits with its current generation and the
	// coordinator does not check ownership), regressing that partition's
	// offset; the next commit of the new owner corrects it, so while the
	// offsets lag, a few more messages are produced and consumed.
	deadline := time.Now().Add(15 * time.Second)
	nextNudge := time.Now().Add(time.Second)
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
		if time.Now().After(nextNudge) {
			writeN(t, w, n, n+8)
			n += 8
			recv(n)
			nextNudge = time.Now().Add(time.Second)
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

// TestDataDirCrashCopy copies the DataDir of a running broker (what a
// kill -9 leaves on disk, page cache included) and starts a broker from the
// copy: acknowledged records and committed offsets must all be there.
func TestDataDirCrashCopy(t *testing.T) {
	dir := t.TempDir()
	b := startTestBroker(t, BrokerConfig{DataDir: dir})
	cc := ClientConfig{Brokers: []string{b.Addr()}}
	const topic, group = "rewarded", "advantage"
	createTopics(t, b.Addr(), TopicSpec{Name: topic, Partitions: 2})
	w := newWriter(t, cc, topic, 0)
	writeN(t, w, 0, 20)
	r := groupReader(t, cc, group, topic)
	ctx := testCtx(t, 20*time.Second)
	for range 7 {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.CommitMessages(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	want := committed(t, ctx, b.Addr(), group, topic, 2)
	var ends [2]int64
	for p := range 2 {
		_, ends[p] = offsets(t, ctx, b.Addr(), topic, p)
	}
	crash := filepath.Join(t.TempDir(), "crash")
	if err := os.CopyFS(crash, os.DirFS(dir)); err != nil {
		t.Fatalf("copying the live data dir: %v", err)
	}
	b2 := startTestBroker(t, BrokerConfig{DataDir: crash})
	if got := committed(t, ctx, b2.Addr(), group, topic, 2); !maps.Equal(got, want) {
		t.Fatalf("committed offsets after crash %v, want %v", got, want)
	}
	for p := range 2 {
		if first, last := offsets(t, ctx, b2.Addr(), topic, p); first != 0 || last != ends[p] {
			t.Fatalf("partition %d after crash [%d,%d), want [0,%d)", p, first, last, ends[p])
		}
	}
}

// TestLiveReaderAcrossRestart keeps a group reader and a writer open while
// the broker restarts on the same DataDir and address: both must carry on by
// themselves, every message must arrive (at least once) and the final
// commits must reach the end of every partition.
func TestLiveReaderAcrossRestart(t *testing.T) {
	dir := t.TempDir()
	b := startTestBroker(t, BrokerConfig{DataDir: dir})
	addr := b.Addr()
	cc := ClientConfig{Brokers: []string{addr}}
	const topic, group = "valid", "reward"
	createTopics(t, addr, TopicSpec{Name: topic, Partitions: 2})
	w := newWriter(t, cc, topic, 0)
	writeN(t, w, 0, 10)
	r := groupReader(t, cc, group, topic)
	ctx := testCtx(t, 30*time.Second)
	seen := map[string]int{}
	commitErrs := 0
	fetch := func(until int) {
		t.Helper()
		for len(seen) < until {
			m, err := r.FetchMessage(ctx)
			if err != nil {
				t.Fatalf("FetchMessage with %d seen: %v", len(seen), err)
			}
			seen[string(m.Value)]++
			// kafka-go does not retry a commit whose connection broke;
			// the caller retries (the commit is for the same offset).
			for {
				err := r.CommitMessages(ctx, m)
				if err == nil {
					break
				}
				commitErrs++
				t.Logf("CommitMessages %d/%d: %v (retrying)", m.Partition, m.Offset, err)
				if ctx.Err() != nil {
					t.Fatalf("CommitMessages: %v", err)
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
	fetch(5)
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	startTestBroker(t, BrokerConfig{DataDir: dir, Addr: addr})
	start := time.Now()
	writeN(t, w, 10, 14)
	fetch(14)
	t.Logf("live reader resumed and caught up %s after restart; redelivered %d; failed commits %d",
		time.Since(start), countDup(seen), commitErrs)
	deadline := time.Now().Add(5 * time.Second)
	for {
		c := committed(t, ctx, addr, group, topic, 2)
		_, l0 := offsets(t, ctx, addr, topic, 0)
		_, l1 := offsets(t, ctx, addr, topic, 1)
		if c[0] == l0 && c[1] == l1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("committed %v, ends [%d %d]", c, l0, l1)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
