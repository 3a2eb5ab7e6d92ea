package kafka

import (
	"errors"
	"maps"
	"strings"
	"testing"

	kafkago "github.com/segmentio/kafka-go"
)

func TestCompression(t *testing.T) {
	want := map[string]kafkago.Compression{"none": 0, "gzip": kafkago.Gzip, "snappy": kafkago.Snappy, "lz4": kafkago.Lz4, "zstd": kafkago.Zstd}
	if len(want) != len(CompressionCodecs) {
		t.Fatalf("CompressionCodecs %v, want the %d codecs of this table", CompressionCodecs, len(want))
	}
	for _, name := range CompressionCodecs {
		got, err := Compression(name)
		if err != nil || got != want[name] {
			t.Errorf("Compression(%q) = %v, %v; want %v", name, got, err, want[name])
		}
		// The codec's own name is Kafka's compression.type name.
		if got != 0 && got.String() != name {
			t.Errorf("codec %q is kafka-go's %q", name, got.String())
		}
	}
	for _, bad := range []string{"", "LZ4", "brotli"} {
		if _, err := Compression(bad); !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), "none, gzip, snappy, lz4, zstd") {
			t.Errorf("Compression(%q) error %v, want ErrInvalidConfig listing the codecs", bad, err)
		}
	}
}

func TestTopicCompression(t *testing.T) {
	full := func(short string) string { return "run." + short }
	got, err := TopicCompression(map[string]string{"batches": "snappy", "census": "zstd", "valid": "none"}, full)
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]kafkago.Compression{"run.batches": kafkago.Snappy, "run.census": kafkago.Zstd}; !maps.Equal(got, want) {
		t.Fatalf("TopicCompression = %v, want %v (none left out)", got, want)
	}
	if _, err := TopicCompression(map[string]string{"census": "brotli"}, full); err == nil || !strings.Contains(err.Error(), "topic census") {
		t.Fatalf("unknown codec: error %v, want one naming the topic", err)
	}
	if c := CompressionOf(map[string]string{"policy": "lz4"}, "policy"); c != kafkago.Lz4 {
		t.Fatalf("CompressionOf(policy) = %v, want lz4", c)
	}
	if c := CompressionOf(map[string]string{"policy": "lz4"}, "census"); c != 0 {
		t.Fatalf("CompressionOf(census) = %v, want none", c)
	}
}
