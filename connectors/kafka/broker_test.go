package kafka

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
)

func TestStartBrokerRejectsBadConfig(t *testing.T) {
	ctx := testCtx(t, 5*time.Second)
	for _, tc := range []struct {
		name string
		cfg  BrokerConfig
	}{
		{"unspecified host", BrokerConfig{Addr: "0.0.0.0:0"}},
		{"unspecified v6", BrokerConfig{Addr: "[::]:0"}},
		{"host name", BrokerConfig{Addr: "localhost:0"}},
		{"no port", BrokerConfig{Addr: "127.0.0.1"}},
		{"bad port", BrokerConfig{Addr: "127.0.0.1:70000"}},
		{"negative max", BrokerConfig{MaxMessageBytes: -1}},
		{"negative retention", BrokerConfig{Retention: RetentionPolicy{Bytes: -1}}},
		{"bad user", BrokerConfig{Users: []BrokerUser{{Mechanism: "gssapi", Username: "u"}}}},
		{"user without name", BrokerConfig{Users: []BrokerUser{{Mechanism: SASLPlain}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := StartBroker(ctx, tc.cfg)
			if err == nil {
				_ = b.Close()
				t.Fatalf("config %+v accepted", tc.cfg)
			}
		})
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := StartBroker(cancelled, BrokerConfig{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled ctx: got %v", err)
	}
}

func TestBrokerAddrAndClose(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{})
	if !strings.HasPrefix(b.Addr(), "127.0.0.1:") || strings.HasSuffix(b.Addr(), ":0") {
		t.Fatalf("Addr = %q", b.Addr())
	}
	// A second broker cannot take the same address.
	if b2, err := StartBroker(testCtx(t, 5*time.Second), BrokerConfig{Addr: b.Addr()}); err == nil {
		_ = b2.Close()
		t.Fatal("two brokers on one address")
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			if err := b.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		})
	}
	wg.Wait()
	if err := b.ApplyRetention(); !errors.Is(err, ErrBrokerClosed) {
		t.Fatalf("ApplyRetention after Close: %v", err)
	}
	cl, done := freshClient(b.Addr())
	defer done()
	ctx := testCtx(t, 2*time.Second)
	if _, err := cl.Metadata(ctx, &kafkago.MetadataRequest{}); err == nil {
		t.Fatal("closed broker still answers")
	}
}

