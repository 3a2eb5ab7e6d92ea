package pipeline

import (
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

// copyStage forwards every record unchanged: the runtime's own cost.
type copyStage struct{}

func (copyStage) Name() string     { return "copy" }
func (copyStage) Topics() []string { return []string{"in"} }
func (copyStage) Process(_ context.Context, m Message) (Result, error) {
	return Result{Outputs: []Output{{Topic: "out", Key: m.Key, Value: m.Value}}}, nil
}

// BenchmarkOperatorVsRaw moves the same records (64 KiB each) from one
// topic to another on the embedded broker twice in one run: with raw
// kafka-go (group reader + async writer, no commit bookkeeping) and with an
// operator (the runtime: holds, acks, contiguous commits, flow control).
// It reports both rates and their ratio.
func BenchmarkOperatorVsRaw(b *testing.B) {
	const n, size = 1000, 64 << 10
	val := make([]byte, size)
	for i := range val {
		val[i] = byte(i)
	}
	var rawSec, opSec float64
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		addr := startCluster(b, "in", "out", "raw-out", "quarantine")
		vals := make([][]byte, n)
		for j := range vals {
			vals[j] = val
		}
		produce(b, addr, "in", vals...)
		b.StartTimer()

		// Alternate which runs first so neither always meets a cold broker.
		runRaw := func() {
			rawSec += rawCopy(b, addr, n).Seconds()
		}
		runOp := func() {
			cfg := testConfig(addr)
			cfg.MaxMessageBytes = 1 << 20 // the test cluster's default message.max.bytes
			op, err := NewOperator(cfg, copyStage{})
			if err != nil {
				b.Fatal(err)
			}
			start := time.Now()
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- op.Run(ctx) }()
			for lastOffsets(b, addr, "out") < n {
				select {
				case err := <-done:
					b.Fatalf("operator stopped: %v", err)
				case <-time.After(5 * time.Millisecond):
				}
			}
			opSec += time.Since(start).Seconds()
			cancel()
			<-done
		}
		if i%2 == 0 {
			runRaw()
			runOp()
		} else {
			runOp()
			runRaw()
		}
	}
	mb := float64(b.N*n*size) / 1e6
	b.ReportMetric(mb/rawSec, "raw_MB/s")
	b.ReportMetric(mb/opSec, "operator_MB/s")
	b.ReportMetric(float64(b.N*n)/opSec, "operator_records/s")
	b.ReportMetric(rawSec/opSec, "ratio_operator/raw")
}

// rawCopy copies n records from "in" to "raw-out" and returns the time
// until the last one is acknowledged (closing the clients is not counted,
// as for the operator).
func rawCopy(b *testing.B, addr string, n int) time.Duration {
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: []string{addr}, GroupID: "raw", GroupTopics: []string{"in"},
		MinBytes: 1, MaxBytes: 2 << 20, MaxWait: 100 * time.Millisecond, StartOffset: kafka.FirstOffset,
		ReadBackoffMin: 10 * time.Millisecond, ReadBackoffMax: 200 * time.Millisecond,
		HeartbeatInterval: time.Second, SessionTimeout: 10 * time.Second})
	defer r.Close()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(addr), Topic: "raw-out", Async: true, RequiredAcks: kafka.RequireAll,
		BatchTimeout: 2 * time.Millisecond, BatchBytes: 1 << 20, BatchSize: 256, Transport: tr}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	for i := 0; i < n; i++ {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if err := w.WriteMessages(ctx, kafka.Message{Key: m.Key, Value: m.Value}); err != nil {
			b.Fatal(err)
		}
	}
	if err := w.Close(); err != nil { // flushes and waits for every ack
		b.Fatal(err)
	}
	return time.Since(start)
}
