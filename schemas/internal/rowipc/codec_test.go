package rowipc

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/ipc"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// The tests here use one row type with a column of every kind the engine
// maps (columns.go); the record kinds of schemas have their own tests
// there, with the same differential checks against Arrow's reader and
// writer.

type base struct {
	ID   string `json:"id"`
	Seed int64  `json:"seed"`
}

type item struct {
	A int64     `json:"a"`
	S string    `json:"s"`
	F []float32 `json:"f"`
}

type testRow struct {
	base
	N     int32     `json:"n"`
	X     float64   `json:"x"`
	U     uint8     `json:"u"`
	OK    bool      `json:"ok"`
	IDs   []int32   `json:"ids"`
	Ref   []float32 `json:"ref"` // nullable
	Mask  []uint8   `json:"mask"`
	Names []string  `json:"names"`
	Flags []bool    `json:"flags"`
	Items []item    `json:"items"`
	Group item      `json:"group"`
}

var errOtherSchema = errors.New("not a test row schema")

func checkTestSchema(s *arrow.Schema) error {
	if md := s.Metadata(); md.FindKey("row") < 0 {
		return errOtherSchema
	}
	return nil
}

var testCodec = New[testRow](arrow.NewMetadata([]string{"row"}, []string{"test"}), map[string]bool{"ref": true}, checkTestSchema)

func sampleRows() []testRow {
	return []testRow{
		{base: base{"a", -1}, N: math.MaxInt32, X: math.Inf(-1), U: 255, OK: true, IDs: []int32{1, 2, 3}, Ref: []float32{0.5},
			Mask: []uint8{1, 0}, Names: []string{"x", "", "ünï"}, Flags: []bool{true, false, true},
			Items: []item{{A: 1, S: "s", F: []float32{1, 2}}, {A: 2}}, Group: item{A: 7, S: "g", F: []float32{3}}},
		{base: base{"", 0}, Ref: []float32{}}, // empty, not null
		{base: base{"c", math.MinInt64}, IDs: []int32{4}, Ref: nil, Items: []item{{S: "only"}}},
	}
}

func newMem(t testing.TB) *memory.CheckedAllocator {
	mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
	t.Cleanup(func() { mem.AssertSize(t, 0) })
	return mem
}

