package pipeline

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/trajflow/trajflow/schemas"
)

func startCluster(t testing.TB, topics ...string) string {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(2, topics...))
	if err != nil {
		t.Fatalf("start broker: %v", err)
	}
	t.Cleanup(c.Close)
	return c.ListenAddrs()[0]
}

func produce(t testing.TB, addr, topic string, vals ...[]byte) {
	t.Helper()
	tr := &kafka.Transport{} // not DefaultTransport, whose pools outlive the writer
	defer tr.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(addr), Topic: topic, RequiredAcks: kafka.RequireAll, Balancer: &kafka.Murmur2Balancer{}, BatchTimeout: time.Millisecond, Transport: tr}
	defer w.Close()
	msgs := make([]kafka.Message, len(vals))
	for i, v := range vals {
		msgs[i] = kafka.Message{Key: []byte(strconv.Itoa(i % 7)), Value: v}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatalf("produce: %v", err)
	}
}

// drain reads every record of topic (all partitions) until n are read or
// the deadline passes.
func drain(t *testing.T, addr, topic string, n int) []kafka.Message {
	t.Helper()
	var out []kafka.Message
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for p := 0; p < 2; p++ {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: []string{addr}, Topic: topic, Partition: p, MaxWait: 50 * time.Millisecond})
		conn, err := kafka.DialLeader(ctx, "tcp", addr, topic, p)
		if err != nil {
			t.Fatalf("dial: %v", err)
		}
		last, err := conn.ReadLastOffset()
		conn.Close()
		if err != nil {
			t.Fatalf("last offset: %v", err)
		}
		for i := int64(0); i < last; i++ {
			m, err := r.ReadMessage(ctx)
			if err != nil {
				t.Fatalf("read %s/%d: %v", topic, p, err)
			}
			out = append(out, m)
		}
		r.Close()
	}
	if n >= 0 && len(out) != n {
		t.Fatalf("%s holds %d records, want %d", topic, len(out), n)
	}
	return out
}

// upper is a stateless stage: it upper-cases ASCII and refuses "bad".
type upper struct{}

func (upper) Name() string     { return "upper" }
func (upper) Topics() []string { return []string{"in"} }
func (upper) Process(_ context.Context, m Message) (Result, error) {
	if bytes.HasPrefix(m.Value, []byte("bad")) {
		return Result{}, Refuse("bad_input", "value %q", m.Value)
	}
	return Result{Outputs: []Output{{Topic: "out", Key: m.Key, Value: bytes.ToUpper(m.Value)}}}, nil
}

func testConfig(addr string) Config {
	return Config{
		Brokers:         []string{addr},
		QuarantineTopic: "quarantine",
		Logger:          slog.New(slog.NewTextHandler(io.Discard, nil)),
		CommitInterval:  20 * time.Millisecond,
	}
}

// runUntil runs op until cond holds, then stops it gracefully.
func runUntil(t *testing.T, op *Operator, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- op.Run(ctx) }()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			cancel()
			<-done
			t.Fatal("condition not reached in time")
		}
		select {
		case err := <-done:
			t.Fatalf("operator exited early: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
	cancel()
	if err := <-done; !errors.Is(err, ErrStopped) {
		t.Fatalf("Run = %v, want ErrStopped", err)
	}
}

func lastOffsets(t testing.TB, addr, topic string) int64 {
	t.Helper()
	var total int64
	for p := 0; p < 2; p++ {
		conn, err := kafka.DialLeader(context.Background(), "tcp", addr, topic, p)
		if err != nil {
			t.Fatal(err)
		}
		last, err := conn.ReadLastOffset()
		conn.Close()
		if err != nil {
			t.Fatal(err)
		}
		total += last
	}
	return total
}

func committed(t *testing.T, addr, group, topic string) int64 {
	t.Helper()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	client := &kafka.Client{Addr: kafka.TCP(addr), Timeout: 10 * time.Second, Transport: tr}
	resp, err := client.OffsetFetch(context.Background(), &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: {0, 1}}})
	if err != nil {
		t.Fatalf("offset fetch: %v", err)
	}
	var total int64
	for _, p := range resp.Topics[topic] {
		if p.CommittedOffset > 0 {
			total += p.CommittedOffset
		}
	}
	return total
}

