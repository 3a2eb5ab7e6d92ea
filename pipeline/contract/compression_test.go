package contract

import (
	"errors"
	"maps"
	"strings"
	"testing"
)

// TestTopicCompression: by default nothing is compressed; a written map
// is taken as written; it round-trips through YAML; and it is left out of
// the hash, since consumers read the same bytes whatever the codec.
func TestTopicCompression(t *testing.T) {
	c := mustResolve(t, readFile(t, "minimal.yaml"))
	if len(c.Topics.Compression) != 0 {
		t.Fatalf("default topics.compression %v, want none", c.Topics.Compression)
	}
	set := mustResolve(t, mutate(t, "minimal.yaml", "topics.compression", map[string]any{"census": "lz4", "batches": "zstd"}))
	if want := map[string]string{"census": "lz4", "batches": "zstd"}; !maps.Equal(set.Topics.Compression, want) {
		t.Fatalf("written topics.compression %v, want %v", set.Topics.Compression, want)
	}
	if set.Hash() != c.Hash() {
		t.Errorf("topics.compression changed the hash: %s vs %s", set.Hash(), c.Hash())
	}
	y, err := set.YAML()
	if err != nil {
		t.Fatal(err)
	}
	if back := mustResolve(t, y); !maps.Equal(back.Topics.Compression, set.Topics.Compression) {
		t.Fatalf("round trip: %v\n%s", back.Topics.Compression, y)
	}
}

func TestTopicCompressionValidation(t *testing.T) {
	tests := []struct {
		name  string
		value map[string]any
		want  string
	}{
		{"unknown codec", map[string]any{"batches": "brotli"}, `topics.compression.batches: must be one of none, gzip, snappy, lz4, zstd, got "brotli"`},
		{"unknown topic", map[string]any{"batchez": "lz4"}, `topics.compression.batchez: no topic "batchez" in the topology`},
		{"empty codec", map[string]any{"census": ""}, `topics.compression.census: must be one of none, gzip, snappy, lz4, zstd, got ""`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse(mutate(t, "demo.yaml", "topics.compression", tt.value))
			if err != nil {
				t.Fatal(err)
			}
			err = c.Resolve()
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tt.want)
			}
		})
	}
}