// arrowBytes is the stream Arrow's own writer writes for the record
// ToRecord builds of rows.
func arrowBytes(t testing.TB, mem memory.Allocator, rows []testRow) []byte {
	t.Helper()
	rec, err := testCodec.ToRecord(mem, rows)
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Release()
	b, err := writeStream(mem, rec)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestSchemaOfTestRow(t *testing.T) {
	want := "schema:\n  fields: 13\n" +
		"    - id: type=utf8\n" +
		"    - seed: type=int64\n" +
		"    - n: type=int32\n" +
		"    - x: type=float64\n" +
		"    - u: type=uint8\n" +
		"    - ok: type=bool\n" +
		"    - ids: type=list<item: int32>\n" +
		"    - ref: type=list<item: float32>, nullable\n" +
		"    - mask: type=list<item: uint8>\n" +
		"    - names: type=list<item: utf8>\n" +
		"    - flags: type=list<item: bool>\n" +
		"    - items: type=list<item: struct<a: int64, s: utf8, f: list<item: float32>>>\n" +
		"    - group: type=struct<a: int64, s: utf8, f: list<item: float32>>\n" +
		"  metadata: [\"row\": \"test\"]"
	if got := testCodec.Schema().String(); got != want {
		t.Fatalf("schema\n%s\nwant\n%s", got, want)
	}
}

func TestRoundTrip(t *testing.T) {
	for _, rows := range [][]testRow{sampleRows(), sampleRows()[1:2], nil} {
		mem := newMem(t)
		b, release, err := testCodec.Encode(rows, false)
		if err != nil {
			t.Fatal(err)
		}
		release()
		if want := arrowBytes(t, mem, rows); !bytes.Equal(b, want) {
			t.Fatalf("%d rows: Encode wrote %d bytes that differ from the %d of Arrow's stream writer", len(rows), len(b), len(want))
		}
		pooled, release, err := testCodec.Encode(rows, true)
		if err != nil || !bytes.Equal(pooled, b) {
			t.Fatalf("%d rows: pooled encode differs (%v)", len(rows), err)
		}
		release()
		want := rows
		if len(want) == 0 {
			want = []testRow{}
		}
		for _, path := range []struct {
			name   string
			decode func() ([]testRow, error)
		}{
			{"loader", func() ([]testRow, error) { return testCodec.Decode(mem, b, false) }},
			{"loader shared", func() ([]testRow, error) { return testCodec.Decode(mem, b, true) }},
			{"arrow reader", func() ([]testRow, error) { return testCodec.DecodeArrow(mem, b, false) }},
			{"arrow reader shared", func() ([]testRow, error) { return testCodec.DecodeArrow(mem, b, true) }},
			{"record", func() ([]testRow, error) {
				rec, err := testCodec.ToRecord(mem, rows)
				if err != nil {
					return nil, err
				}
				defer rec.Release()
				return testCodec.FromRecord(rec, false)
			}},
		} {
			got, err := path.decode()
			if err != nil {
				t.Fatalf("%d rows, %s: %v", len(rows), path.name, err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("%d rows, %s:\n got %+v\nwant %+v", len(rows), path.name, got, want)
			}
		}
	}
}

// The check's error is returned as it is, on both read paths.
func TestCheckErrorPassesThrough(t *testing.T) {
	mem := newMem(t)
	other := New[testRow](arrow.Metadata{}, map[string]bool{"ref": true}, checkTestSchema)
	b, _, err := other.Encode(sampleRows(), false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := testCodec.Decode(mem, b, false); err != errOtherSchema {
		t.Fatalf("Decode: got %v, want the check's error", err)
	}
	rec, err := other.ToRecord(mem, sampleRows())
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Release()
	if _, err := testCodec.FromRecord(rec, false); err != errOtherSchema {
		t.Fatalf("FromRecord: got %v, want the check's error", err)
	}
	md, err := PeekMetadata(b)
	if err != nil || md.Len() != 0 {
		t.Fatalf("PeekMetadata = %v, %v", md, err)
	}
}

// Counts in the metadata are bounded by the bytes present: a vector that
// claims billions of entries is refused before the Arrow reader would
// allocate for them.
func TestHugeMetadataCounts(t *testing.T) {
	mem := newMem(t)
	good, _, err := testCodec.Encode(sampleRows(), false)
	if err != nil {
		t.Fatal(err)
	}
	// vectorLenAt returns the stream position of the length of vector
	// field i of the schema message's header table.
	vectorLenAt := func(i int) int {
		meta := good[8 : 8+int(binary.LittleEndian.Uint32(good[4:]))]
		tbl, err := fbRoot(meta)
		if err != nil {
			t.Fatal(err)
		}
		if tbl, _, err = tbl.table(2); err != nil {
			t.Fatal(err)
		}
		p, err := tbl.fieldPos(i, 4)
		if p < 0 || err != nil {
			t.Fatalf("field %d absent (%v)", i, err)
		}
		return 8 + p + int(binary.LittleEndian.Uint32(meta[p:]))
	}
	for _, tt := range []struct {
		name string
		at   int
	}{
		{"schema fields", vectorLenAt(1)},
		{"schema custom metadata", vectorLenAt(2)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b := append([]byte(nil), good...)
			binary.LittleEndian.PutUint32(b[tt.at:], 0xffffff00)
			if _, err := testCodec.Decode(mem, b, false); err == nil {
				t.Fatal("Decode accepted the stream")
			}
			if _, err := PeekMetadata(b); err == nil {
				t.Fatal("PeekMetadata accepted the stream")
			}
		})
	}
}

// FuzzDecode: Decode returns an error or rows, never panics and leaks
// nothing; whatever the loader accepts, Arrow's reader accepts with the
// same rows; the rows re-encode to the bytes Arrow's writer writes.
func FuzzDecode(f *testing.F) {
	good, _, err := testCodec.Encode(sampleRows(), false)
	if err != nil {
		f.Fatal(err)
	}
	empty, _, err := testCodec.Encode(nil, false)
	if err != nil {
		f.Fatal(err)
	}
	var foreign bytes.Buffer // another writer's layout: Arrow's reader path
	w := ipc.NewWriter(&foreign, ipc.WithSchema(testCodec.Schema()))
	rec, err := testCodec.ToRecord(nil, sampleRows())
	if err != nil {
		f.Fatal(err)
	}
	if err := w.Write(rec); err != nil {
		f.Fatal(err)
	}
	rec.Release()
	w.Close()
	for _, b := range [][]byte{good, empty, foreign.Bytes()} {
		f.Add(b)
		f.Add(b[:len(b)/2])
		flipped := append([]byte(nil), b...)
		for i := 8; i < len(flipped); i += 97 {
			flipped[i] ^= 0x5a
		}
		f.Add(flipped)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
		defer mem.AssertSize(t, 0)
		rows, err := testCodec.Decode(mem, data, false)
		if err != nil {
			return
		}
		viaArrow, err := testCodec.DecodeArrow(mem, data, false)
		if err != nil {
			t.Fatalf("decoded, but Arrow's reader refuses the stream: %v", err)
		}
		shared, err := testCodec.Decode(mem, data, true)
		if err != nil {
			t.Fatalf("Decode accepts the stream, Decode with share refuses it: %v", err)
		}
		if !sameRows(rows, viaArrow) || !sameRows(rows, shared) {
			t.Fatal("the decoders disagree on the rows")
		}
		again, _, err := testCodec.Encode(rows, false)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		if !bytes.Equal(again, arrowBytes(t, mem, rows)) {
			t.Fatal("re-encoding differs from Arrow's stream writer")
		}
		rows2, err := testCodec.Decode(mem, again, false)
		if err != nil || !sameRows(rows, rows2) {
			t.Fatalf("re-encoding changed the rows (%v)", err)
		}
	})
}

// sameRows compares rows with floats bit for bit (a fuzzed NaN is not
// equal to itself under ==).
func sameRows(a, b []testRow) bool { return same(reflect.ValueOf(a), reflect.ValueOf(b)) }

func same(a, b reflect.Value) bool {
	switch a.Kind() {
	case reflect.Struct:
		for i := range a.NumField() {
			if !same(a.Field(i), b.Field(i)) {
				return false
			}
		}
		return true
	case reflect.Slice:
		if a.IsNil() != b.IsNil() || a.Len() != b.Len() {
			return false
		}
		for i := range a.Len() {
			if !same(a.Index(i), b.Index(i)) {
				return false
			}
		}
		return true
	case reflect.Float32, reflect.Float64:
		return math.Float64bits(a.Float()) == math.Float64bits(b.Float())
	default:
		return a.Equal(b)
	}
}

// A buffer that lies past the end of its message body is an error even
// when the input is a window of a larger buffer (a fetch buffer holding
// several messages): the bytes after the stream are not part of it and
// must never be read as column values — by the loader or by Arrow's
// reader.
func TestBufferPastTheBody(t *testing.T) {
	mem := newMem(t)
	good, _, err := testCodec.Encode(sampleRows(), false)
	if err != nil {
		t.Fatal(err)
	}
	_, pos, _, err := readFrame(good, 0)
	if err != nil {
		t.Fatal(err)
	}
	batch, _, _, err := readFrame(good, pos)
	if err != nil {
		t.Fatal(err)
	}
	root, err := fbRoot(batch.meta)
	if err != nil {
		t.Fatal(err)
	}
	header, _, err := root.table(2)
	if err != nil {
		t.Fatal(err)
	}
	bufs, err := header.vector(2, 16)
	if err != nil {
		t.Fatal(err)
	}
	// The last non-empty buffer, moved to start at the end of the body.
	metaAt := pos + 8 // the batch's metadata in good
	last := -1
	for k := range bufs.n {
		if binary.LittleEndian.Uint64(batch.meta[bufs.start+16*k+8:]) > 0 {
			last = k
		}
	}
	if last < 0 {
		t.Fatal("no non-empty buffer")
	}
	const spare = 1 << 12
	window := make([]byte, len(good), len(good)+spare)
	copy(window, good)
	binary.LittleEndian.PutUint64(window[metaAt+bufs.start+16*last:], uint64(len(batch.body)))
	for i := len(window); i < cap(window); i++ {
		window[:cap(window)][i] = 0x5a
	}
	if _, err := testCodec.Decode(mem, window, false); err == nil {
		t.Error("Decode accepted a buffer past the body")
	}
	if _, err := testCodec.DecodeArrow(mem, window, false); err == nil {
		t.Error("Arrow's reader accepted a buffer past the body")
	}
}

// SplitBatches and ReadBatches need the end-of-stream marker: a stream cut
// exactly between two record batches is refused, not read as a shorter one.
func TestMultiBatchStreamsNeedTheirEnd(t *testing.T) {
	one, _, err := testCodec.Encode(sampleRows(), false)
	if err != nil {
		t.Fatal(err)
	}
	_, pos, _, err := readFrame(one, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, next, _, err := readFrame(one, pos)
	if err != nil {
		t.Fatal(err)
	}
	batch := one[pos:next]
	two := append(append(append([]byte(nil), one[:next]...), batch...), ipcEOS...)
	parts, err := SplitBatches(two)
	if err != nil || len(parts) != 2 || !bytes.Equal(parts[0], one) || !bytes.Equal(parts[1], one) {
		t.Fatalf("split: %d parts, %v", len(parts), err)
	}
	n := 0
	if err := ReadBatches(nil, two, nil, func(arrow.RecordBatch) error { n++; return nil }); err != nil || n != 2 {
		t.Fatalf("read: %d batches, %v", n, err)
	}
	cut := two[:len(two)-len(ipcEOS)]
	if _, err := SplitBatches(cut); err == nil {
		t.Fatal("SplitBatches accepted a stream without its end-of-stream marker")
	}
	// Streams one after the other: SplitBatches refuses the bytes after
	// the first's end, SplitStreams reads every batch of every stream, and
	// refuses a last stream cut before its end.
	three := append(append([]byte(nil), two...), one...)
	if _, err := SplitBatches(three); err == nil {
		t.Fatal("SplitBatches accepted bytes after the end-of-stream marker")
	}
	parts, err = SplitStreams(three)
	if err != nil || len(parts) != 3 || !bytes.Equal(parts[2], one) {
		t.Fatalf("SplitStreams of two streams: %d parts, %v", len(parts), err)
	}
	if _, err := SplitStreams(append(append([]byte(nil), two...), one[:len(one)-len(ipcEOS)]...)); err == nil ||
		!strings.Contains(err.Error(), fmt.Sprintf("stream 1 (at byte %d)", len(two))) {
		t.Fatalf("SplitStreams of a second stream without its end: %v", err)
	}
	if err := ReadBatches(nil, cut, nil, func(arrow.RecordBatch) error { return nil }); err == nil {
		t.Fatal("ReadBatches accepted a stream without its end-of-stream marker")
	}
}