func TestOperatorProducesQuarantinesAndCommits(t *testing.T) {
	addr := startCluster(t, "in", "out", "quarantine")
	var vals [][]byte
	for i := 0; i < 200; i++ {
		v := fmt.Sprintf("rec-%03d", i)
		if i%50 == 7 {
			v = "bad-" + v
		}
		vals = append(vals, []byte(v))
	}
	produce(t, addr, "in", vals...)
	op, err := NewOperator(testConfig(addr), upper{})
	if err != nil {
		t.Fatal(err)
	}
	runUntil(t, op, func() bool { return lastOffsets(t, addr, "out")+lastOffsets(t, addr, "quarantine") >= 200 })

	out := drain(t, addr, "out", 196)
	seen := map[string]bool{}
	for _, m := range out {
		if seen[string(m.Value)] {
			t.Fatalf("duplicate output %q", m.Value)
		}
		seen[string(m.Value)] = true
	}
	q := drain(t, addr, "quarantine", 4)
	for _, m := range q {
		hs := map[string]string{}
		for _, h := range m.Headers {
			hs[h.Key] = string(h.Value)
		}
		if !bytes.HasPrefix(m.Value, []byte("bad-")) || hs[schemas.HeaderReason] != "bad_input" || hs[schemas.HeaderSourceTopic] != "in" || hs[schemas.HeaderSourceOffset] == "" {
			t.Fatalf("quarantine record %q headers %v", m.Value, hs)
		}
	}
	if got := committed(t, addr, "trajflow-upper", "in"); got != 200 {
		t.Fatalf("committed offsets sum = %d, want 200", got)
	}
}

// holder holds every record until it has seen three with the same key, then
// emits one output and releases all three: the shape of group assembly.
type holder struct {
	open map[string][]Message
}

func (*holder) Name() string     { return "holder" }
func (*holder) Topics() []string { return []string{"in"} }
func (h *holder) Process(_ context.Context, m Message) (Result, error) {
	k := string(m.Key)
	h.open[k] = append(h.open[k], m)
	if len(h.open[k]) < 3 {
		return Result{Hold: true}, nil
	}
	var refs []Ref
	var vals [][]byte
	for _, x := range h.open[k] {
		refs = append(refs, x.Ref)
		vals = append(vals, x.Value)
	}
	delete(h.open, k)
	return Result{Hold: true, Release: refs, Outputs: []Output{{Topic: "out", Key: m.Key, Value: bytes.Join(vals, []byte(","))}}}, nil
}

func TestOperatorHoldsUncommittedUntilReleased(t *testing.T) {
	addr := startCluster(t, "in", "out", "quarantine")
	// Keys 0..6 cycle; 20 records: keys 0..5 get 3 each (released after 21?).
	var vals [][]byte
	for i := 0; i < 20; i++ {
		vals = append(vals, []byte("v"+strconv.Itoa(i)))
	}
	produce(t, addr, "in", vals...)
	h := &holder{open: map[string][]Message{}}
	op, err := NewOperator(testConfig(addr), h)
	if err != nil {
		t.Fatal(err)
	}
	// Keys i%7 over 20 records: keys 0..5 appear 3 times, key 6 twice.
	runUntil(t, op, func() bool { return lastOffsets(t, addr, "out") >= 6 })
	drain(t, addr, "out", 6)
	// Key 6's two records are held: their partition cannot commit past them.
	if got := committed(t, addr, "trajflow-holder", "in"); got >= 20 {
		t.Fatalf("committed %d offsets although two records are still held", got)
	}
	// A restart with a fresh (lost) state rebuilds from redelivery: key 6
	// completes once a third record arrives.
	produce(t, addr, "in", []byte("x"), []byte("y"), []byte("z"), []byte("w"), []byte("u"), []byte("s"), []byte("late"))
	h2 := &holder{open: map[string][]Message{}}
	op2, err := NewOperator(testConfig(addr), h2)
	if err != nil {
		t.Fatal(err)
	}
	runUntil(t, op2, func() bool {
		for _, m := range drain(t, addr, "out", -1) {
			if bytes.Contains(m.Value, []byte("late")) {
				return true
			}
		}
		return false
	})
	var found bool
	for _, m := range drain(t, addr, "out", -1) {
		if string(m.Key) == "6" && bytes.Equal(m.Value, []byte("v6,v13,late")) {
			found = true
		}
	}
	if !found {
		t.Fatal("group of key 6 was not rebuilt from redelivered records")
	}
}

