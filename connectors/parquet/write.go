package parquet

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"github.com/apache/arrow-go/v18/parquet"
	"github.com/apache/arrow-go/v18/parquet/compress"
	"github.com/apache/arrow-go/v18/parquet/pqarrow"
	pq "github.com/parquet-go/parquet-go"
	pqzstd "github.com/parquet-go/parquet-go/compress/zstd"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Target names what a file belongs to.
type Target struct {
	Dir          string // snapshot root
	Run          string
	Topic        string // full topic name
	ContractHash string
}

// WriteOptions tunes the files.
type WriteOptions struct {
	// RowGroupBytes closes a Parquet row group once this many message bytes
	// went into it (default 32 MiB).
	RowGroupBytes int64
	// Mem allocates the Arrow buffers (default memory.DefaultAllocator).
	Mem memory.Allocator
}

func (o *WriteOptions) defaults() {
	if o.RowGroupBytes <= 0 {
		o.RowGroupBytes = 32 << 20
	}
	if o.Mem == nil {
		o.Mem = memory.DefaultAllocator
	}
}

// WriteFile writes msgs — one partition of t.Topic, offsets increasing
// (contiguous except where Kafka itself skips offsets: compaction,
// transaction markers) — to their snapshot file, atomically (see the package doc),
// and returns its path and lineage. An existing file of the same name is
// replaced (its content is the same messages).
func WriteFile(t Target, partition int, msgs []Message, opts WriteOptions) (string, Lineage, error) {
	opts.defaults()
	if len(msgs) == 0 {
		return "", Lineage{}, errors.New("snapshot: no messages to write")
	}
	for i := range msgs {
		if msgs[i].Partition != partition {
			return "", Lineage{}, fmt.Errorf("snapshot: message %d is of partition %d, file of partition %d", msgs[i].Offset, msgs[i].Partition, partition)
		}
		if i > 0 && msgs[i].Offset <= msgs[i-1].Offset {
			return "", Lineage{}, fmt.Errorf("snapshot: %s/%d: offsets %d then %d are not increasing", t.Topic, partition, msgs[i-1].Offset, msgs[i].Offset)
		}
	}
	short := ShortTopic(t.Run, t.Topic)
	kind, version := KindOf(short)
	h := NewContentHash()
	for i := range msgs {
		h.Add(&msgs[i])
	}
	lin := Lineage{
		Run: t.Run, Topic: t.Topic, TopicShort: short, Partition: partition,
		FirstOffset: msgs[0].Offset, LastOffset: msgs[len(msgs)-1].Offset, Messages: int64(len(msgs)),
		SchemaKind: kind, SchemaVersion: version, ContractHash: t.ContractHash, Writer: WriterVersion,
	}
	lin.ContentSHA256, lin.ValuesSHA256 = h.Sums()
	dir := PartitionDir(t.Dir, t.Run, t.Topic, partition)
	name := FileName(lin.FirstOffset, lin.LastOffset)
	err := writeAtomic(dir, name, func(w io.Writer) error {
		if c, ok := dataCodecOf(short); ok {
			return writeData(w, c, &lin, msgs, opts)
		}
		return writeControl(w, &lin, msgs)
	})
	if err != nil {
		return "", lin, fmt.Errorf("snapshot: write %s: %w", filepath.Join(dir, name), err)
	}
	return filepath.Join(dir, name), lin, nil
}

// writeOnly hides Close from the Parquet writers: the caller syncs and
// closes the file.
type writeOnly struct{ io.Writer }

