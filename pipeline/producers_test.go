package pipeline

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/kversion"
)

// fanout copies every input to two topics: "out" (compressed in the test)
// and "plain".
type fanout struct{}

func (fanout) Name() string     { return "fanout" }
func (fanout) Topics() []string { return []string{"in"} }
func (fanout) Process(_ context.Context, m Message) (Result, error) {
	return Result{Outputs: []Output{
		{Topic: "out", Key: m.Key, Value: m.Value},
		{Topic: "plain", Key: m.Key, Value: m.Value},
	}}, nil
}

// batchCodecs returns the compression codec (attributes & 7: 0 none,
// 1 gzip, 2 snappy, 3 lz4, 4 zstd) of every record batch the broker holds
// for topic, read with a raw Fetch so that no client decompresses them.
func batchCodecs(t *testing.T, addr, topic string) []int8 {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addr), kgo.MaxVersions(kversion.V3_0_0())) // Fetch by topic name
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := kmsg.NewPtrFetchRequest()
	req.MaxWaitMillis, req.MaxBytes = 100, 64<<20
	ft := kmsg.NewFetchRequestTopic()
	ft.Topic = topic
	for p := int32(0); p < 2; p++ {
		fp := kmsg.NewFetchRequestTopicPartition()
		fp.Partition, fp.PartitionMaxBytes = p, 32<<20
		ft.Partitions = append(ft.Partitions, fp)
	}
	req.Topics = append(req.Topics, ft)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		t.Fatalf("fetch %s: %v", topic, err)
	}
	var codecs []int8
	for _, rt := range resp.Topics {
		for _, rp := range rt.Partitions {
			if rp.ErrorCode != 0 {
				t.Fatalf("fetch %s/%d: error code %d", topic, rp.Partition, rp.ErrorCode)
			}
			for raw := rp.RecordBatches; len(raw) > 0; {
				var b kmsg.RecordBatch
				if err := b.ReadFrom(raw); err != nil {
					t.Fatalf("record batch of %s/%d: %v", topic, rp.Partition, err)
				}
				codecs = append(codecs, int8(b.Attributes&7))
				raw = raw[12+int(b.Length):]
			}
		}
	}
	return codecs
}

// A topic with a codec is produced compressed, the others are not, and
// consumers read the same bytes from both.
func TestOperatorCompressesTheTopicsConfigured(t *testing.T) {
	addr := startCluster(t, "in", "out", "plain", "quarantine")
	var vals [][]byte
	for i := range 60 {
		vals = append(vals, bytes.Repeat([]byte(fmt.Sprintf("record %03d, compressible; ", i)), 200))
	}
	produce(t, addr, "in", vals...)
	cfg := testConfig(addr)
	cfg.Compression = map[string]kafka.Compression{"out": kafka.Snappy}
	op, err := NewOperator(cfg, fanout{})
	if err != nil {
		t.Fatal(err)
	}
	runUntil(t, op, func() bool { return lastOffsets(t, addr, "out") >= 60 && lastOffsets(t, addr, "plain") >= 60 })

	for _, topic := range []string{"out", "plain"} {
		var got [][]byte
		for _, m := range drain(t, addr, topic, 60) {
			got = append(got, m.Value)
		}
		slices.SortFunc(got, bytes.Compare)
		for i := range got {
			if !bytes.Equal(got[i], vals[i]) {
				t.Fatalf("%s record %d: %d bytes %.30q, want %.30q", topic, i, len(got[i]), got[i], vals[i])
			}
		}
	}
	want := map[string]int8{"out": 2, "plain": 0}
	for topic, codec := range want {
		codecs := batchCodecs(t, addr, topic)
		if len(codecs) == 0 {
			t.Fatalf("%s: no record batch fetched", topic)
		}
		for _, c := range codecs {
			if c != codec {
				t.Fatalf("%s: record batch codecs %v, want all %d", topic, codecs, codec)
			}
		}
	}
}

// Records of one call go to their codec's writer in their order; a call of
// one writer's topics makes one WriteMessages call.
func TestProducersRouteByTopic(t *testing.T) {
	var built []kafka.Compression
	p := newProducers(map[string]kafka.Compression{"a": kafka.Lz4, "b": kafka.Lz4, "c": kafka.Zstd},
		func(c kafka.Compression) *kafka.Writer {
			built = append(built, c)
			return &kafka.Writer{Compression: c}
		})
	slices.Sort(built)
	if !slices.Equal(built, []kafka.Compression{0, kafka.Lz4, kafka.Zstd}) {
		t.Fatalf("writers built for codecs %v, want none, lz4 and zstd once each", built)
	}
	for topic, want := range map[string]kafka.Compression{"a": kafka.Lz4, "b": kafka.Lz4, "c": kafka.Zstd, "d": 0} {
		if got := p.of(topic).Compression; got != want {
			t.Errorf("topic %s goes to the writer of codec %v, want %v", topic, got, want)
		}
	}
}