func TestScanTailReadsLastRecords(t *testing.T) {
	addr := startCluster(t, "in")
	var vals [][]byte
	for i := 0; i < 40; i++ {
		vals = append(vals, []byte("v"+strconv.Itoa(i)))
	}
	produce(t, addr, "in", vals...)
	cfg := testConfig(addr)
	cfg.defaults()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var all, tail int
	if err := ScanTail(ctx, &cfg, "in", 0, func(Message) error { all++; return nil }); err != nil {
		t.Fatal(err)
	}
	if err := ScanTail(ctx, &cfg, "in", 3, func(Message) error { tail++; return nil }); err != nil {
		t.Fatal(err)
	}
	if all != 40 || tail != 6 {
		t.Fatalf("scanned all=%d (want 40) tail=%d (want 3 per partition = 6)", all, tail)
	}
}

func TestHealthAndMetrics(t *testing.T) {
	addr := startCluster(t, "in", "out", "quarantine")
	produce(t, addr, "in", []byte("a"), []byte("bad"), []byte("c"))
	cfg := testConfig(addr)
	cfg.Metrics = NewMetrics(nil)
	op, err := NewOperator(cfg, upper{})
	if err != nil {
		t.Fatal(err)
	}
	hs, err := NewHealthServer("127.0.0.1:0", cfg.Metrics, op)
	if err != nil {
		t.Fatal(err)
	}
	hctx, stop := context.WithCancel(context.Background())
	defer stop()
	go func() { _ = hs.Serve(hctx) }()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + hs.Addr() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := get("/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz before start = %d, want 503", code)
	}
	runUntil(t, op, func() bool {
		_, body := get("/metrics")
		return strings.Contains(body, `trajflow_records_in_total{replica="",stage="upper"} 3`)
	})
	_, body := get("/metrics")
	for _, want := range []string{
		`trajflow_records_quarantined_total{reason="bad_input",replica="",stage="upper"} 1`,
		`trajflow_records_out_total{replica="",stage="upper",topic="out"} 2`,
		`trajflow_consumer_lag_records{`, `trajflow_in_flight_records{`, `trajflow_backpressure_seconds_total{`, `trajflow_commit_duration_seconds_count{`,
		`go_goroutines `, `trajflow_build_info{`, `go_build_info{`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if code, _ := get("/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz = %d", code)
	}
	hs.SetDraining()
	if code, _ := get("/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz while draining = %d, want 503", code)
	}
}

// poisoner writes each output from its own buffer and, when the runtime
// releases it, overwrites the buffer: an output released before its write
// completed would reach the topic corrupted.
type poisoner struct {
	mu       sync.Mutex
	released map[string]int
}

func (*poisoner) Name() string     { return "poisoner" }
func (*poisoner) Topics() []string { return []string{"in"} }
func (p *poisoner) Process(_ context.Context, m Message) (Result, error) {
	buf := bytes.Repeat(m.Value, 64)
	key := string(m.Value)
	return Result{Outputs: []Output{{Topic: "out", Key: m.Key, Value: buf, Release: func() {
		for i := range buf {
			buf[i] = 'X'
		}
		p.mu.Lock()
		p.released[key]++
		p.mu.Unlock()
	}}}}, nil
}

