package schemas

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"sync"
	"unsafe"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/ipc"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// Codec encodes and decodes rows of one record kind as Arrow data. The wire
// form (DESIGN.md, "Wire format") is one self-describing Arrow IPC stream
// per message: the schema, carrying MetaKind and MetaVersion in its
// metadata, one record batch holding all rows, and the end-of-stream
// marker. The record forms serve the Parquet snapshot writer and reader.
//
// Decoders check structure only: a stream that is not exactly one schema
// and one record batch, a missing column, a column of the wrong type, an
// offset out of range, or a null where none is allowed is an error wrapping
// ErrDecode; a kind or version other than the codec's is a *VersionError
// (never wrapped in ErrDecode). Semantic rules (token and log-prob lengths,
// NaN, negative ids) are left to the validate stage, so a decoder returns
// anything structurally valid. No input makes a decoder panic.
//
// List columns: a non-nullable list that is empty decodes as a nil slice;
// a nullable list (ref_logprobs) decodes null as nil and an empty list as
// an empty non-nil slice. Decoded rows never alias the input bytes (except
// with DecodeShared), and the list slices of one column share one backing
// array (each sub-slice has its capacity capped at its length, so
// appending copies).
//
// Every method taking an allocator accepts nil for memory.DefaultAllocator.
// A Codec is safe for concurrent use.
type Codec[T any] struct {
	kind   Kind
	schema *arrow.Schema
	cols   []col
	nodes  int // field nodes of a record batch of schema
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

// newCodec derives the columns of T (see columns.go).
func newCodec[T any](kind Kind) *Codec[T] {
	cols := colsOf(reflect.TypeFor[T]())
	md := arrow.NewMetadata(
		[]string{MetaKind, MetaVersion},
		[]string{string(kind), strconv.Itoa(Versions[kind])},
	)
	return codecOf[T](kind, arrow.NewSchema(fieldsOf(cols), &md), cols)
}

func codecOf[T any](kind Kind, schema *arrow.Schema, cols []col) *Codec[T] {
	return &Codec[T]{kind: kind, schema: schema, cols: cols, nodes: nodeCount(schema), frame: sync.OnceValues(func() ([]byte, error) { return schemaFrame(schema) })}
}

// Kind is the record kind of the codec.
func (c *Codec[T]) Kind() Kind { return c.kind }

// Version is the schema version the codec writes and the only one it reads.
func (c *Codec[T]) Version() int { return Versions[c.kind] }

// Schema is the Arrow schema of the kind, with MetaKind and MetaVersion in
// its metadata.
func (c *Codec[T]) Schema() *arrow.Schema { return c.schema }

// ToRecord builds one record batch holding rows. The caller releases it.
// List values may share memory with rows: when the non-empty slices of a
// fixed-width list column lie back to back in memory in row order (as
// DecodeShared and Decode leave them), the column's values buffer is that
// memory, not a copy. Rows must not be modified while the record is alive.
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
		return nil, fmt.Errorf("schemas: encode %s: %w", c.kind, b.err)
	}
	return array.NewRecordBatch(c.schema, cols, int64(len(rows))), nil
}

// Encode returns rows as one Arrow IPC stream (schema, one record batch,
// end-of-stream marker). An empty slice encodes a batch of zero rows. The
// stream is written straight from the rows (ipcwrite.go), byte for byte
// what Arrow's stream writer writes for ToRecord's record; mem is not used
// (no Arrow arrays are built).
func (c *Codec[T]) Encode(_ memory.Allocator, rows []T) ([]byte, error) {
	b, _, err := c.encode(rows, false)
	return b, err
}

// EncodePooled is Encode into a buffer from the package's buffer pool,
// which spares the allocation (and zeroing) of a fresh output for every
// message. release hands the buffer back: call it at most once, when
// nothing references b any more (for a Kafka output, once its write has
// completed: pipeline.Output.Release). Not calling it is safe; the buffer
// is then garbage collected.
func (c *Codec[T]) EncodePooled(rows []T) (b []byte, release func(), err error) {
	return c.encode(rows, true)
}

func (c *Codec[T]) encode(rows []T, pooled bool) ([]byte, func(), error) {
	frame, err := c.frame()
	if err != nil {
		return nil, nil, fmt.Errorf("schemas: encode %s: schema: %w", c.kind, err)
	}
	return writeRows(c.kind, frame, c.cols, len(rows), func(k int) unsafe.Pointer { return unsafe.Pointer(&rows[k]) }, pooled)
}

// FromRecord reads the rows of rec. The schema metadata of rec must name
// the codec's kind and version (*VersionError otherwise); columns are found
// by name, extra columns are ignored.
func (c *Codec[T]) FromRecord(rec arrow.RecordBatch) ([]T, error) {
	if err := checkKind(c.kind, rec.Schema()); err != nil {
		return nil, err
	}
	return c.readRecord(rec, false)
}

