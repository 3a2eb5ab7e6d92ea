package kafka

import (
	"fmt"
	"strings"

	kafkago "github.com/segmentio/kafka-go"
)

// CompressionCodecs are the producer compression codecs a topic can use
// (the contract's topics.compression), by Kafka's compression.type names.
// Compression is a property of the record batches on the wire and in the
// broker's log only: every Kafka client decompresses transparently, and a
// consumer reads the same value bytes whatever the producer chose.
var CompressionCodecs = []string{"none", "gzip", "snappy", "lz4", "zstd"}

// Compression returns kafka-go's codec of a compression.type name (none: 0,
// no compression), or an error naming the codecs there are.
func Compression(name string) (kafkago.Compression, error) {
	switch name {
	case "none":
		return 0, nil
	case "gzip":
		return kafkago.Gzip, nil
	case "snappy":
		return kafkago.Snappy, nil
	case "lz4":
		return kafkago.Lz4, nil
	case "zstd":
		return kafkago.Zstd, nil
	}
	return 0, fmt.Errorf("%w: compression %q: want one of %s", ErrInvalidConfig, name, strings.Join(CompressionCodecs, ", "))
}

// TopicCompression maps the full topic names of byShort (short topic name
// -> codec name, as the contract's topics.compression) to kafka-go codecs;
// full gives a short name's topic. Topics it leaves out are not compressed.
func TopicCompression(byShort map[string]string, full func(short string) string) (map[string]kafkago.Compression, error) {
	out := make(map[string]kafkago.Compression, len(byShort))
	for short, name := range byShort {
		c, err := Compression(name)
		if err != nil {
			return nil, fmt.Errorf("topic %s: %w", short, err)
		}
		if c != 0 {
			out[full(short)] = c
		}
	}
	return out, nil
}

// CompressionOf is the codec byShort gives the topic short: 0 (none) when
// it names none, or a name Compression refuses (a validated contract has
// none of those).
func CompressionOf(byShort map[string]string, short string) kafkago.Compression {
	c, err := Compression(byShort[short])
	if err != nil {
		return 0
	}
	return c
}