// writeAtomic writes name in dir through a temporary file and its sha256
// sidecar, fsyncs both, renames them into place and fsyncs dir.
func writeAtomic(dir, name string, write func(w io.Writer) error) (err error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, "."+name+".tmp-*")
	if err != nil {
		return err
	}
	var sideTmp string
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
			if sideTmp != "" {
				os.Remove(sideTmp)
			}
		}
	}()
	sum := sha256.New()
	bw := bufio.NewWriterSize(io.MultiWriter(tmp, sum), 1<<20)
	if err = write(writeOnly{bw}); err != nil {
		return err
	}
	if err = bw.Flush(); err != nil {
		return err
	}
	if err = tmp.Sync(); err != nil {
		return err
	}
	if err = tmp.Close(); err != nil {
		return err
	}
	side, err := os.CreateTemp(dir, "."+name+ChecksumSuffix+".tmp-*")
	if err != nil {
		return err
	}
	sideTmp = side.Name()
	_, err = fmt.Fprintf(side, "%s  %s\n", hex.EncodeToString(sum.Sum(nil)), name)
	if err == nil {
		err = side.Sync()
	}
	if cerr := side.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if err = os.Rename(sideTmp, SidecarPath(filepath.Join(dir, name))); err != nil {
		return err
	}
	sideTmp = ""
	if err = os.Rename(tmp.Name(), filepath.Join(dir, name)); err != nil {
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}

// Lineage columns of data-plane files.
var lineageFields = []arrow.Field{
	{Name: "_offset", Type: arrow.PrimitiveTypes.Int64},
	{Name: "_key", Type: arrow.BinaryTypes.String},
	{Name: "_headers", Type: arrow.BinaryTypes.String},
	{Name: "_time_us", Type: arrow.PrimitiveTypes.Int64},
	{Name: "_sha256", Type: &arrow.FixedSizeBinaryType{ByteWidth: 32}},
}

// dataSchema is the codec's schema followed by the lineage columns, with
// the codec's metadata (kind and version).
func dataSchema(c dataCodec) *arrow.Schema {
	s := c.Schema()
	fs := append(append([]arrow.Field{}, s.Fields()...), lineageFields...)
	md := s.Metadata()
	return arrow.NewSchema(fs, &md)
}

func writerProps(s *arrow.Schema, mem memory.Allocator) *parquet.WriterProperties {
	// zstd everywhere; dictionary encoding only for top-level strings
	// (ids repeat), never for token lists (3-4x slower to write).
	opts := []parquet.WriterProperty{
		parquet.WithAllocator(mem),
		parquet.WithCompression(compress.Codecs.Zstd),
		parquet.WithCompressionLevel(1), // zstd's fastest: token ids barely compress
		parquet.WithDictionaryDefault(false),
		parquet.WithCreatedBy(WriterVersion),
		parquet.WithMaxRowGroupLength(1 << 30),
	}
	for _, f := range s.Fields() {
		if f.Type.ID() == arrow.STRING {
			opts = append(opts, parquet.WithDictionaryFor(f.Name, true))
		}
	}
	return parquet.NewWriterProperties(opts...)
}

func headersJSON(hs []pipeline.Header) (string, error) {
	if len(hs) == 0 {
		return "", nil
	}
	b, err := json.Marshal(hs)
	return string(b), err
}

func parseHeaders(s string) ([]pipeline.Header, error) {
	if s == "" {
		return nil, nil
	}
	var hs []pipeline.Header
	if err := json.Unmarshal([]byte(s), &hs); err != nil {
		return nil, err
	}
	return hs, nil
}

// readIPC reads the single-kind record batches of one message value; it
// returns nil (and no error) when the value is not a whole stream of c's
// kind. A stream without its end-of-stream marker is not whole, even when
// it stops between two record batches: its rows would re-encode to other
// bytes than the message's, so it is kept raw like any undecodable value.
func readIPC(mem memory.Allocator, c dataCodec, value []byte) ([]arrow.RecordBatch, error) {
	if len(value) == 0 {
		return nil, nil
	}
	var recs []arrow.RecordBatch
	err := schemas.ReadStream(mem, value, func(rec arrow.RecordBatch) error {
		if !sameColumns(rec.Schema(), c.Schema()) {
			return errNotKind
		}
		rec.Retain()
		recs = append(recs, rec)
		return nil
	})
	if err != nil {
		for _, rec := range recs {
			rec.Release()
		}
		return nil, nil
	}
	return recs, nil
}

// errNotKind stops readIPC at a record batch of another schema.
var errNotKind = errors.New("not the topic's kind")