// Decode reads the rows of one IPC stream written by Encode.
func (c *Codec[T]) Decode(mem memory.Allocator, b []byte) ([]T, error) {
	return c.decode(mem, b, false)
}

// DecodeShared is Decode without the copy of fixed-width list values
// (token ids, log-probs, masks): the rows' list slices point into b, so b
// must not be modified while the rows are in use. Values of a misaligned
// buffer are still copied. Encoding such rows again in their decoded order
// shares the same memory (see ToRecord), so a stage that forwards columns
// unchanged moves their bytes once, into the output stream.
func (c *Codec[T]) DecodeShared(mem memory.Allocator, b []byte) ([]T, error) {
	return c.decode(mem, b, true)
}

func (c *Codec[T]) decode(mem memory.Allocator, b []byte, share bool) ([]T, error) {
	if frame, err := c.frame(); err == nil && len(b) >= len(frame) && bytes.Equal(b[:len(frame)], frame) {
		// The codec's own schema message, known to be valid: check the
		// rest of the framing and load the batch against the known schema
		// instead of parsing the schema again.
		batch, err := batchAndEnd(b, len(frame))
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrDecode, c.kind, err)
		}
		n, datas, err := loadBatch(c.schema, c.nodes, batch)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: record batch: %w", ErrDecode, c.kind, err)
		}
		return c.readColumns(n, datas, share)
	}
	mem = orDefault(mem)
	var rows []T
	err := readStream(mem, c.kind, b, func(rec arrow.RecordBatch) error {
		var err error
		rows, err = c.readRecord(rec, share)
		return err
	})
	return rows, err
}

// readRecord finds the codec's columns in rec by name (extra columns are
// ignored) and reads them.
func (c *Codec[T]) readRecord(rec arrow.RecordBatch, share bool) ([]T, error) {
	datas := make([]colData, len(c.cols))
	for i := range c.cols {
		name := c.cols[i].name
		idx := rec.Schema().FieldIndices(name)
		if len(idx) != 1 {
			return nil, fmt.Errorf("%w: %s: column %q found %d times", ErrDecode, c.kind, name, len(idx))
		}
		datas[i] = fromArrow(rec.Column(idx[0]).Data(), 0)
	}
	return c.readColumns(rec.NumRows(), datas, share)
}

// readColumns checks the structure of one column per codec column (n rows
// each) and reads the rows.
func (c *Codec[T]) readColumns(n int64, datas []colData, share bool) ([]T, error) {
	if n < 0 || n > 1<<40 {
		return nil, fmt.Errorf("%w: %s: %d rows", ErrDecode, c.kind, n)
	}
	for i := range c.cols {
		f, d := c.cols[i].field(), &datas[i]
		if d.len != int(n) {
			return nil, fmt.Errorf("%w: %s: column %q has %d values for %d rows", ErrDecode, c.kind, f.Name, d.len, n)
		}
		if err := under(f.Name, checkData(d, f.Type, f.Nullable)); err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrDecode, c.kind, err)
		}
	}
	rows := make([]T, n)
	for i := range c.cols {
		c.cols[i].read(&datas[i], 0, int(n), func(k int) unsafe.Pointer { return unsafe.Pointer(&rows[k]) }, share)
	}
	return rows, nil
}

// checkKind returns a *VersionError unless the schema metadata names kind
// at its current version.
func checkKind(kind Kind, s *arrow.Schema) error {
	md := s.Metadata()
	gotKind, gotVersion := "", ""
	if i := md.FindKey(MetaKind); i >= 0 {
		gotKind = md.Values()[i]
	}
	if i := md.FindKey(MetaVersion); i >= 0 {
		gotVersion = md.Values()[i]
	}
	return checkVersion(kind, gotKind, gotVersion)
}

func checkVersion(kind Kind, gotKind, gotVersion string) error {
	known := Versions[kind]
	if gotKind != string(kind) || gotVersion != strconv.Itoa(known) {
		return &VersionError{WantKind: kind, GotKind: gotKind, Got: gotVersion, Known: known}
	}
	return nil
}