func TestOperatorReleasesOutputsAfterTheirWrite(t *testing.T) {
	addr := startCluster(t, "in", "out", "quarantine")
	var vals [][]byte
	for i := 0; i < 300; i++ {
		vals = append(vals, []byte(fmt.Sprintf("rec-%03d", i)))
	}
	produce(t, addr, "in", vals...)
	st := &poisoner{released: map[string]int{}}
	op, err := NewOperator(testConfig(addr), st)
	if err != nil {
		t.Fatal(err)
	}
	runUntil(t, op, func() bool { return lastOffsets(t, addr, "out") >= 300 })
	for _, m := range drain(t, addr, "out", 300) {
		if want := bytes.Repeat(m.Value[:7], 64); !bytes.HasPrefix(m.Value, []byte("rec-")) || !bytes.Equal(m.Value, want) {
			t.Fatalf("output corrupted by an early release: %q...", m.Value[:min(len(m.Value), 40)])
		}
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if len(st.released) != 300 {
		t.Fatalf("%d outputs released, want 300", len(st.released))
	}
	for k, n := range st.released {
		if n != 1 {
			t.Fatalf("output %s released %d times", k, n)
		}
	}
}

// lineageFirst writes, for each input, a record to "first" and then one to
// "second" marked After (the shape of pack's window record and batch).
type lineageFirst struct{}

func (lineageFirst) Name() string     { return "lineage" }
func (lineageFirst) Topics() []string { return []string{"in"} }
func (lineageFirst) Process(_ context.Context, m Message) (Result, error) {
	return Result{Outputs: []Output{
		{Topic: "first", Key: m.Key, Value: m.Value},
		{Topic: "second", Key: m.Key, Value: m.Value, After: true},
	}}, nil
}

// TestOutputAfterWaitsForTheEarlierOutputs: an output marked After is
// written only once the outputs before it are acknowledged. With every
// write to "first" refused by the broker, the operator fails and "second"
// holds nothing (an async writer would have written it beside the failed
// one); without the fault both topics get every record.
func TestOutputAfterWaitsForTheEarlierOutputs(t *testing.T) {
	for _, refuse := range []bool{false, true} {
		t.Run(fmt.Sprintf("first refused %v", refuse), func(t *testing.T) {
			c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(2, "in", "first", "second", "quarantine"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(c.Close)
			addr := c.ListenAddrs()[0]
			produce(t, addr, "in", []byte("a"), []byte("b"), []byte("c"))
			if refuse {
				c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "first", Err: kerr.TopicAuthorizationFailed, Count: -1})
			}
			cfg := testConfig(addr)
			cfg.ProduceRetryWindow = time.Second
			op, err := NewOperator(cfg, lineageFirst{})
			if err != nil {
				t.Fatal(err)
			}
			if !refuse {
				runUntil(t, op, func() bool { return lastOffsets(t, addr, "second") >= 3 })
				drain(t, addr, "first", 3)
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			err = op.Run(ctx)
			if err == nil || errors.Is(err, ErrStopped) || ctx.Err() != nil {
				t.Fatalf("Run = %v, want the produce failure", err)
			}
			if n := lastOffsets(t, addr, "second"); n != 0 {
				t.Fatalf("second holds %d records written before the outputs they come after were acknowledged (Run: %v)", n, err)
			}
			t.Logf("Run: %v", err)
		})
	}
}

// dealer pins its i-th input's output to partition i (modulo the topic's
// two), and every record with an odd value to the key's hash: the shape of
// dispatch dealing groups out to rollout workers.
type dealer struct{ n int }

func (*dealer) Name() string     { return "dealer" }
func (*dealer) Topics() []string { return []string{"in"} }
func (d *dealer) Process(_ context.Context, m Message) (Result, error) {
	i, err := strconv.Atoi(string(m.Value))
	if err != nil {
		return Result{}, err
	}
	out := Output{Topic: "out", Key: []byte("same-key"), Value: m.Value}
	if i%2 == 0 {
		out.Pinned, out.Partition = true, i/2
	}
	return Result{Outputs: []Output{out}}, nil
}

// TestPinnedOutputsLandOnTheirPartition: a pinned output goes to partition
// Partition modulo the topic's partitions, whatever its key; the others
// where their key hashes (one partition for one key).
func TestPinnedOutputsLandOnTheirPartition(t *testing.T) {
	addr := startCluster(t, "in", "out", "quarantine")
	var vals [][]byte
	for i := 0; i < 40; i++ {
		vals = append(vals, []byte(strconv.Itoa(i)))
	}
	produce(t, addr, "in", vals...)
	op, err := NewOperator(testConfig(addr), &dealer{})
	if err != nil {
		t.Fatal(err)
	}
	runUntil(t, op, func() bool { return lastOffsets(t, addr, "out") >= 40 })
	hashed := map[int]int{}
	for _, m := range drain(t, addr, "out", 40) {
		i, _ := strconv.Atoi(string(m.Value))
		if i%2 == 1 {
			hashed[m.Partition]++
			continue
		}
		if want := (i / 2) % 2; m.Partition != want {
			t.Errorf("pinned record %d on partition %d, want %d", i, m.Partition, want)
		}
	}
	if len(hashed) != 1 {
		t.Errorf("records of one key not pinned spread over partitions %v, want one", hashed)
	}
}

func TestPinnedBalancer(t *testing.T) {
	var b pinnedBalancer
	for _, tc := range []struct {
		partition  int
		partitions []int
		want       int
	}{{0, []int{0, 1, 2}, 0}, {4, []int{0, 1, 2}, 1}, {5, []int{0, 1, 2, 3, 4, 5}, 5}, {7, []int{3}, 3}} {
		m := kafka.Message{Key: []byte("k"), WriterData: &pinned{partition: tc.partition}}
		if got := b.Balance(m, tc.partitions...); got != tc.want {
			t.Errorf("pinned %d over %v: partition %d, want %d", tc.partition, tc.partitions, got, tc.want)
		}
	}
	m := kafka.Message{Key: []byte("some key"), WriterData: &ackGroup{}}
	if got, want := b.Balance(m, 0, 1, 2, 3), (&kafka.Murmur2Balancer{}).Balance(m, 0, 1, 2, 3); got != want {
		t.Errorf("unpinned record: partition %d, want murmur2's %d", got, want)
	}
}

// TestBackpressureCounted runs an operator whose bound admits one record
// in flight: every output after the first waits for the previous one's
// acknowledgement, and trajflow_backpressure_seconds_total counts the
// waits; all records still come through.
func TestBackpressureCounted(t *testing.T) {
	addr := startCluster(t, "in", "out", "quarantine")
	var vals [][]byte
	for i := 0; i < 60; i++ {
		vals = append(vals, []byte(fmt.Sprintf("rec-%02d", i)))
	}
	produce(t, addr, "in", vals...)
	cfg := testConfig(addr)
	cfg.Metrics = NewMetrics(nil)
	cfg.MaxInFlightRecords = 1
	op, err := NewOperator(cfg, upper{})
	if err != nil {
		t.Fatal(err)
	}
	counter := func(name string) float64 {
		mfs, err := cfg.Metrics.Registry.Gather()
		if err != nil {
			t.Fatal(err)
		}
		var v float64
		for _, mf := range mfs {
			if mf.GetName() == name {
				for _, m := range mf.GetMetric() {
					v += m.GetCounter().GetValue()
				}
			}
		}
		return v
	}
	runUntil(t, op, func() bool { return counter("trajflow_records_out_total") == 60 })
	if w := counter("trajflow_backpressure_seconds_total"); w <= 0 {
		t.Fatalf("60 records through a bound of one in flight: backpressure %v s, want > 0", w)
	}
}
