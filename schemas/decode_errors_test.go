package schemas

import (
	"bytes"
	"errors"
	"testing"

	"unsafe"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/ipc"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// writeRaw writes records as one IPC stream with the given schema and
// writer options, bypassing the codec.
func writeRaw(t *testing.T, mem memory.Allocator, schema *arrow.Schema, recs []arrow.RecordBatch, opts ...ipc.Option) []byte {
	t.Helper()
	var buf bytes.Buffer
	w := ipc.NewWriter(&buf, append([]ipc.Option{ipc.WithSchema(schema), ipc.WithAllocator(mem)}, opts...)...)
	for _, r := range recs {
		if err := w.Write(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// taskRecordWith returns the task attempt record with column name replaced
// by data (nil drops the column).
func taskRecordWith(t *testing.T, mem memory.Allocator, name string, data arrow.ArrayData, typ arrow.DataType) arrow.RecordBatch {
	t.Helper()
	rec, err := TaskAttempts.ToRecord(mem, sampleTaskAttempts())
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Release()
	return recordWith(rec, name, data, typ)
}

func recordWith(rec arrow.RecordBatch, name string, data arrow.ArrayData, typ arrow.DataType) arrow.RecordBatch {
	var fields []arrow.Field
	var cols []arrow.Array
	for i, f := range rec.Schema().Fields() {
		col := rec.Column(i)
		if f.Name == name {
			if data == nil {
				continue
			}
			f.Type = typ
			col = array.MakeFromData(data)
			defer col.Release()
		}
		fields = append(fields, f)
		cols = append(cols, col)
	}
	md := rec.Schema().Metadata()
	return array.NewRecordBatch(arrow.NewSchema(fields, &md), cols, rec.NumRows())
}

func TestStructuralErrors(t *testing.T) {
	mem := newMem(t)
	good, err := TaskAttempts.Encode(mem, sampleTaskAttempts())
	if err != nil {
		t.Fatal(err)
	}
	rec, err := TaskAttempts.ToRecord(mem, sampleTaskAttempts())
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Release()

	raw := func(r arrow.RecordBatch, opts ...ipc.Option) []byte {
		defer r.Release()
		return writeRaw(t, mem, r.Schema(), []arrow.RecordBatch{r}, opts...)
	}
	buf := func(b []byte) *memory.Buffer { return memory.NewBufferBytes(b) }
	packed, err := PackedBatches.ToRecord(mem, samplePackedBatch())
	if err != nil {
		t.Fatal(err)
	}
	defer packed.Release()
	rawPacked := func(r arrow.RecordBatch) []byte {
		defer r.Release()
		return writeRaw(t, mem, r.Schema(), []arrow.RecordBatch{r})
	}
	listOf := func(offsets []int32, values []int32) arrow.ArrayData {
		child := array.NewData(arrow.PrimitiveTypes.Int32, len(values), []*memory.Buffer{nil, buf(bytesOf(values))}, nil, 0, 0)
		defer child.Release()
		return array.NewData(arrow.ListOfNonNullable(arrow.PrimitiveTypes.Int32), len(offsets)-1,
			[]*memory.Buffer{nil, buf(bytesOf(offsets))}, []arrow.ArrayData{child}, 0, 0)
	}
	// A valid list column with marker values; its offsets are patched in
	// the encoded bytes (the Arrow writer refuses to write bad offsets).
	marked := listOf([]int32{0, 2, 3, 4}, []int32{0x5A5A5A51, 0x5A5A5A52, 0x5A5A5A53, 0x5A5A5A54})
	defer marked.Release()
	listType := arrow.ListOfNonNullable(arrow.PrimitiveTypes.Int32)
	markedStream := rawPacked(recordWith(packed, "turn_ids", marked, listType))
	if _, err := PackedBatches.Decode(mem, markedStream); err != nil {
		t.Fatalf("unpatched stream: %v", err)
	}
	patch := func(offsets ...int32) []byte {
		pattern := bytesOf([]int32{0, 2, 3, 4, 0x5A5A5A51})
		i := bytes.Index(markedStream, pattern)
		if i < 0 || bytes.Index(markedStream[i+1:], pattern) >= 0 {
			t.Fatal("marker not found exactly once")
		}
		b := append([]byte(nil), markedStream...)
		copy(b[i:], bytesOf(offsets))
		return b
	}
	decreasing := array.NewData(arrow.BinaryTypes.String, 2,
		[]*memory.Buffer{nil, buf(bytesOf([]int32{0, 3, 1})), buf([]byte("abcd"))}, nil, 0, 0)
	defer decreasing.Release()
	withNulls := array.NewData(arrow.BinaryTypes.String, 2,
		[]*memory.Buffer{buf([]byte{1}), buf(bytesOf([]int32{0, 1, 1})), buf([]byte("a"))}, nil, 1, 0)
	defer withNulls.Release()
	asInt64 := array.NewData(arrow.PrimitiveTypes.Int64, 2,
		[]*memory.Buffer{nil, buf(bytesOf([]int64{1, 2}))}, nil, 0, 0)
	defer asInt64.Release()

	schemaOnly := writeRaw(t, mem, TaskAttempts.Schema(), nil)
	tests := []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"garbage", []byte("this is not an arrow stream at all")},
		{"continuation only", []byte{0xff, 0xff, 0xff, 0xff}},
		{"end of stream only", []byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0}},
		{"huge metadata length", []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 1, 2, 3}},
		{"zero record batches", schemaOnly},
		{"two record batches", writeRaw(t, mem, rec.Schema(), []arrow.RecordBatch{rec, rec})},
		{"trailing bytes", append(append([]byte(nil), good...), 0)},
		{"no end-of-stream marker", good[:len(good)-8]},
		{"missing column", raw(taskRecordWith(t, mem, "seed", nil, nil))},
		{"wrong type", raw(taskRecordWith(t, mem, "attempt_id", asInt64, arrow.PrimitiveTypes.Int64))},
		{"decreasing string offsets", raw(taskRecordWith(t, mem, "attempt_id", decreasing, arrow.BinaryTypes.String))},
		{"null in non-nullable column", raw(taskRecordWith(t, mem, "attempt_id", withNulls, arrow.BinaryTypes.String))},
		{"compressed", raw(taskRecordWith(t, mem, "", nil, nil), ipc.WithLZ4())},
	}
	for _, tt := range []struct {
		name string
		data []byte
	}{
		{"list offset past the values", patch(0, 2, 3, 9)},
		{"negative list offset", patch(-1, 2, 3, 4)},
		{"decreasing list offsets", patch(0, 3, 2, 4)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b, err := PackedBatches.Decode(mem, tt.data)
			if !errors.Is(err, ErrDecode) {
				t.Fatalf("got %d rows, err %v; want ErrDecode", len(b.Rows), err)
			}
			t.Log(err)
		})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rows, err := TaskAttempts.Decode(mem, tt.data)
			if !errors.Is(err, ErrDecode) {
				t.Fatalf("got %d rows, err %v; want ErrDecode", len(rows), err)
			}
			var ve *VersionError
			if errors.As(err, &ve) {
				t.Fatalf("structural error reported as version error: %v", err)
			}
			t.Log(err)
		})
	}
}

