package bench

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/schemas"
)

// Baseline is the raw data movement of the same bytes: kafka-go producing
// (async, acks=all, the writer settings of the operator runtime) and a
// consumer-group reader consuming, with no operator work.
type Baseline struct {
	Seconds      float64 `json:"seconds"`
	Messages     int64   `json:"messages"`
	Bytes        int64   `json:"bytes"`
	MBPerS       float64 `json:"mb_s"`
	RecordsPerS  float64 `json:"records_per_s"`
	MeanMsgBytes float64 `json:"mean_message_bytes"`
	// TokensPerS is the trajectory tokens those bytes carry per second.
	TokensPerS float64 `json:"tokens_per_s"`
	// CPUCores is process CPU time / wall time; MBPerCPUS the bytes moved
	// per second of process CPU time (comparable across moments of a
	// shared machine).
	CPUCores  float64 `json:"cpu_cores"`
	MBPerCPUS float64 `json:"mb_per_cpu_s"`
	// PacedRate is the producer's pace in messages per second (0: unpaced).
	PacedRate float64 `json:"paced_msgs_per_s,omitempty"`
	// Client is the Kafka client library: kafka-go or franz-go.
	Client string `json:"client"`
	// CPUByRole is the window's CPU by role (Config.CPURoles), its MSPerMB
	// over Bytes: the broker, the raw client ("baseline") and the rest.
	CPUByRole []RoleCPU `json:"cpu_by_role,omitempty"`
}

// baselineMsg is one pre-encoded message of the baselines.
type baselineMsg struct {
	key, value []byte
	tokens     int64
}

// baselineMessages encodes the baselines' messages up front (at least 48 MB
// and 64 messages) from group indices distinct from the pipeline's, so a
// baseline measures data movement alone.
func (r *run) baselineMessages() ([]baselineMsg, float64, error) {
	var msgs []baselineMsg
	var total int64
	for g := int64(1 << 40); total < 48<<20 || len(msgs) < 64; g++ {
		rows := r.gen.Group(g)
		b, err := schemas.Trajectories.Encode(nil, rows)
		if err != nil {
			return nil, 0, fmt.Errorf("bench: baseline encode: %w", err)
		}
		var tok int64
		for i := range rows {
			for k := range rows[i].Turns {
				tu := &rows[i].Turns[k]
				tok += int64(len(tu.PromptIDs) + len(tu.ActionIDs) + len(tu.ObservationIDs))
			}
		}
		msgs = append(msgs, baselineMsg{[]byte(rows[0].GroupID), b, tok})
		total += int64(len(b))
	}
	return msgs, float64(total) / float64(len(msgs)), nil
}

