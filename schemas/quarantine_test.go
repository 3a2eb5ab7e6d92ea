package schemas_test

import (
	"reflect"
	"testing"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// The quarantine layout `trajflow schemas` documents is the one the
// pipeline writes: the refused record's key, value and headers, then
// QuarantineHeaders in order.
func TestQuarantineLayoutMatchesPipeline(t *testing.T) {
	m := pipeline.Message{
		Ref:     pipeline.Ref{Topic: "run.valid", Partition: 2, Offset: 41},
		Key:     []byte("g-1"),
		Value:   []byte("refused bytes"),
		Headers: []pipeline.Header{{Key: schemas.HeaderKind, Value: []byte("trajectory")}, {Key: "custom", Value: []byte("x")}},
	}
	out := pipeline.QuarantineRecord("run.quarantine", "validate", m, "no_turns", "turns: empty")
	if string(out.Key) != "g-1" || string(out.Value) != "refused bytes" {
		t.Fatalf("quarantine record key %q value %q", out.Key, out.Value)
	}
	var names []string
	for _, h := range out.Headers {
		names = append(names, h.Key)
	}
	want := append([]string{schemas.HeaderKind, "custom"}, schemas.QuarantineHeaders...)
	if !reflect.DeepEqual(names, want) {
		t.Fatalf("quarantine headers %v, want %v", names, want)
	}
	if got := schemas.NewCatalog(nil).Quarantine.AddedHeaders; !reflect.DeepEqual(got, schemas.QuarantineHeaders) {
		t.Fatalf("catalog lists %v", got)
	}
}