// Every strict prefix of a valid stream is an error wrapping ErrDecode,
// never a panic, and leaks nothing.
func TestTruncatedStreams(t *testing.T) {
	mem := newMem(t)
	tests := []struct {
		name   string
		encode func() ([]byte, error)
		decode func([]byte) error
	}{
		{"task_attempt", func() ([]byte, error) { return TaskAttempts.Encode(mem, sampleTaskAttempts()[:1]) },
			decodeWith(mem, TaskAttempts)},
		{"trajectory", func() ([]byte, error) { return Trajectories.Encode(mem, sampleTrajectories()[2:]) },
			decodeWith(mem, Trajectories)},
		{"packed_batch", func() ([]byte, error) {
			b := samplePackedBatch()
			b.Rows = b.Rows[2:]
			return PackedBatches.Encode(mem, b)
		}, func(b []byte) error { _, err := PackedBatches.Decode(mem, b); return err }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := tt.encode()
			if err != nil {
				t.Fatal(err)
			}
			if err := tt.decode(b); err != nil {
				t.Fatalf("full stream: %v", err)
			}
			for cut := range len(b) {
				if err := tt.decode(b[:cut:cut]); !errors.Is(err, ErrDecode) {
					t.Fatalf("cut at %d of %d: got %v, want ErrDecode", cut, len(b), err)
				}
			}
		})
	}
}

// A stream that starts at an odd address (as inside a larger fetch
// buffer) decodes the same.
func TestUnalignedInput(t *testing.T) {
	mem := newMem(t)
	in := samplePackedBatch()
	b, err := PackedBatches.Encode(mem, in)
	if err != nil {
		t.Fatal(err)
	}
	shifted := make([]byte, len(b)+1)
	copy(shifted[1:], b)
	got, err := PackedBatches.Decode(mem, shifted[1:])
	if err != nil {
		t.Fatal(err)
	}
	assertSame(t, "unaligned decode", got, in)
}

// Every single-byte corruption of a valid stream decodes or fails with
// ErrDecode or a *VersionError; none panics or leaks. This reaches every
// metadata field, field node, buffer descriptor and offset of the stream.
func TestCorruptedBytes(t *testing.T) {
	mem := newMem(t)
	traj, err := Trajectories.Encode(mem, sampleTrajectories()[2:])
	if err != nil {
		t.Fatal(err)
	}
	batch := samplePackedBatch()
	batch.Rows = batch.Rows[1:2]
	packed, err := PackedBatches.Encode(mem, batch)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		data   []byte
		decode func([]byte) error
	}{
		{"trajectory", traj, decodeWith(mem, Trajectories)},
		{"packed_batch", packed, func(b []byte) error { _, err := PackedBatches.Decode(mem, b); return err }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := append([]byte(nil), tt.data...)
			decoded := 0
			for i := range b {
				orig := b[i]
				for _, v := range []byte{0, 0xff, orig ^ 0x80, orig + 1, orig - 1} {
					if v == orig {
						continue
					}
					b[i] = v
					err := tt.decode(b)
					var ve *VersionError
					switch {
					case err == nil:
						decoded++
					case !errors.Is(err, ErrDecode) && !errors.As(err, &ve):
						t.Fatalf("byte %d = %#x: error %v is neither ErrDecode nor *VersionError", i, v, err)
					}
				}
				b[i] = orig
			}
			t.Logf("%d bytes, %d corruptions still decoded", len(b), decoded)
		})
	}
}

// bytesOf views a slice of fixed-width values as bytes.
func bytesOf[V int32 | int64](s []V) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*int(unsafe.Sizeof(s[0])))
}
