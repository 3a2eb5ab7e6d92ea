package parquet

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/bitutil"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"github.com/apache/arrow-go/v18/parquet/file"
	"github.com/apache/arrow-go/v18/parquet/pqarrow"
	pq "github.com/parquet-go/parquet-go"
)

// ReadOptions tunes ReadFile and ReadRun.
type ReadOptions struct {
	Mem memory.Allocator // default memory.DefaultAllocator
	// Partial makes ReadRun return what it could read when files are
	// unreadable, listing them in Run.Unreadable, instead of a
	// *ReadError. ReadFile ignores it.
	Partial bool
}

// ReadFile reads and verifies one snapshot file and returns its lineage
// and its messages in offset order, each value byte for byte as it was in
// Kafka. Every failure to verify — the sidecar checksum, the lineage
// against the file's name and directory, a message's sha256, the content
// hash, offsets that are not contiguous — is an error wrapping ErrCorrupt
// that names the file. Third-party decoders never panic through it.
func ReadFile(path string, opts ReadOptions) (lin Lineage, msgs []Message, err error) {
	if opts.Mem == nil {
		opts.Mem = memory.DefaultAllocator
	}
	defer func() {
		if r := recover(); r != nil {
			lin, msgs, err = Lineage{}, nil, fmt.Errorf("%w: snapshot file %s: decoder failure: %v", ErrCorrupt, path, r)
		}
	}()
	lin, msgs, err = readFile(path, opts)
	if err != nil {
		if !errors.Is(err, ErrCorrupt) && !errors.Is(err, os.ErrNotExist) {
			err = fmt.Errorf("%w: %w", ErrCorrupt, err)
		}
		return lin, nil, fmt.Errorf("snapshot file %s: %w", path, err)
	}
	return lin, msgs, nil
}

func readFile(path string, opts ReadOptions) (Lineage, []Message, error) {
	part, ok := strings.CutPrefix(filepath.Base(filepath.Dir(path)), "partition=")
	if !ok {
		return Lineage{}, nil, fmt.Errorf("%w: directory %s is not partition=<number>", ErrCorrupt, filepath.Base(filepath.Dir(path)))
	}
	if _, err := parsePartition(part); err != nil {
		return Lineage{}, nil, err
	}
	root := layoutRunDir(path)
	data, err := ReadRegular(path, root, MaxFileBytes)
	if err != nil {
		return Lineage{}, nil, err
	}
	if err := checkSidecar(path, root, data); err != nil {
		return Lineage{}, nil, err
	}
	first, last, ok := ParseFileName(path)
	if !ok {
		return Lineage{}, nil, fmt.Errorf("%w: name is not <first>-<last>.parquet", ErrCorrupt)
	}
	short := filepath.Base(filepath.Dir(filepath.Dir(path)))
	short = strings.TrimPrefix(short, "topic=")
	var lin Lineage
	var msgs []Message
	if IsDataPlane(short) {
		lin, msgs, err = readData(data, short, opts.Mem)
	} else {
		lin, msgs, err = readControl(data)
	}
	if err != nil {
		return lin, nil, err
	}
	switch {
	case lin.FirstOffset != first || lin.LastOffset != last:
		return lin, nil, fmt.Errorf("%w: lineage offsets %d-%d, file name %d-%d", ErrCorrupt, lin.FirstOffset, lin.LastOffset, first, last)
	case lin.TopicShort != short:
		return lin, nil, fmt.Errorf("%w: lineage topic %q, directory topic=%s", ErrCorrupt, lin.TopicShort, short)
	case strconv.Itoa(lin.Partition) != part:
		return lin, nil, fmt.Errorf("%w: lineage partition %d, directory partition=%s", ErrCorrupt, lin.Partition, part)
	case int64(len(msgs)) != lin.Messages:
		return lin, nil, fmt.Errorf("%w: %d messages, lineage says %d", ErrCorrupt, len(msgs), lin.Messages)
	}
	h := NewContentHash()
	for i := range msgs {
		msgs[i].Partition = lin.Partition
		if i > 0 && msgs[i].Offset <= msgs[i-1].Offset {
			return lin, nil, fmt.Errorf("%w: offset %d follows offset %d", ErrCorrupt, msgs[i].Offset, msgs[i-1].Offset)
		}
		h.Add(&msgs[i])
	}
	if len(msgs) > 0 && (msgs[0].Offset != lin.FirstOffset || msgs[len(msgs)-1].Offset != lin.LastOffset) {
		return lin, nil, fmt.Errorf("%w: messages span offsets %d-%d, lineage says %d-%d", ErrCorrupt, msgs[0].Offset, msgs[len(msgs)-1].Offset, lin.FirstOffset, lin.LastOffset)
	}
	content, values := h.Sums()
	if content != lin.ContentSHA256 || values != lin.ValuesSHA256 {
		return lin, nil, fmt.Errorf("%w: content sha256 %s, lineage says %s", ErrCorrupt, content, lin.ContentSHA256)
	}
	return lin, msgs, nil
}

