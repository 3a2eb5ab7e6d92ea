// Package rowipc moves rows of Go structs to and from Arrow: it derives
// the Arrow columns of a row type from its struct definition (columns.go),
// writes one Arrow IPC stream straight from the rows (write.go), byte for
// byte what Arrow's stream writer writes, and reads a stream straight into
// the rows: the framing is checked before anything trusts it (frame.go),
// and a stream whose schema message is the codec's own is loaded as
// column views of the input without Arrow's reader (load.go). Streams of
// any other schema go through Arrow's reader, which is also the oracle the
// tests compare the loader and the writer with.
//
// The package knows nothing of record kinds: schemas gives each kind a
// codec, the schema metadata naming it, and a check of that metadata.
// Errors are returned without a prefix naming the kind; the caller wraps
// them (the check's own error is returned as it is).
package rowipc

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"unsafe"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/ipc"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// Codec encodes and decodes rows of type T, a struct, as Arrow data (see
// columns.go for how the columns derive from T). Every method taking an
// allocator accepts nil for memory.DefaultAllocator. A Codec is safe for
// concurrent use.
type Codec[T any] struct {
	schema *arrow.Schema
	cols   []col
	nodes  int // field nodes of a record batch of schema
	// check accepts or refuses the schema of a stream read by Arrow's
	// reader and of a record given to FromRecord (the kind and version in
	// its metadata).
	check func(*arrow.Schema) error
	// frame is the encoded schema message of schema, written once and
	// copied at the start of every stream Encode writes.
	frame func() ([]byte, error)
}

func orDefault(mem memory.Allocator) memory.Allocator {
	if mem == nil {
		return memory.DefaultAllocator
	}
	return mem
}

// New derives the columns of T and returns its codec. md is the metadata
// of the schema; nullable names the fixed-width list columns where a nil
// slice is stored as null (elsewhere nil and empty lists are both stored
// as empty); check is called on the schema of every stream read by Arrow's
// reader and of every record given to FromRecord, and its error is
// returned as it is. New panics when T has a field with no column (no
// json name, or a Go type with no Arrow counterpart).
func New[T any](md arrow.Metadata, nullable map[string]bool, check func(*arrow.Schema) error) *Codec[T] {
	cols := colsOf(reflect.TypeFor[T](), nullable)
	schema := arrow.NewSchema(fieldsOf(cols), &md)
	return &Codec[T]{schema: schema, cols: cols, nodes: nodeCount(schema), check: check,
		frame: sync.OnceValues(func() ([]byte, error) { return schemaFrame(schema) })}
}

// Schema is the Arrow schema of T, with the metadata given to New.
func (c *Codec[T]) Schema() *arrow.Schema { return c.schema }

// ToRecord builds one record batch holding rows. The caller releases it.
// List values may share memory with rows: when the non-empty slices of a
// fixed-width list column lie back to back in memory in row order (as
// Decode leaves them), the column's values buffer is that memory, not a
// copy. Rows must not be modified while the record is alive.
func (c *Codec[T]) ToRecord(mem memory.Allocator, rows []T) (arrow.RecordBatch, error) {
	b := &builder{mem: orDefault(mem)}
	cols := make([]arrow.Array, len(c.cols))
	for i := range c.cols {
		d := c.cols[i].build(b, len(rows), func(k int) unsafe.Pointer { return unsafe.Pointer(&rows[k]) })
		cols[i] = array.MakeFromData(d)
		d.Release()
	}
	defer func() {
		for _, a := range cols {
			a.Release()
		}
	}()
	if b.err != nil {
		return nil, b.err
	}
	return array.NewRecordBatch(c.schema, cols, int64(len(rows))), nil
}

// Encode returns rows as one Arrow IPC stream (schema, one record batch,
// end-of-stream marker), written straight from the rows (write.go), byte
// for byte what Arrow's stream writer writes for ToRecord's record. With
// pooled, the output comes from the package's buffer pool and release
// hands it back (at most once, when nothing references it any more; not
// calling it is safe); without, release does nothing.
func (c *Codec[T]) Encode(rows []T, pooled bool) (b []byte, release func(), err error) {
	frame, err := c.frame()
	if err != nil {
		return nil, nil, fmt.Errorf("schema: %w", err)
	}
	return writeRows(frame, c.cols, len(rows), func(k int) unsafe.Pointer { return unsafe.Pointer(&rows[k]) }, pooled)
}

