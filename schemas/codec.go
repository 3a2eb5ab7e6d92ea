package schemas

import (
	"fmt"
	"strconv"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/trajflow/trajflow/schemas/internal/rowipc"
)

// Codec encodes and decodes rows of one record kind as Arrow data. The wire
// form (docs/GUARANTEES.md "Wire format") is one self-describing Arrow IPC stream
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
	kind Kind
	rows *rowipc.Codec[T]
}

// nullableLists are the list columns where nil ("not computed") and empty
// differ: ref_logprobs is nil when no reference model ran. Every other
// list column stores nil and empty alike.
var nullableLists = map[string]bool{"ref_logprobs": true}

// newCodec derives the columns of T (the rules are in the package
// documentation) and names kind at its current version in the schema
// metadata.
func newCodec[T any](kind Kind) *Codec[T] {
	md := arrow.NewMetadata(
		[]string{MetaKind, MetaVersion},
		[]string{string(kind), strconv.Itoa(Versions[kind])},
	)
	return codecWith[T](kind, md)
}

// codecWith is the codec of T for kind with schema metadata md.
func codecWith[T any](kind Kind, md arrow.Metadata) *Codec[T] {
	check := func(s *arrow.Schema) error { return checkKind(kind, s) }
	return &Codec[T]{kind: kind, rows: rowipc.New[T](md, nullableLists, check)}
}

// Kind is the record kind of the codec.
func (c *Codec[T]) Kind() Kind { return c.kind }

// Version is the schema version the codec writes and the only one it reads.
func (c *Codec[T]) Version() int { return Versions[c.kind] }

// Schema is the Arrow schema of the kind, with MetaKind and MetaVersion in
// its metadata.
func (c *Codec[T]) Schema() *arrow.Schema { return c.rows.Schema() }

// ToRecord builds one record batch holding rows. The caller releases it.
// List values may share memory with rows: when the non-empty slices of a
// fixed-width list column lie back to back in memory in row order (as
// DecodeShared and Decode leave them), the column's values buffer is that
// memory, not a copy. Rows must not be modified while the record is alive.
func (c *Codec[T]) ToRecord(mem memory.Allocator, rows []T) (arrow.RecordBatch, error) {
	rec, err := c.rows.ToRecord(mem, rows)
	if err != nil {
		return nil, c.encodeErr(err)
	}
	return rec, nil
}

// Encode returns rows as one Arrow IPC stream (schema, one record batch,
// end-of-stream marker). An empty slice encodes a batch of zero rows. The
// stream is written straight from the rows, byte for byte what Arrow's
// stream writer writes for ToRecord's record; mem is not used (no Arrow
// arrays are built).
func (c *Codec[T]) Encode(_ memory.Allocator, rows []T) ([]byte, error) {
	b, _, err := c.rows.Encode(rows, false)
	if err != nil {
		return nil, c.encodeErr(err)
	}
	return b, nil
}

// EncodePooled is Encode into a buffer from the package's buffer pool,
// which spares the allocation (and zeroing) of a fresh output for every
// message. release hands the buffer back: call it at most once, when
// nothing references b any more (for a Kafka output, once its write has
// completed: pipeline.Output.Release). Not calling it is safe; the buffer
// is then garbage collected.
func (c *Codec[T]) EncodePooled(rows []T) (b []byte, release func(), err error) {
	b, release, err = c.rows.Encode(rows, true)
	if err != nil {
		return nil, nil, c.encodeErr(err)
	}
	return b, release, nil
}

// FromRecord reads the rows of rec. The schema metadata of rec must name
// the codec's kind and version (*VersionError otherwise); columns are found
// by name, extra columns are ignored.
func (c *Codec[T]) FromRecord(rec arrow.RecordBatch) ([]T, error) {
	rows, err := c.rows.FromRecord(rec, false)
	return rows, c.decodeErr(err)
}

// Decode reads the rows of one IPC stream written by Encode.
func (c *Codec[T]) Decode(mem memory.Allocator, b []byte) ([]T, error) {
	rows, err := c.rows.Decode(mem, b, false)
	return rows, c.decodeErr(err)
}