// checkSidecar compares the file's sha256 with its .sha256 sidecar, a
// file of root (see ReadRegular).
func checkSidecar(path, root string, data []byte) error {
	side, err := ReadRegular(SidecarPath(path), root, maxSidecarBytes)
	if err != nil {
		return fmt.Errorf("%w: checksum sidecar: %w", ErrCorrupt, err)
	}
	want, _, _ := strings.Cut(strings.TrimSpace(string(side)), " ")
	sum := sha256.Sum256(data)
	if got := hex.EncodeToString(sum[:]); got != want {
		return fmt.Errorf("%w: file sha256 %s, sidecar says %q", ErrCorrupt, got, want)
	}
	return nil
}

func readData(data []byte, short string, mem memory.Allocator) (Lineage, []Message, error) {
	c, err := codecFor(short)
	if err != nil {
		return Lineage{}, nil, err
	}
	pf, err := file.NewParquetReader(bytes.NewReader(data))
	if err != nil {
		return Lineage{}, nil, fmt.Errorf("%w: parquet: %w", ErrCorrupt, err)
	}
	defer pf.Close()
	kv := pf.MetaData().KeyValueMetadata()
	lookup := func(k string) (string, bool) {
		v := kv.FindValue(k)
		if v == nil {
			return "", false
		}
		return *v, true
	}
	lin, err := lineageFrom(lookup)
	if err != nil {
		return lin, nil, err
	}
	if lin.SchemaKind != string(c.Kind()) || lin.SchemaVersion != c.Version() {
		return lin, nil, fmt.Errorf("%w: schema %s v%d, topic %s holds %s v%d", ErrCorrupt, lin.SchemaKind, lin.SchemaVersion, short, c.Kind(), c.Version())
	}
	// The stored Arrow schema is compared as bytes with the one this
	// writer stores for the kind before anything decodes it: the IPC
	// schema decoder allocates what a corrupted field count claims.
	if want, err := storedSchema(c); err != nil {
		return lin, nil, err
	} else if got, _ := lookup(arrowSchemaKey); got != want {
		return lin, nil, fmt.Errorf("%w: stored Arrow schema is not the %s v%d schema", ErrCorrupt, c.Kind(), c.Version())
	}
	nrows := pf.NumRows()
	if nrows < 0 || nrows > maxRowsPerFile {
		return lin, nil, fmt.Errorf("%w: %d rows", ErrCorrupt, nrows)
	}
	var msgs []Message
	if raw, ok := lookup(MetaRaw); ok {
		if err := json.Unmarshal([]byte(raw), &msgs); err != nil {
			return lin, nil, fmt.Errorf("%w: %s: %w", ErrCorrupt, MetaRaw, err)
		}
	}
	if nrows > 0 {
		fr, err := pqarrow.NewFileReader(pf, pqarrow.ArrowReadProperties{BatchSize: nrows}, mem)
		if err != nil {
			return lin, nil, fmt.Errorf("%w: arrow schema: %w", ErrCorrupt, err)
		}
		rr, err := fr.GetRecordReader(context.Background(), nil, nil)
		if err != nil {
			return lin, nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
		}
		defer rr.Release()
		for {
			rec, err := rr.Read()
			if rec != nil {
				got, gerr := messagesOf(c, rec)
				if gerr != nil {
					return lin, nil, gerr
				}
				msgs = append(msgs, got...)
			}
			if err != nil {
				if errors.Is(err, io.EOF) {
					break
				}
				return lin, nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
			}
			if rec == nil {
				break
			}
		}
	}
	slices.SortStableFunc(msgs, func(a, b Message) int {
		switch {
		case a.Offset < b.Offset:
			return -1
		case a.Offset > b.Offset:
			return 1
		}
		return 0
	})
	return lin, msgs, nil
}