// FromRecord checks the schema of rec and reads its rows; columns are
// found by name, extra columns are ignored. With share, fixed-width list
// values are not copied (see Decode).
func (c *Codec[T]) FromRecord(rec arrow.RecordBatch, share bool) ([]T, error) {
	if err := c.check(rec.Schema()); err != nil {
		return nil, err
	}
	return c.readRecord(rec, share)
}

// Decode reads the rows of one IPC stream: exactly one schema message, one
// record batch and the end-of-stream marker. A stream that starts with the
// codec's own schema message is loaded without Arrow's reader; any other
// goes through DecodeArrow. With share, the rows' fixed-width list values
// point into b when aligned for their type (b must then not be modified
// while the rows are in use); without, decoded rows never alias b.
func (c *Codec[T]) Decode(mem memory.Allocator, b []byte, share bool) ([]T, error) {
	if frame, err := c.frame(); err == nil && len(b) >= len(frame) && bytes.Equal(b[:len(frame)], frame) {
		// The codec's own schema message, known to be valid: check the
		// rest of the framing and load the batch against the known schema
		// instead of parsing the schema again.
		batch, err := batchAndEnd(b, len(frame))
		if err != nil {
			return nil, err
		}
		n, datas, err := loadBatch(c.schema, c.nodes, batch)
		if err != nil {
			return nil, fmt.Errorf("record batch: %w", err)
		}
		return c.readColumns(n, datas, share)
	}
	return c.DecodeArrow(mem, b, share)
}

// DecodeArrow is Decode through Arrow's IPC reader whatever the schema
// message: the path of streams written by other tools, and the reference
// the loader is tested against. The framing is checked first, then the
// schema (check), then the codec's columns are found by name.
func (c *Codec[T]) DecodeArrow(mem memory.Allocator, b []byte, share bool) ([]T, error) {
	s, rec, err := openStream(orDefault(mem), c.check, b)
	if err != nil {
		return nil, err
	}
	defer s.release()
	return c.readRecord(rec, share)
}

// readRecord finds the codec's columns in rec by name (extra columns are
// ignored) and reads them.
func (c *Codec[T]) readRecord(rec arrow.RecordBatch, share bool) ([]T, error) {
	datas := make([]colData, len(c.cols))
	for i := range c.cols {
		name := c.cols[i].name
		idx := rec.Schema().FieldIndices(name)
		if len(idx) != 1 {
			return nil, fmt.Errorf("column %q found %d times", name, len(idx))
		}
		datas[i] = fromArrow(rec.Column(idx[0]).Data(), 0)
	}
	return c.readColumns(rec.NumRows(), datas, share)
}

// readColumns checks the structure of one column per codec column (n rows
// each) and reads the rows.
func (c *Codec[T]) readColumns(n int64, datas []colData, share bool) ([]T, error) {
	if n < 0 || n > 1<<40 {
		return nil, fmt.Errorf("%d rows", n)
	}
	for i := range c.cols {
		f, d := c.cols[i].field(), &datas[i]
		if d.len != int(n) {
			return nil, fmt.Errorf("column %q has %d values for %d rows", f.Name, d.len, n)
		}
		if err := under(f.Name, checkData(d, f.Type, f.Nullable)); err != nil {
			return nil, err
		}
	}
	rows := make([]T, n)
	for i := range c.cols {
		c.cols[i].read(&datas[i], 0, int(n), func(k int) unsafe.Pointer { return unsafe.Pointer(&rows[k]) }, share)
	}
	return rows, nil
}