// DecodeShared is Decode without the copy of fixed-width list values
// (token ids, log-probs, masks): the rows' list slices point into b, so b
// must not be modified while the rows are in use. Values of a misaligned
// buffer are still copied. Encoding such rows again in their decoded order
// shares the same memory (see ToRecord), so a stage that forwards columns
// unchanged moves their bytes once, into the output stream.
func (c *Codec[T]) DecodeShared(mem memory.Allocator, b []byte) ([]T, error) {
	rows, err := c.rows.Decode(mem, b, true)
	return rows, c.decodeErr(err)
}

func (c *Codec[T]) encodeErr(err error) error {
	return fmt.Errorf("schemas: encode %s: %w", c.kind, err)
}

// decodeErr wraps a structural error of the engine in ErrDecode; a
// *VersionError (from checkKind) is returned as it is.
func (c *Codec[T]) decodeErr(err error) error {
	if _, ok := err.(*VersionError); ok || err == nil {
		return err
	}
	return fmt.Errorf("%w: %s: %w", ErrDecode, c.kind, err)
}

// checkKind returns a *VersionError unless the schema metadata names kind
// at its current version.
func checkKind(kind Kind, s *arrow.Schema) error {
	md := s.Metadata()
	return checkVersion(kind, metaValue(md, MetaKind), metaValue(md, MetaVersion))
}

// metaValue is the value of key in md, "" when absent.
func metaValue(md arrow.Metadata, key string) string {
	if i := md.FindKey(key); i >= 0 {
		return md.Values()[i]
	}
	return ""
}

func checkVersion(kind Kind, gotKind, gotVersion string) error {
	known := Versions[kind]
	if gotKind != string(kind) || gotVersion != strconv.Itoa(known) {
		return &VersionError{WantKind: kind, GotKind: gotKind, Got: gotVersion, Known: known}
	}
	return nil
}

// PeekKind reads only the schema message at the start of an IPC stream and
// returns the kind and version named in its metadata. The version is 0
// when missing or not a number.
func PeekKind(b []byte) (Kind, int, error) {
	md, err := rowipc.PeekMetadata(b)
	if err != nil {
		return "", 0, fmt.Errorf("%w: %w", ErrDecode, err)
	}
	version, _ := strconv.Atoi(metaValue(md, MetaVersion))
	return Kind(metaValue(md, MetaKind)), version, nil
}

// ReadStream reads an Arrow IPC stream held in b that may carry any number
// of record batches (a file written by Arrow's stream writer, as the
// offline tools read and write): one schema message, the record batches,
// and the end-of-stream marker. A stream that stops without the marker is
// an error wrapping ErrDecode even when it stops exactly between two
// record batches, so a stream cut short is never read as a shorter one.
// use is called with each record batch in order; the record is released
// when use returns (Retain it to keep it). Framing is checked as for
// Decode. The kind is not checked (DecodeStream does).
func ReadStream(mem memory.Allocator, b []byte, use func(arrow.RecordBatch) error) error {
	if err := rowipc.ReadBatches(mem, b, nil, use); err != nil {
		return fmt.Errorf("%w: %w", ErrDecode, err)
	}
	return nil
}

// DecodeStream reads the rows of every record batch of a stream read by
// ReadStream, in order. The schema metadata must name the codec's kind and
// version (*VersionError otherwise). A stream of a schema and no record
// batch holds no rows.
func (c *Codec[T]) DecodeStream(mem memory.Allocator, b []byte) ([]T, error) {
	var rows []T
	err := rowipc.ReadBatches(mem, b, func(s *arrow.Schema) error { return checkKind(c.kind, s) },
		func(rec arrow.RecordBatch) error {
			got, err := c.rows.ReadRows(rec, false)
			rows = append(rows, got...)
			return err
		})
	if err != nil {
		return nil, c.decodeErr(err)
	}
	return rows, nil
}