// messagesOf regroups the rows of rec by _offset and re-encodes each
// message, checking it against its _sha256.
func messagesOf(c dataCodec, rec arrow.RecordBatch) ([]Message, error) {
	s := rec.Schema()
	col := func(name string) (arrow.Array, error) {
		idx := s.FieldIndices(name)
		if len(idx) != 1 {
			return nil, fmt.Errorf("%w: column %s missing", ErrCorrupt, name)
		}
		return rec.Column(idx[0]), nil
	}
	var cols [5]arrow.Array
	for i, f := range lineageFields {
		a, err := col(f.Name)
		if err != nil {
			return nil, err
		}
		if !arrow.TypeEqual(a.DataType(), f.Type) {
			return nil, fmt.Errorf("%w: column %s is %s", ErrCorrupt, f.Name, a.DataType())
		}
		cols[i] = a
	}
	offs, keys, hdrs := cols[0].(*array.Int64), cols[1].(*array.String), cols[2].(*array.String)
	times, sums := cols[3].(*array.Int64), cols[4].(*array.FixedSizeBinary)
	cs := c.Schema()
	data := make([]arrow.Array, cs.NumFields())
	for i, f := range cs.Fields() {
		a, err := col(f.Name)
		if err != nil {
			return nil, err
		}
		data[i] = a
	}
	var out []Message
	n := int(rec.NumRows())
	for i := 0; i < n; {
		j := i + 1
		for j < n && offs.Value(j) == offs.Value(i) {
			j++
		}
		m, err := oneMessage(c, cs, data, i, j)
		if err != nil {
			return nil, fmt.Errorf("offset %d: %w", offs.Value(i), err)
		}
		m.Offset = offs.Value(i)
		m.Key = []byte(keys.Value(i))
		if len(m.Key) == 0 {
			m.Key = nil
		}
		if m.Headers, err = parseHeaders(hdrs.Value(i)); err != nil {
			return nil, fmt.Errorf("%w: offset %d: headers: %w", ErrCorrupt, m.Offset, err)
		}
		m.Time = fromMicros(times.Value(i))
		sum := sha256.Sum256(m.Value)
		if !bytes.Equal(sum[:], sums.Value(i)) {
			return nil, fmt.Errorf("%w: offset %d: re-encoded message sha256 %x, recorded %x", ErrCorrupt, m.Offset, sum, sums.Value(i))
		}
		out = append(out, m)
		i = j
	}
	return out, nil
}

func oneMessage(c dataCodec, cs *arrow.Schema, data []arrow.Array, i, j int) (m Message, err error) {
	cols := make([]arrow.Array, len(data))
	for k, a := range data {
		d := array.NewSliceData(a.Data(), int64(i), int64(j))
		rd, err := retype(d, cs.Field(k).Type)
		d.Release()
		if err != nil {
			for _, c := range cols[:k] {
				c.Release()
			}
			return m, err
		}
		cols[k] = array.MakeFromData(rd)
		rd.Release()
	}
	rec := array.NewRecordBatch(cs, cols, int64(j-i))
	for _, a := range cols {
		a.Release()
	}
	defer rec.Release()
	v, err := c.reencode(rec)
	if err != nil {
		return m, fmt.Errorf("%w: re-encode: %w", ErrCorrupt, err)
	}
	m.Value = v
	return m, nil
}

// retype gives d the type dt when they differ only in field names (the
// Parquet writer names list elements "element", the codecs "item").
//
// It also computes the null count of sliced data, which the codecs check.
func retype(d arrow.ArrayData, dt arrow.DataType) (arrow.ArrayData, error) {
	if d.DataType().ID() != dt.ID() {
		return nil, fmt.Errorf("%w: column type %s, want %s", ErrCorrupt, d.DataType(), dt)
	}
	var childTypes []arrow.DataType
	switch t := dt.(type) {
	case *arrow.ListType:
		childTypes = []arrow.DataType{t.Elem()}
	case *arrow.LargeListType:
		childTypes = []arrow.DataType{t.Elem()}
	case *arrow.StructType:
		for _, f := range t.Fields() {
			childTypes = append(childTypes, f.Type)
		}
	default:
		if !arrow.TypeEqual(d.DataType(), dt) {
			return nil, fmt.Errorf("%w: column type %s, want %s", ErrCorrupt, d.DataType(), dt)
		}
	}
	kids := d.Children()
	if len(kids) != len(childTypes) {
		return nil, fmt.Errorf("%w: column type %s, want %s", ErrCorrupt, d.DataType(), dt)
	}
	children := make([]arrow.ArrayData, len(kids))
	for i := range kids {
		k, err := retype(kids[i], childTypes[i])
		if err != nil {
			for _, c := range children[:i] {
				c.Release()
			}
			return nil, err
		}
		children[i] = k
	}
	nulls := 0
	if bufs := d.Buffers(); len(bufs) > 0 && bufs[0] != nil && d.Len() > 0 {
		nulls = d.Len() - bitutil.CountSetBits(bufs[0].Bytes(), d.Offset(), d.Len())
	}
	out := array.NewData(dt, d.Len(), d.Buffers(), children, nulls, d.Offset())
	for _, c := range children {
		c.Release()
	}
	return out, nil
}