// writeStream writes rec as one IPC stream with Arrow's stream writer.
func writeStream(mem memory.Allocator, rec arrow.RecordBatch) ([]byte, error) {
	var out bytes.Buffer
	w := ipc.NewWriter(&out, ipc.WithSchema(rec.Schema()), ipc.WithAllocator(mem))
	if err := w.Write(rec); err != nil {
		w.Close()
		return nil, err
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	return out.Bytes(), nil
}

// schemaFrame is the schema message the IPC stream writer writes first for
// schema (continuation marker, length, flatbuffer metadata, padding).
func schemaFrame(schema *arrow.Schema) ([]byte, error) {
	cols := emptyColumns(schema)
	rec := array.NewRecordBatch(schema, cols, 0)
	for _, c := range cols {
		c.Release() // the record holds them
	}
	defer rec.Release()
	b, err := writeStream(memory.DefaultAllocator, rec)
	if err != nil {
		return nil, err
	}
	_, end, _, err := readFrame(b, 0)
	if err != nil {
		return nil, err
	}
	return b[:end:end], nil
}

// emptyColumns are zero-length arrays of the schema's fields; the caller
// releases them.
func emptyColumns(schema *arrow.Schema) []arrow.Array {
	cols := make([]arrow.Array, schema.NumFields())
	for i, f := range schema.Fields() {
		cols[i] = array.MakeArrayOfNull(memory.DefaultAllocator, f.Type, 0)
	}
	return cols
}

// ipcEOS is the end-of-stream marker: continuation, zero-length metadata.
var ipcEOS = []byte{0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0}

// arrowStream is a stream opened with Arrow's reader: the reader and the
// messages it reads, released together.
type arrowStream struct {
	msgs *messageList
	r    *ipc.Reader
}

func (s arrowStream) release() {
	s.r.Release()
	s.msgs.release()
}

// openStream checks the framing of b and, with check, the schema of its
// schema message, and returns its single record batch, valid until the
// stream is released.
func openStream(mem memory.Allocator, check func(*arrow.Schema) error, b []byte) (arrowStream, arrow.RecordBatch, error) {
	schemaMsg, batchMsg, err := splitStream(b)
	if err != nil {
		return arrowStream{}, nil, err
	}
	s := arrowStream{msgs: newMessageList(schemaMsg, batchMsg)}
	if s.r, err = newIPCReader(s.msgs, mem); err != nil {
		s.msgs.release()
		return arrowStream{}, nil, fmt.Errorf("schema: %w", err)
	}
	if err := check(s.r.Schema()); err != nil {
		s.release()
		return arrowStream{}, nil, err
	}
	rec, err := nextRecord(s.r)
	if err != nil {
		s.release()
		return arrowStream{}, nil, fmt.Errorf("record batch: %w", err)
	}
	return s, rec, nil
}

// newIPCReader and nextRecord call into the Arrow reader. It converts its
// own panics on malformed metadata into errors; the recover here is a last
// resort for any it misses and never replaces the checks above.
func newIPCReader(msgs *messageList, mem memory.Allocator) (r *ipc.Reader, err error) {
	defer func() {
		if p := recover(); p != nil {
			r, err = nil, fmt.Errorf("arrow reader: %v", p)
		}
	}()
	return ipc.NewReaderFromMessageReader(msgs, ipc.WithAllocator(mem))
}

func nextRecord(r *ipc.Reader) (rec arrow.RecordBatch, err error) {
	defer func() {
		if p := recover(); p != nil {
			rec, err = nil, fmt.Errorf("arrow reader: %v", p)
		}
	}()
	if !r.Next() {
		if err := r.Err(); err != nil {
			return nil, err
		}
		return nil, errors.New("no record batch")
	}
	return r.RecordBatch(), nil
}

// PeekMetadata reads only the schema message at the start of an IPC
// stream and returns the metadata of its schema.
func PeekMetadata(b []byte) (arrow.Metadata, error) {
	m, _, eos, err := readFrame(b, 0)
	if err != nil {
		return arrow.Metadata{}, err
	}
	if eos || m.typ != msgSchema {
		return arrow.Metadata{}, errors.New("stream does not start with a schema message")
	}
	msgs := newMessageList(m)
	defer msgs.release()
	r, err := newIPCReader(msgs, memory.DefaultAllocator)
	if err != nil {
		return arrow.Metadata{}, fmt.Errorf("schema: %w", err)
	}
	defer r.Release()
	return r.Schema().Metadata(), nil
}

// ReadBatches reads a stream of one schema message, any number of record
// batches and the end-of-stream marker (required) with Arrow's reader:
// check (when not nil) sees the schema, use each record batch in order
// (released when use returns). Framing is checked as for Decode.
func ReadBatches(mem memory.Allocator, b []byte, check func(*arrow.Schema) error, use func(arrow.RecordBatch) error) error {
	schemaMsg, batchMsgs, err := splitBatches(b)
	if err != nil {
		return err
	}
	msgs := newMessageList(append([]ipcMessage{schemaMsg}, batchMsgs...)...)
	defer msgs.release()
	r, err := newIPCReader(msgs, orDefault(mem))
	if err != nil {
		return fmt.Errorf("schema: %w", err)
	}
	defer r.Release()
	if check != nil {
		if err := check(r.Schema()); err != nil {
			return err
		}
	}
	for i := range batchMsgs {
		rec, err := nextRecord(r)
		if err != nil {
			return fmt.Errorf("record batch %d: %w", i, err)
		}
		if err := use(rec); err != nil {
			return err
		}
	}
	return nil
}

// ReadRows reads the rows of a record batch of T's schema (FromRecord
// without the schema check: the caller checked the stream's schema).
func (c *Codec[T]) ReadRows(rec arrow.RecordBatch, share bool) ([]T, error) {
	return c.readRecord(rec, share)
}