// baseline measures kafka-go produce→consume of pre-encoded trajectory
// messages (the bytes the source produces) on topic for d, the producer
// paced to rate messages per second when rate > 0.
func (r *run) baseline(ctx context.Context, topic string, d time.Duration, rate float64) (*Baseline, error) {
	msgs, mean, err := r.baselineMessages()
	if err != nil {
		return nil, err
	}
	// Bound produced-but-unconsumed bytes (as the pipeline's closed loop
	// does) so retention never removes unread data.
	slots := make(chan struct{}, max(int((32<<20)/mean), 8))

	// The writer's transport goes with the baseline (closed after the
	// writer): its connection pool refreshes the metadata in a goroutine
	// of its own, which carries the baseline's profiler label and would be
	// charged to the baseline inside the pipeline's window.
	trans := r.trans()
	defer trans.CloseIdleConnections()
	w := &kafkago.Writer{
		Addr: kafkago.TCP(r.addr...), Topic: topic, Balancer: &kafkago.Murmur2Balancer{},
		RequiredAcks: kafkago.RequireAll, Async: true, BatchSize: 256, BatchTimeout: 2 * time.Millisecond,
		BatchBytes: kafka.WriterBatchBytes(r.cfg.Contract.Topics.MaxMessageBytes),
		// Its requests are charged to the role of ctx in CPU profiles.
		Transport: kafka.LabelRequests(ctx, trans),
	}
	var werr atomic.Value
	w.Completion = func(_ []kafkago.Message, err error) {
		if err != nil {
			werr.Store(err)
		}
	}
	rd := kafkago.NewReader(kafkago.ReaderConfig{
		Brokers: r.addr, GroupID: topic + ".consumer", GroupTopics: []string{topic}, Dialer: r.dialer,
		MinBytes: 1, MaxBytes: r.cfg.Contract.Topics.MaxMessageBytes + (1 << 20), MaxWait: kafka.FetchMaxWait,
		StartOffset: kafkago.FirstOffset, SessionTimeout: 10 * time.Second, HeartbeatInterval: time.Second,
		JoinGroupBackoff: 200 * time.Millisecond,
	})
	// Closed on every return, after the goroutines below have stopped: an
	// open group reader keeps its membership and dials the coordinator.
	defer rd.Close()
	defer w.Close()

	var consumed, consumedMsgs, consumedTok atomic.Int64
	var last sync.Map // partition -> kafkago.Message (offset only)
	cctx, stop := context.WithCancel(ctx)
	defer stop()
	var wg sync.WaitGroup
	errc := make(chan error, 3)
	wg.Add(3)
	go func() { // producer
		defer wg.Done()
		next := time.Now()
		for i := 0; ; i++ {
			select {
			case <-cctx.Done():
				return
			case slots <- struct{}{}:
			}
			if rate > 0 {
				next = next.Add(time.Duration(float64(time.Second) / rate))
				if err := sleepUntil(cctx, next); err != nil {
					return
				}
			}
			if err, _ := werr.Load().(error); err != nil {
				errc <- fmt.Errorf("bench: baseline produce: %w", err)
				return
			}
			m := msgs[i%len(msgs)]
			if err := w.WriteMessages(cctx, kafkago.Message{Key: m.key, Value: m.value}); err != nil {
				if cctx.Err() == nil {
					errc <- fmt.Errorf("bench: baseline produce: %w", err)
				}
				return
			}
		}
	}()
	tokOf := map[string]int64{}
	for _, m := range msgs {
		tokOf[string(m.key)] = m.tokens
	}
	go func() { // consumer
		defer wg.Done()
		for {
			m, err := rd.FetchMessage(cctx)
			if err != nil {
				// A fresh cluster answers with a retriable error until its
				// offsets topic exists (group coordinator not available).
				var ke kafkago.Error
				if errors.As(err, &ke) && ke.Temporary() && cctx.Err() == nil {
					time.Sleep(200 * time.Millisecond)
					continue
				}
				if cctx.Err() == nil {
					errc <- fmt.Errorf("bench: baseline consume: %w", err)
				}
				return
			}
			consumed.Add(int64(len(m.Value) + len(m.Key)))
			consumedMsgs.Add(1)
			consumedTok.Add(tokOf[string(m.Key)])
			last.Store(m.Partition, kafkago.Message{Topic: m.Topic, Partition: m.Partition, Offset: m.Offset})
			<-slots
		}
	}()
	go func() { // committer, like the operator runtime's commit loop
		defer wg.Done()
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-cctx.Done():
				return
			case <-t.C:
				var cs []kafkago.Message
				last.Range(func(_, v any) bool { cs = append(cs, v.(kafkago.Message)); return true })
				if len(cs) > 0 {
					_ = rd.CommitMessages(cctx, cs...)
				}
			}
		}
	}()

	// Warm up (group join, connections), then measure.
	warm := min(d/4, 2*time.Second)
	progress := func(phase string, total time.Duration) error {
		start := time.Now()
		for time.Since(start) < total {
			select {
			case err := <-errc:
				return err
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(250 * time.Millisecond):
			}
			if r.cfg.Progress != nil {
				r.cfg.Progress(Progress{Phase: phase, Elapsed: time.Since(start), Total: total})
			}
		}
		return nil
	}
	if err := progress("baseline", warm); err != nil {
		stop()
		wg.Wait()
		return nil, err
	}
	// On a loaded machine the group join can take longer than the warm-up:
	// measure only once the reader consumes (bounded).
	for deadline := time.Now().Add(30 * time.Second); consumedMsgs.Load() == 0 && time.Now().Before(deadline); {
		if err := progress("baseline", 250*time.Millisecond); err != nil {
			stop()
			wg.Wait()
			return nil, err
		}
	}
	prof, err := startWindowProfile(r.cfg.CPURoles)
	if err != nil {
		stop()
		wg.Wait()
		return nil, err
	}
	b0, m0, k0, t0, c0 := consumed.Load(), consumedMsgs.Load(), consumedTok.Load(), time.Now(), r.cpu()
	err = progress("baseline", d)
	b1, m1, k1, secs, cpu := consumed.Load(), consumedMsgs.Load(), consumedTok.Load(), time.Since(t0).Seconds(), (r.cpu() - c0).Seconds()
	roles, profErr := prof.stop()
	stop()
	wg.Wait()
	if err = errors.Join(err, profErr); err != nil {
		return nil, err
	}
	if m1 == m0 {
		return nil, fmt.Errorf("bench: baseline consumed nothing in %v", d)
	}
	return &Baseline{
		Seconds: secs, Messages: m1 - m0, Bytes: b1 - b0,
		MBPerS: float64(b1-b0) / secs / 1e6, RecordsPerS: float64(m1-m0) / secs,
		MeanMsgBytes: mean, TokensPerS: float64(k1-k0) / secs,
		CPUCores: cpu / secs, MBPerCPUS: float64(b1-b0) / max(cpu, 1e-9) / 1e6, PacedRate: rate, Client: "kafka-go",
		CPUByRole: roleTable(roles, b1-b0),
	}, nil
}

// sleepUntil waits for t or the end of ctx.
func sleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err()
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-tm.C:
		return nil
	}
}