func readControl(data []byte) (Lineage, []Message, error) {
	f, err := pq.OpenFile(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		return Lineage{}, nil, fmt.Errorf("%w: parquet: %w", ErrCorrupt, err)
	}
	lin, err := lineageFrom(f.Lookup)
	if err != nil {
		return lin, nil, err
	}
	r := pq.NewGenericReader[ControlRow](f)
	defer r.Close()
	// The row count is the footer's claim: rows are read a chunk at a
	// time and made messages, never allocated by it (a ControlRow takes
	// over 500 bytes of memory and may take a few in the file), and the
	// rows read must match it.
	nrows := r.NumRows()
	chunk := make([]ControlRow, min(max(nrows, 0), controlReadChunk))
	msgs := make([]Message, 0, len(chunk))
	for int64(len(msgs)) < nrows {
		clear(chunk) // read into fresh memory: messages keep the values the last read filled
		k, err := r.Read(chunk)
		for _, row := range chunk[:k] {
			hs, herr := parseHeaders(row.Headers)
			if herr != nil {
				return lin, nil, fmt.Errorf("%w: offset %d: headers: %w", ErrCorrupt, row.Offset, herr)
			}
			m := Message{Offset: row.Offset, Headers: hs, Time: fromMicros(row.TimeUS), Value: row.Value}
			if row.Key != "" {
				m.Key = []byte(row.Key)
			}
			msgs = append(msgs, m)
		}
		if errors.Is(err, io.EOF) || (err == nil && k == 0) {
			break
		}
		if err != nil {
			return lin, nil, fmt.Errorf("%w: rows: %w", ErrCorrupt, err)
		}
	}
	if int64(len(msgs)) != nrows {
		return lin, nil, fmt.Errorf("%w: footer declares %d rows, %d read", ErrCorrupt, nrows, len(msgs))
	}
	return lin, msgs, nil
}

// controlReadChunk is how many rows of a control-plane file are read at
// once: about half a MiB of ControlRows, whatever the footer claims.
const controlReadChunk = 1024

// arrowSchemaKey is where pqarrow stores the Arrow schema.
const arrowSchemaKey = "ARROW:schema"

// maxRowsPerFile bounds the rows a file may declare (a file holds at most
// RollBytes of messages; a row takes bytes).
const maxRowsPerFile = 1 << 22

var storedSchemas sync.Map // schemas.Kind -> string

// storedSchema returns the ARROW:schema value this writer stores for c.
func storedSchema(c dataCodec) (string, error) {
	if v, ok := storedSchemas.Load(c.Kind()); ok {
		return v.(string), nil
	}
	schema := dataSchema(c)
	var buf bytes.Buffer
	fw, err := pqarrow.NewFileWriter(schema, &buf, writerProps(schema, memory.DefaultAllocator),
		pqarrow.NewArrowWriterProperties(pqarrow.WithStoreSchema()))
	if err != nil {
		return "", err
	}
	if err := fw.Close(); err != nil {
		return "", err
	}
	pf, err := file.NewParquetReader(bytes.NewReader(buf.Bytes()))
	if err != nil {
		return "", err
	}
	defer pf.Close()
	v := pf.MetaData().KeyValueMetadata().FindValue(arrowSchemaKey)
	if v == nil {
		return "", fmt.Errorf("snapshot: pqarrow stored no %s", arrowSchemaKey)
	}
	storedSchemas.Store(c.Kind(), *v)
	return *v, nil
}