// sameColumns reports whether got has want's fields and kind metadata.
func sameColumns(got, want *arrow.Schema) bool {
	if got.NumFields() != want.NumFields() {
		return false
	}
	for i := range got.NumFields() {
		g, w := got.Field(i), want.Field(i)
		if g.Name != w.Name || g.Nullable != w.Nullable || !arrow.TypeEqual(g.Type, w.Type) {
			return false
		}
	}
	gm, wm := got.Metadata(), want.Metadata()
	for i, k := range wm.Keys() {
		j := gm.FindKey(k)
		if j < 0 || gm.Values()[j] != wm.Values()[i] {
			return false
		}
	}
	return true
}

func writeData(w io.Writer, c dataCodec, lin *Lineage, msgs []Message, opts WriteOptions) error {
	mem := opts.Mem
	schema := dataSchema(c)
	fw, err := pqarrow.NewFileWriter(schema, w, writerProps(schema, mem),
		pqarrow.NewArrowWriterProperties(pqarrow.WithStoreSchema(), pqarrow.WithAllocator(mem)))
	if err != nil {
		return err
	}
	var raw []Message
	var inGroup int64
	// The records of a row group are written together (one WriteTable per
	// row group): per-message writes cost more than the encoding itself.
	var pending []arrow.RecordBatch
	release := func() {
		for _, r := range pending {
			r.Release()
		}
		pending = pending[:0]
	}
	defer release()
	flush := func() error {
		if len(pending) == 0 {
			return nil
		}
		tbl := array.NewTableFromRecords(schema, pending)
		defer tbl.Release()
		err := fw.WriteTable(tbl, max(tbl.NumRows(), 1))
		release()
		inGroup = 0
		return err
	}
	for i := range msgs {
		m := &msgs[i]
		recs, err := readIPC(mem, c, m.Value)
		if err != nil {
			return err
		}
		rows := int64(0)
		for _, r := range recs {
			rows += r.NumRows()
		}
		if rows == 0 {
			for _, r := range recs {
				r.Release()
			}
			raw = append(raw, *m)
			continue
		}
		for _, r := range recs {
			out, err := withLineage(schema, r, m, mem)
			r.Release()
			if err != nil {
				return err
			}
			pending = append(pending, out)
		}
		inGroup += int64(len(m.Value))
		if inGroup >= opts.RowGroupBytes {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	if err := flush(); err != nil {
		return err
	}
	for _, kv := range lin.pairs() {
		if err := fw.AppendKeyValueMetadata(kv[0], kv[1]); err != nil {
			return err
		}
	}
	if len(raw) > 0 {
		b, err := json.Marshal(raw)
		if err != nil {
			return err
		}
		if err := fw.AppendKeyValueMetadata(MetaRaw, string(b)); err != nil {
			return err
		}
	}
	return fw.Close()
}

// withLineage returns r with the lineage columns of m appended.
func withLineage(schema *arrow.Schema, r arrow.RecordBatch, m *Message, mem memory.Allocator) (arrow.RecordBatch, error) {
	n := int(r.NumRows())
	hdr, err := headersJSON(m.Headers)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(m.Value)
	ob := array.NewInt64Builder(mem)
	kb := array.NewStringBuilder(mem)
	hb := array.NewStringBuilder(mem)
	tb := array.NewInt64Builder(mem)
	sb := array.NewFixedSizeBinaryBuilder(mem, &arrow.FixedSizeBinaryType{ByteWidth: 32})
	defer func() {
		ob.Release()
		kb.Release()
		hb.Release()
		tb.Release()
		sb.Release()
	}()
	ts := timeMicros(m.Time)
	for range n {
		ob.Append(m.Offset)
		kb.Append(string(m.Key))
		hb.Append(hdr)
		tb.Append(ts)
		sb.Append(sum[:])
	}
	cols := make([]arrow.Array, 0, schema.NumFields())
	for i := range r.NumCols() {
		cols = append(cols, r.Column(int(i)))
	}
	extra := []arrow.Array{ob.NewArray(), kb.NewArray(), hb.NewArray(), tb.NewArray(), sb.NewArray()}
	defer func() {
		for _, a := range extra {
			a.Release()
		}
	}()
	cols = append(cols, extra...)
	return array.NewRecordBatch(schema, cols, int64(n)), nil
}

// ControlRow is the row of a control-plane file: the message's lineage
// and raw value, and the typed fields analysts query (zero when the value
// does not decode; DecodeError says why).
type ControlRow struct {
	Offset      int64  `parquet:"_offset"`
	Key         string `parquet:"_key"`
	Headers     string `parquet:"_headers"`
	TimeUS      int64  `parquet:"_time_us"`
	Value       []byte `parquet:"_value"` // BYTE_ARRAY; never a list<uint8> field, which parquet-go writes empty
	DecodeError string `parquet:"_decode_error"`

	// Census events (docs/PIPELINE.md §6, §9).
	EventID       string  `parquet:"event_id"`
	RunID         string  `parquet:"run_id"`
	AttemptID     string  `parquet:"attempt_id"`
	TaskID        string  `parquet:"task_id"`
	GroupID       string  `parquet:"group_id"`
	Kind          string  `parquet:"kind"`
	Stage         string  `parquet:"stage"`
	Reason        string  `parquet:"reason"`
	Detail        string  `parquet:"detail"`
	Infra         bool    `parquet:"infra"`
	BatchID       string  `parquet:"batch_id"`
	Update        int64   `parquet:"update"`
	PolicyVersion int64   `parquet:"policy_version"`
	Tokens        int64   `parquet:"tokens"`
	StaleTokens   int64   `parquet:"stale_tokens"` // taken out by the lag rule (docs/PIPELINE.md §15)
	Reward        float64 `parquet:"reward"`
	LatencyUS     int64   `parquet:"latency_us"`
	At            int64   `parquet:"at_us"`

	// Policy releases (docs/SYSTEMS.md §8).
	TrainingStep   int64  `parquet:"training_step"`
	CheckpointHash string `parquet:"checkpoint_hash"`
	CheckpointURI  string `parquet:"checkpoint_uri"`
	ContractHash   string `parquet:"contract_hash"`
	Ready          bool   `parquet:"ready"`

	// Pack window records (lineage of each batch).
	BatchIndex      int64    `parquet:"batch_index"`
	TrainerVersion  int64    `parquet:"trainer_version"`
	ClosedBy        string   `parquet:"closed_by"`
	Admitted        []string `parquet:"admitted,list"`
	FilteredIDs     []string `parquet:"filtered_ids,list"`
	FilteredReasons []string `parquet:"filtered_reasons,list"`
	TrainedTokens   int64    `parquet:"trained_tokens"`
	Rows            int64    `parquet:"rows"`
	Efficiency      float64  `parquet:"efficiency"`

	// Incidents and quarantine.
	Source          string `parquet:"source"`
	SourceTopic     string `parquet:"source_topic"`
	SourcePartition int64  `parquet:"source_partition"`
	SourceOffset    int64  `parquet:"source_offset"`
}

// controlJSON is the union of the JSON fields of the control-plane
// documents (census events, incidents, policy releases, window records).
type controlJSON struct {
	EventID        string  `json:"event_id"`
	IncidentID     string  `json:"incident_id"`
	RunID          string  `json:"run_id"`
	AttemptID      string  `json:"attempt_id"`
	TaskID         string  `json:"task_id"`
	GroupID        string  `json:"group_id"`
	Kind           string  `json:"kind"`
	Stage          string  `json:"stage"`
	Reason         string  `json:"reason"`
	Detail         string  `json:"detail"`
	Infra          bool    `json:"infra"`
	BatchID        string  `json:"batch_id"`
	Update         int64   `json:"update"`
	PolicyVersion  int64   `json:"policy_version"`
	Tokens         int64   `json:"tokens"`
	StaleTokens    int64   `json:"stale_tokens"`
	Reward         float64 `json:"reward"`
	LatencyUS      int64   `json:"latency_us"`
	At             int64   `json:"at_us"`
	TrainingStep   int64   `json:"training_step"`
	CheckpointHash string  `json:"checkpoint_hash"`
	CheckpointURI  string  `json:"checkpoint_uri"`
	ContractHash   string  `json:"contract_hash"`
	Ready          bool    `json:"ready"`
	BatchIndex     int64   `json:"batch_index"`
	TrainerVersion int64   `json:"trainer_version"`
	ClosedBy       string  `json:"closed_by"`
	TrainedTokens  int64   `json:"trained_tokens"`
	Rows           int64   `json:"rows"`
	Efficiency     float64 `json:"efficiency"`
	Source         string  `json:"source"`
}

// jsonDocBody unwraps the schemas JSON document envelope ({"kind",
// "version", "body"}) when present.
type jsonDocBody struct {
	Kind    string          `json:"kind"`
	Version json.RawMessage `json:"version"`
	Data    json.RawMessage `json:"data"`
}

func controlRow(m *Message, kind string) (ControlRow, error) {
	hdr, err := headersJSON(m.Headers)
	if err != nil {
		return ControlRow{}, err
	}
	r := ControlRow{Offset: m.Offset, Key: string(m.Key), Headers: hdr, TimeUS: timeMicros(m.Time), Value: m.Value}
	if r.Value == nil {
		r.Value = []byte{}
	}
	switch kind {
	case KindQuarantine:
		for _, h := range m.Headers {
			switch h.Key {
			case schemas.HeaderReason:
				r.Reason = string(h.Value)
			case schemas.HeaderDetail:
				r.Detail = string(h.Value)
			case schemas.HeaderStage:
				r.Stage = string(h.Value)
			case schemas.HeaderSourceTopic:
				r.SourceTopic = string(h.Value)
			case schemas.HeaderSourcePartition:
				fmt.Sscan(string(h.Value), &r.SourcePartition)
			case schemas.HeaderSourceOffset:
				fmt.Sscan(string(h.Value), &r.SourceOffset)
			}
		}
		return r, nil
	case KindRaw:
		return r, nil
	}
	body := m.Value
	var env jsonDocBody
	if json.Unmarshal(m.Value, &env) == nil && len(env.Data) > 0 && env.Kind != "" && len(env.Version) > 0 {
		body = env.Data
	}
	var j struct {
		controlJSON
		AdmittedJ []string                 `json:"admitted"`
		FilteredJ []schemas.WindowDecision `json:"filtered"`
	}
	if err := json.Unmarshal(body, &j); err != nil {
		r.DecodeError = err.Error()
		return r, nil
	}
	c := j.controlJSON
	r.EventID, r.RunID, r.AttemptID, r.TaskID, r.GroupID = c.EventID, c.RunID, c.AttemptID, c.TaskID, c.GroupID
	if r.EventID == "" {
		r.EventID = c.IncidentID
	}
	r.Kind, r.Stage, r.Reason, r.Detail, r.Infra = c.Kind, c.Stage, c.Reason, c.Detail, c.Infra
	r.BatchID, r.Update, r.PolicyVersion, r.Tokens = c.BatchID, c.Update, c.PolicyVersion, c.Tokens
	r.StaleTokens, r.Reward, r.LatencyUS, r.At = c.StaleTokens, c.Reward, c.LatencyUS, c.At
	r.TrainingStep, r.CheckpointHash, r.CheckpointURI, r.ContractHash, r.Ready = c.TrainingStep, c.CheckpointHash, c.CheckpointURI, c.ContractHash, c.Ready
	r.BatchIndex, r.TrainerVersion, r.ClosedBy = c.BatchIndex, c.TrainerVersion, c.ClosedBy
	r.Admitted = j.AdmittedJ
	for _, f := range j.FilteredJ {
		r.FilteredIDs = append(r.FilteredIDs, f.RecordID)
		r.FilteredReasons = append(r.FilteredReasons, f.Filter)
	}
	r.TrainedTokens, r.Rows, r.Efficiency, r.Source = c.TrainedTokens, c.Rows, c.Efficiency, c.Source
	return r, nil
}

func writeControl(w io.Writer, lin *Lineage, msgs []Message) error {
	rows := make([]ControlRow, len(msgs))
	for i := range msgs {
		r, err := controlRow(&msgs[i], lin.SchemaKind)
		if err != nil {
			return err
		}
		rows[i] = r
	}
	opts := []pq.WriterOption{pq.Compression(&pqzstd.Codec{}), pq.CreatedBy("trajflow", WriterVersion, "")}
	for _, kv := range lin.pairs() {
		opts = append(opts, pq.KeyValueMetadata(kv[0], kv[1]))
	}
	pw := pq.NewGenericWriter[ControlRow](w, opts...)
	if _, err := pw.Write(rows); err != nil {
		return err
	}
	return pw.Close()
}