// writeStream writes rec as one IPC stream.
func writeStream(mem memory.Allocator, kind Kind, rec arrow.RecordBatch) ([]byte, error) {
	var out bytes.Buffer
	w := ipc.NewWriter(&out, ipc.WithSchema(rec.Schema()), ipc.WithAllocator(mem))
	if err := w.Write(rec); err != nil {
		w.Close()
		return nil, fmt.Errorf("schemas: encode %s: %w", kind, err)
	}
	if err := w.Close(); err != nil {
		return nil, fmt.Errorf("schemas: encode %s: %w", kind, err)
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
	b, err := writeStream(memory.DefaultAllocator, "", rec)
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

// readStream checks the framing of b, the kind and version in its schema,
// and hands its single record batch to use. The record is released when
// use returns.
func readStream(mem memory.Allocator, kind Kind, b []byte, use func(arrow.RecordBatch) error) error {
	schemaMsg, batchMsg, err := splitStream(b)
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrDecode, kind, err)
	}
	msgs := newMessageList(schemaMsg, batchMsg)
	defer msgs.release()
	r, err := newIPCReader(msgs, mem)
	if err != nil {
		return fmt.Errorf("%w: %s: schema: %v", ErrDecode, kind, err)
	}
	defer r.Release()
	if err := checkKind(kind, r.Schema()); err != nil {
		return err
	}
	rec, err := nextRecord(r)
	if err != nil {
		return fmt.Errorf("%w: %s: record batch: %v", ErrDecode, kind, err)
	}
	return use(rec)
}

// ReadStream reads an Arrow IPC stream held in b that may carry any number
// of record batches (a file written by Arrow's stream writer, as the
// offline tools read and write): one schema message, the record batches,
// and the end-of-stream marker. A stream that stops without the marker is
// an error wrapping ErrDecode even when it stops exactly between two
// record batches, so a stream cut short is never read as a shorter one.
// use is called with each record batch in order; the record is released
// when use returns (Retain it to keep it). Framing is checked as for
// Decode: no dictionary or compressed batches, every length bounded by the
// bytes present. The kind is not checked (DecodeStream does).
func ReadStream(mem memory.Allocator, b []byte, use func(arrow.RecordBatch) error) error {
	return readBatches(mem, "", b, nil, use)
}

// DecodeStream reads the rows of every record batch of a stream read by
// ReadStream, in order. The schema metadata must name the codec's kind and
// version (*VersionError otherwise); as with FromRecord, columns are found
// by name and extra columns are ignored. A stream of a schema and no
// record batch holds no rows.
func (c *Codec[T]) DecodeStream(mem memory.Allocator, b []byte) ([]T, error) {
	var rows []T
	err := readBatches(mem, c.kind, b, func(s *arrow.Schema) error { return checkKind(c.kind, s) },
		func(rec arrow.RecordBatch) error {
			got, err := c.readRecord(rec, false)
			rows = append(rows, got...)
			return err
		})
	if err != nil {
		return nil, err
	}
	return rows, nil
}

// readBatches checks the framing of a stream of any number of record
// batches, calls schema (when not nil) with its schema and use with each
// record batch.
func readBatches(mem memory.Allocator, kind Kind, b []byte, schema func(*arrow.Schema) error, use func(arrow.RecordBatch) error) error {
	prefix := ""
	if kind != "" {
		prefix = string(kind) + ": "
	}
	schemaMsg, batchMsgs, err := splitBatches(b)
	if err != nil {
		return fmt.Errorf("%w: %s%w", ErrDecode, prefix, err)
	}
	msgs := newMessageList(append([]ipcMessage{schemaMsg}, batchMsgs...)...)
	defer msgs.release()
	r, err := newIPCReader(msgs, orDefault(mem))
	if err != nil {
		return fmt.Errorf("%w: %sschema: %v", ErrDecode, prefix, err)
	}
	defer r.Release()
	if schema != nil {
		if err := schema(r.Schema()); err != nil {
			return err
		}
	}
	for i := range batchMsgs {
		rec, err := nextRecord(r)
		if err != nil {
			return fmt.Errorf("%w: %srecord batch %d: %v", ErrDecode, prefix, i, err)
		}
		if err := use(rec); err != nil {
			return err
		}
	}
	return nil
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

// PeekKind reads only the schema message at the start of an IPC stream and
// returns the kind and version named in its metadata. The version is 0
// when missing or not a number.
func PeekKind(b []byte) (Kind, int, error) {
	m, _, eos, err := readFrame(b, 0)
	if err != nil {
		return "", 0, fmt.Errorf("%w: %w", ErrDecode, err)
	}
	if eos || m.typ != msgSchema {
		return "", 0, fmt.Errorf("%w: stream does not start with a schema message", ErrDecode)
	}
	msgs := newMessageList(m)
	defer msgs.release()
	r, err := newIPCReader(msgs, memory.DefaultAllocator)
	if err != nil {
		return "", 0, fmt.Errorf("%w: schema: %v", ErrDecode, err)
	}
	defer r.Release()
	md := r.Schema().Metadata()
	var kind Kind
	version := 0
	if i := md.FindKey(MetaKind); i >= 0 {
		kind = Kind(md.Values()[i])
	}
	if i := md.FindKey(MetaVersion); i >= 0 {
		version, _ = strconv.Atoi(md.Values()[i])
	}
	return kind, version, nil
}
