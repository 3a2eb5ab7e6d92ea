package bench

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/internal/testkit"
)

// The franz-go baseline writes uncompressed batches, as the operators'
// kafka-go writer does: a row that compressed would price a codec, not the
// client. The value is all zeros, which snappy would shrink.
func TestFranzBaselineProducesUncompressed(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	addr := testkit.StartBroker(t)
	const topic = "franz-baseline"
	if err := kafka.CreateTopics(ctx, kafka.ClientConfig{}, []string{addr},
		[]kafka.TopicSpec{{Name: topic, Partitions: 1}}); err != nil {
		t.Fatal(err)
	}
	prod, err := kgo.NewClient(franzProducerOpts([]string{addr}, topic, 1<<20)...)
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close()
	value := make([]byte, 64<<10)
	if err := prod.ProduceSync(ctx, &kgo.Record{Key: []byte("k"), Value: value}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	cons, err := kgo.NewClient(kgo.SeedBrokers(addr), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cons.Close()
	for {
		fs := cons.PollFetches(ctx)
		if err := fs.Err0(); err != nil {
			t.Fatal(err)
		}
		recs := fs.Records()
		if len(recs) == 0 {
			continue
		}
		if c := recs[0].Attrs.CompressionType(); c != 0 {
			t.Fatalf("baseline batch compression codec %d, want 0 (none)", c)
		}
		if !bytes.Equal(recs[0].Value, value) {
			t.Fatalf("value of %d bytes read back differs", len(recs[0].Value))
		}
		return
	}
}