// dirBytes sums the segment files under a DataDir.
func dirBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".dat") {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			n += fi.Size()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestRetentionBytesBoundsStorage writes about 400 KiB to a partition of a
// broker bounded to 64 KiB per partition and checks that one retention pass
// advances the log start offset and deletes segment files down to the bound
// plus one segment.
func TestRetentionBytesBoundsStorage(t *testing.T) {
	dir := t.TempDir()
	const bound, seg = 64 << 10, 16 << 10
	b := startTestBroker(t, BrokerConfig{DataDir: dir, Retention: RetentionPolicy{
		Bytes: bound, SegmentBytes: seg, CheckInterval: time.Hour}})
	createTopics(t, b.Addr(), TopicSpec{Name: "rollouts"})
	w := newWriter(t, ClientConfig{Brokers: []string{b.Addr()}}, "rollouts", 0)
	w.BatchSize = 1
	ctx := testCtx(t, 15*time.Second)
	val := bytes.Repeat([]byte{'r'}, 2<<10)
	const n = 200
	for i := range n {
		if err := w.WriteMessages(ctx, kafkago.Message{Key: fmt.Appendf(nil, "%d", i), Value: val}); err != nil {
			t.Fatal(err)
		}
	}
	before := dirBytes(t, dir)
	if first, last := offsets(t, ctx, b.Addr(), "rollouts", 0); first != 0 || last != n {
		t.Fatalf("before retention: offsets [%d,%d), want [0,%d)", first, last, n)
	}
	if err := b.ApplyRetention(); err != nil {
		t.Fatal(err)
	}
	after := dirBytes(t, dir)
	first, last := offsets(t, ctx, b.Addr(), "rollouts", 0)
	t.Logf("segment bytes %d -> %d; offsets [%d,%d)", before, after, first, last)
	if before < n*2<<10 {
		t.Fatalf("only %d bytes written before retention", before)
	}
	if first == 0 || last != n {
		t.Fatalf("after retention: offsets [%d,%d)", first, last)
	}
	if kept := (last - first) * (2<<10 + 70); kept > bound+4<<10 {
		t.Fatalf("kept %d records (~%d bytes) over the %d bound", last-first, kept, bound)
	}
	if after > bound+seg+8<<10 {
		t.Fatalf("segment files hold %d bytes, bound %d + segment %d", after, bound, seg)
	}
	// The retained tail is still readable from its new start.
	conn, err := kafkago.DialLeader(ctx, "tcp", b.Addr(), "rollouts", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Seek(first, kafkago.SeekAbsolute); err != nil {
		t.Fatal(err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	m, err := conn.ReadMessage(1 << 20)
	if err != nil || m.Offset != first || string(m.Key) != fmt.Sprint(first) {
		t.Fatalf("reading offset %d: %v %d %q", first, err, m.Offset, m.Key)
	}
}

// TestRetentionAgePeriodic relies on the background pass alone: records
// older than Age disappear within a few check intervals, records of a topic
// with its own longer retention.ms and of a compacted topic stay.
func TestRetentionAgePeriodic(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{Retention: RetentionPolicy{Age: time.Minute, CheckInterval: 20 * time.Millisecond}})
	ctx := testCtx(t, 15*time.Second)
	cc := ClientConfig{Brokers: []string{b.Addr()}}
	old := time.Now().Add(-2 * time.Hour)
	produce := func(topic string) {
		w := newWriter(t, cc, topic, 0)
		var msgs []kafkago.Message
		for i := range 5 {
			msgs = append(msgs, kafkago.Message{Key: fmt.Appendf(nil, "k%d", i), Value: []byte("old"), Time: old})
		}
		if err := w.WriteMessages(ctx, msgs...); err != nil {
			t.Fatal(err)
		}
		if err := w.WriteMessages(ctx, kafkago.Message{Key: []byte("k9"), Value: []byte("new")}); err != nil {
			t.Fatal(err)
		}
	}
	// With no topic-level retention config, kfake's own cleaner is idle:
	// only the broker's pass can trim "short".
	createTopics(t, b.Addr(), TopicSpec{Name: "short"})
	produce("short")
	for {
		first, last := offsets(t, ctx, b.Addr(), "short", 0)
		if first == 5 && last == 6 {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("short: offsets [%d,%d), want [5,6)", first, last)
		}
		time.Sleep(20 * time.Millisecond)
	}
	createTopics(t, b.Addr(),
		TopicSpec{Name: "long", RetentionMs: int64(24 * time.Hour / time.Millisecond)},
		TopicSpec{Name: "releases", Compacted: true})
	produce("long")
	produce("releases")
	time.Sleep(20 * 20 * time.Millisecond) // twenty passes
	for _, topic := range []string{"long", "releases"} {
		if first, last := offsets(t, ctx, b.Addr(), topic, 0); first != 0 || last != 6 {
			t.Fatalf("%s: offsets [%d,%d), want [0,6)", topic, first, last)
		}
	}
}

func TestRetentionPolicyDefaults(t *testing.T) {
	for _, tc := range []struct {
		p              RetentionPolicy
		ms, bytes, seg int64
		interval       time.Duration
	}{
		{RetentionPolicy{}, 604800000, -1, 100 << 20, DefaultRetentionCheckInterval},
		{RetentionPolicy{Age: -1, Bytes: 1 << 30, CheckInterval: time.Second}, -1, 1 << 30, 100 << 20, time.Second},
		{RetentionPolicy{Age: time.Hour, Bytes: 64 << 20}, 3600000, 64 << 20, 16 << 20, DefaultRetentionCheckInterval},
		{RetentionPolicy{Age: time.Microsecond, Bytes: 1000}, 1, 1000, 4 << 10, DefaultRetentionCheckInterval},
		{RetentionPolicy{Bytes: 1 << 20, SegmentBytes: 1234}, 604800000, 1 << 20, 1234, DefaultRetentionCheckInterval},
	} {
		if tc.p.retentionMs() != tc.ms || tc.p.retentionBytes() != tc.bytes || tc.p.segmentBytes() != tc.seg || tc.p.interval() != tc.interval {
			t.Errorf("%+v: got ms=%d bytes=%d seg=%d interval=%s", tc.p, tc.p.retentionMs(), tc.p.retentionBytes(), tc.p.segmentBytes(), tc.p.interval())
		}
	}
}

// TestGroupGapsAfterRetention: retention deletes records a group has not
// consumed. kafka-go's reader silently jumps to the log start (pinned here,
// since the runtime relies on knowing it), and GroupGaps reports the loss.
func TestGroupGapsAfterRetention(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{Retention: RetentionPolicy{Age: time.Minute, CheckInterval: time.Hour}})
	cc := ClientConfig{Brokers: []string{b.Addr()}}
	createTopics(t, b.Addr(), TopicSpec{Name: "tasks", Partitions: 2})
	ctx := testCtx(t, 15*time.Second)
	w := newWriter(t, cc, "tasks", 0)
	w.Balancer = kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int { return int(m.Key[0] - '0') })
	old := time.Now().Add(-time.Hour)
	for i := range 5 {
		if err := w.WriteMessages(ctx, kafkago.Message{Key: []byte("0"), Value: fmt.Appendf(nil, "old%d", i), Time: old}); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.WriteMessages(ctx, kafkago.Message{Key: []byte("0"), Value: []byte("new")}); err != nil {
		t.Fatal(err)
	}
	r := groupReader(t, cc, "dispatch", "tasks")
	m, err := r.FetchMessage(ctx)
	if err != nil || m.Offset != 0 {
		t.Fatalf("first fetch: %v offset %d", err, m.Offset)
	}
	if err := r.CommitMessages(ctx, m); err != nil {
		t.Fatal(err)
	}
	_ = r.Close()
	if gaps, err := GroupGaps(ctx, cc, nil, "dispatch", "tasks"); err != nil || len(gaps) != 0 {
		t.Fatalf("before retention: gaps %v, %v", gaps, err)
	}
	if err := b.ApplyRetention(); err != nil {
		t.Fatal(err)
	}
	gaps, err := GroupGaps(ctx, cc, nil, "dispatch", "tasks")
	if err != nil {
		t.Fatal(err)
	}
	if want := []OffsetGap{{Partition: 0, Committed: 1, LogStart: 5}}; !slices.Equal(gaps, want) || gaps[0].Lost() != 4 {
		t.Fatalf("gaps %v, want %v", gaps, want)
	}
	r2 := groupReader(t, cc, "dispatch", "tasks")
	m, err = r2.FetchMessage(ctx)
	if err != nil || m.Offset != 5 || string(m.Value) != "new" {
		t.Fatalf("kafka-go after the gap: offset %d %q %v (expected a silent jump to 5)", m.Offset, m.Value, err)
	}
	if _, err := GroupGaps(ctx, cc, nil, "dispatch", "no-such-topic"); err == nil {
		t.Fatal("unknown topic accepted")
	}
}

func TestDataDirExclusive(t *testing.T) {
	dir := t.TempDir()
	b := startTestBroker(t, BrokerConfig{DataDir: dir})
	b2, err := StartBroker(testCtx(t, 5*time.Second), BrokerConfig{DataDir: dir})
	if err == nil {
		_ = b2.Close()
		t.Fatal("second broker started on a data dir in use")
	}
	if !errors.Is(err, ErrDataDirInUse) {
		t.Fatalf("want ErrDataDirInUse, got %v", err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	startTestBroker(t, BrokerConfig{DataDir: dir}) // released by Close
}

// GroupLag reports every partition's committed offset and end; a group
// that never committed lags by everything, without an error.
func TestGroupLag(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{})
	cc := ClientConfig{Brokers: []string{b.Addr()}}
	createTopics(t, b.Addr(), TopicSpec{Name: "in", Partitions: 2})
	ctx := testCtx(t, 15*time.Second)
	w := newWriter(t, cc, "in", 0)
	w.Balancer = kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int { return int(m.Key[0] - '0') })
	for _, k := range []string{"0", "0", "0", "1"} {
		if err := w.WriteMessages(ctx, kafkago.Message{Key: []byte(k), Value: []byte("v")}); err != nil {
			t.Fatal(err)
		}
	}
	total := func() (n int64, committed int) {
		lags, err := GroupLag(ctx, cc, cc.Brokers, "g", []string{"in"})
		if err != nil {
			t.Fatal(err)
		}
		if len(lags) != 2 || lags[0].Partition != 0 || lags[1].Partition != 1 || lags[0].End != 3 || lags[1].End != 1 {
			t.Fatalf("lags %+v", lags)
		}
		for _, l := range lags {
			n += l.Lag()
			if l.Committed >= 0 {
				committed++
			}
		}
		return n, committed
	}
	if n, c := total(); n != 4 || c != 0 {
		t.Fatalf("before any commit: lag %d, %d partitions committed; want 4, 0", n, c)
	}
	r := groupReader(t, cc, "g", "in")
	m, err := r.FetchMessage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.CommitMessages(ctx, m); err != nil {
		t.Fatal(err)
	}
	_ = r.Close()
	if n, c := total(); n != 3 || c != 1 {
		t.Fatalf("after one commit: lag %d, %d partitions committed; want 3, 1", n, c)
	}
}
