package kafka

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
)

// BenchmarkWriteAcksAll measures synchronous acks=all produce throughput of
// kafka-go into the in-memory embedded broker: 32 messages of 16 KiB per
// WriteMessages call, 4 partitions.
func BenchmarkWriteAcksAll(b *testing.B) {
	br, err := StartBroker(b.Context(), BrokerConfig{})
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	if err := CreateTopics(b.Context(), ClientConfig{}, []string{br.Addr()}, []TopicSpec{{Name: "bench", Partitions: 4}}); err != nil {
		b.Fatal(err)
	}
	tr := &kafkago.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{
		Addr: kafkago.TCP(br.Addr()), Topic: "bench", Balancer: &kafkago.Hash{},
		RequiredAcks: kafkago.RequireAll, BatchTimeout: time.Millisecond, BatchSize: 32,
		BatchBytes: WriterBatchBytes(0), Transport: tr,
	}
	defer w.Close()
	val := bytes.Repeat([]byte{'t'}, 16<<10)
	msgs := make([]kafkago.Message, 32)
	for i := range msgs {
		msgs[i] = kafkago.Message{Key: fmt.Appendf(nil, "group-%d", i), Value: val}
	}
	b.SetBytes(int64(len(msgs) * len(val)))
	b.ResetTimer()
	for b.Loop() {
		if err := w.WriteMessages(b.Context(), msgs...); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*len(msgs))/b.Elapsed().Seconds(), "msgs/s")
}

// BenchmarkGroupFetchCommit measures a consumer-group reader fetching and
// committing (synchronously, per message) 16 KiB messages from the embedded
// broker.
func BenchmarkGroupFetchCommit(b *testing.B) {
	br, err := StartBroker(b.Context(), BrokerConfig{})
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	if err := CreateTopics(b.Context(), ClientConfig{}, []string{br.Addr()}, []TopicSpec{{Name: "bench"}}); err != nil {
		b.Fatal(err)
	}
	tr := &kafkago.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{Addr: kafkago.TCP(br.Addr()), Topic: "bench", RequiredAcks: kafkago.RequireAll,
		BatchTimeout: time.Millisecond, BatchSize: 256, BatchBytes: WriterBatchBytes(0), Transport: tr}
	defer w.Close()
	val := bytes.Repeat([]byte{'t'}, 16<<10)
	msgs := make([]kafkago.Message, 256)
	for i := range msgs {
		msgs[i] = kafkago.Message{Value: val}
	}
	r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: []string{br.Addr()}, GroupID: "bench", Topic: "bench",
		MinBytes: 1, MaxBytes: 8 << 20, MaxWait: 50 * time.Millisecond, SessionTimeout: MinGroupSessionTimeout,
		StartOffset: kafkago.FirstOffset})
	defer r.Close()
	b.SetBytes(int64(len(val)))
	b.ResetTimer()
	written := 0
	for i := 0; b.Loop(); i++ {
		if i == written {
			b.StopTimer()
			if err := w.WriteMessages(b.Context(), msgs...); err != nil {
				b.Fatal(err)
			}
			written += len(msgs)
			b.StartTimer()
		}
		m, err := r.FetchMessage(b.Context())
		if err != nil {
			b.Fatal(err)
		}
		if err := r.CommitMessages(b.Context(), m); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
}
