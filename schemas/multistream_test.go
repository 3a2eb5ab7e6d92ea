package schemas

import (
	"bytes"
	"errors"
	"testing"

	"github.com/apache/arrow-go/v18/arrow/ipc"
)

// multiStream writes batches as one IPC stream with Arrow's own writer,
// one record batch each (what `trajflow stage pack --out` writes).
func multiStream(t *testing.T, batches []PackedBatch) []byte {
	t.Helper()
	var buf bytes.Buffer
	w := ipc.NewWriter(&buf, ipc.WithSchema(PackedBatches.Schema()))
	for _, b := range batches {
		rec, err := PackedBatches.ToRecord(nil, b)
		if err != nil {
			t.Fatal(err)
		}
		err = w.Write(rec)
		rec.Release()
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func threeBatches() []PackedBatch {
	var out []PackedBatch
	for i := range 3 {
		b := samplePackedBatch()
		b.BatchIndex = int64(i)
		b.BatchID = BatchID(b.RunID, int64(i))
		b.Rows = b.Rows[i:]
		out = append(out, b)
	}
	return out
}

// TestSplitStream: a stream of three record batches splits into the three
// messages the codec encodes for them, byte for byte, and DecodeAll reads
// them back; Decode alone refuses the multi-batch stream.
func TestSplitStream(t *testing.T) {
	want := threeBatches()
	stream := multiStream(t, want)
	if _, err := PackedBatches.Decode(nil, stream); !errors.Is(err, ErrDecode) {
		t.Fatalf("Decode of a three-batch stream: %v, want ErrDecode (a message holds one batch)", err)
	}
	parts, err := SplitStream(stream)
	if err != nil {
		t.Fatal(err)
	}
	if len(parts) != len(want) {
		t.Fatalf("%d parts, want %d", len(parts), len(want))
	}
	for i, p := range parts {
		enc, err := PackedBatches.Encode(nil, want[i])
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(p, enc) {
			t.Fatalf("part %d: %d bytes differ from the codec's message of %d bytes", i, len(p), len(enc))
		}
		got, err := PackedBatches.Decode(nil, p)
		if err != nil {
			t.Fatalf("part %d: %v", i, err)
		}
		assertSame(t, "Decode of a part", got, want[i])
	}
	all, err := PackedBatches.DecodeAll(nil, stream)
	if err != nil {
		t.Fatal(err)
	}
	assertSame(t, "DecodeAll", all, want)
	// The end-of-stream marker is required: a stream cut between two
	// record batches is not a shorter stream.
	if _, err := PackedBatches.DecodeAll(nil, stream[:len(stream)-len(ipcEOS)]); !errors.Is(err, ErrDecode) {
		t.Fatalf("DecodeAll without the end-of-stream marker: %v, want ErrDecode", err)
	}

	rows := sampleScored()
	one, err := ScoredTrajectories.Encode(nil, rows)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ScoredTrajectories.DecodeAll(nil, one)
	if err != nil || len(got) != 1 {
		t.Fatalf("DecodeAll of one message: %d batches, %v", len(got), err)
	}
	assertSame(t, "Codec.DecodeAll", got[0], rows)
	schemaOnly := multiStream(t, nil)
	if parts, err := SplitStream(schemaOnly); err != nil || len(parts) != 0 {
		t.Fatalf("schema-only stream: %d parts, %v", len(parts), err)
	}
}

func TestSplitStreamErrors(t *testing.T) {
	stream := multiStream(t, threeBatches())
	schemaLen := messageEnds(t, stream)[0]
	cases := map[string][]byte{
		"empty":                   nil,
		"garbage":                 []byte("not an arrow stream at all"),
		"truncated":               stream[:len(stream)-20],
		"bytes after end":         append(bytes.Clone(stream), 1, 2, 3),
		"no schema first":         stream[schemaLen:],
		"a second schema message": append(bytes.Clone(stream[:schemaLen]), stream...),
	}
	for name, b := range cases {
		if _, err := SplitStream(b); !errors.Is(err, ErrDecode) {
			t.Errorf("%s: %v, want ErrDecode", name, err)
		}
	}
	if _, err := TaskAttempts.DecodeAll(nil, stream); err == nil {
		t.Error("DecodeAll of packed batches as task attempts succeeded")
	}
}
