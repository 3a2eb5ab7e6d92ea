package parquet

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/trajflow/trajflow/pipeline"
)

// WriterVersion names this writer in every file's lineage.
const WriterVersion = "trajflow-snapshot/1"

// Lineage metadata keys of every snapshot file.
const (
	MetaLineage       = "trajflow.lineage"        // lineage format version ("1")
	MetaRun           = "trajflow.run"            // run id
	MetaTopic         = "trajflow.topic"          // full Kafka topic name
	MetaTopicShort    = "trajflow.topic_short"    // topic name without the run prefix
	MetaPartition     = "trajflow.partition"      // Kafka partition
	MetaFirstOffset   = "trajflow.first_offset"   // first Kafka offset held
	MetaLastOffset    = "trajflow.last_offset"    // last Kafka offset held
	MetaMessages      = "trajflow.messages"       // number of messages held (last-first+1 unless Kafka skipped offsets)
	MetaSchemaKind    = "trajflow.schema_kind"    // schemas.Kind, or "json:<name>" / "raw" for control topics
	MetaSchemaVersion = "trajflow.schema_version" // version of that kind
	MetaContractHash  = "trajflow.contract_hash"  // hash of the run's learning contract
	MetaWriter        = "trajflow.writer"         // WriterVersion
	MetaContentSHA256 = "trajflow.content_sha256" // sha256 over every message (see ContentHash)
	MetaValuesSHA256  = "trajflow.values_sha256"  // sha256 over the framed message values alone
	MetaRaw           = "trajflow.raw_messages"   // JSON []Message that did not decode as the topic's kind
)

// ErrCorrupt wraps every failure to verify a snapshot file: a checksum or
// lineage mismatch, or bytes that do not decode.
var ErrCorrupt = errors.New("snapshot: corrupt")

// Message is one Kafka record of a snapshot.
type Message struct {
	Partition int               `json:"partition"`
	Offset    int64             `json:"offset"`
	Key       []byte            `json:"key"`
	Headers   []pipeline.Header `json:"headers"`
	Time      time.Time         `json:"time"`
	Value     []byte            `json:"value"`
}

// FromPipeline converts a runtime message.
func FromPipeline(m pipeline.Message) Message {
	return Message{Partition: m.Partition, Offset: m.Offset, Key: m.Key, Headers: m.Headers, Time: m.Time, Value: m.Value}
}

// Lineage is what a snapshot file records about its content.
type Lineage struct {
	Run           string
	Topic         string
	TopicShort    string
	Partition     int
	FirstOffset   int64
	LastOffset    int64
	Messages      int64
	SchemaKind    string
	SchemaVersion int
	ContractHash  string
	Writer        string
	ContentSHA256 string
	ValuesSHA256  string
}

func (l *Lineage) pairs() [][2]string {
	return [][2]string{
		{MetaLineage, "1"}, {MetaRun, l.Run}, {MetaTopic, l.Topic}, {MetaTopicShort, l.TopicShort},
		{MetaPartition, strconv.Itoa(l.Partition)},
		{MetaFirstOffset, strconv.FormatInt(l.FirstOffset, 10)},
		{MetaLastOffset, strconv.FormatInt(l.LastOffset, 10)},
		{MetaMessages, strconv.FormatInt(l.Messages, 10)},
		{MetaSchemaKind, l.SchemaKind}, {MetaSchemaVersion, strconv.Itoa(l.SchemaVersion)},
		{MetaContractHash, l.ContractHash}, {MetaWriter, l.Writer},
		{MetaContentSHA256, l.ContentSHA256}, {MetaValuesSHA256, l.ValuesSHA256},
	}
}

// lineageFrom parses the lineage keys; lookup returns a key's value.
func lineageFrom(lookup func(string) (string, bool)) (Lineage, error) {
	var l Lineage
	var errs []error
	get := func(k string) string {
		v, ok := lookup(k)
		if !ok {
			errs = append(errs, fmt.Errorf("missing metadata key %s", k))
		}
		return v
	}
	num := func(k string) int64 {
		s := get(k)
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil && s != "" {
			errs = append(errs, fmt.Errorf("metadata key %s: %q is not an integer", k, s))
		}
		return n
	}
	if v := get(MetaLineage); v != "1" && v != "" {
		errs = append(errs, fmt.Errorf("lineage format %q, want 1", v))
	}
	l.Run, l.Topic, l.TopicShort = get(MetaRun), get(MetaTopic), get(MetaTopicShort)
	l.Partition = int(num(MetaPartition))
	l.FirstOffset, l.LastOffset, l.Messages = num(MetaFirstOffset), num(MetaLastOffset), num(MetaMessages)
	l.SchemaKind, l.SchemaVersion = get(MetaSchemaKind), int(num(MetaSchemaVersion))
	l.ContractHash, l.Writer = get(MetaContractHash), get(MetaWriter)
	l.ContentSHA256, l.ValuesSHA256 = get(MetaContentSHA256), get(MetaValuesSHA256)
	if len(errs) == 0 && (l.FirstOffset < 0 || l.LastOffset < l.FirstOffset || l.Messages < 1 || l.Messages > l.LastOffset-l.FirstOffset+1) {
		errs = append(errs, fmt.Errorf("offsets %d-%d do not match %d messages", l.FirstOffset, l.LastOffset, l.Messages))
	}
	if len(errs) > 0 {
		return l, fmt.Errorf("%w: lineage: %w", ErrCorrupt, errors.Join(errs...))
	}
	return l, nil
}

// ContentHash accumulates MetaContentSHA256 and MetaValuesSHA256 over the
// messages of a file, in offset order. The content hash frames each
// message as offset, key, headers, time (unix microseconds) and value, each
// length-prefixed; the values hash frames the values alone.
type ContentHash struct {
	content, values hash.Hash
	buf             [8]byte
}

// NewContentHash returns an empty ContentHash.
func NewContentHash() *ContentHash {
	return &ContentHash{content: sha256.New(), values: sha256.New()}
}

func (h *ContentHash) bytes(w hash.Hash, b []byte) {
	binary.BigEndian.PutUint64(h.buf[:], uint64(len(b)))
	w.Write(h.buf[:])
	w.Write(b)
}

func (h *ContentHash) int(v int64) {
	binary.BigEndian.PutUint64(h.buf[:], uint64(v))
	h.content.Write(h.buf[:])
}

// Add hashes one message.
func (h *ContentHash) Add(m *Message) {
	h.int(m.Offset)
	h.bytes(h.content, m.Key)
	h.int(int64(len(m.Headers)))
	for _, hd := range m.Headers {
		h.bytes(h.content, []byte(hd.Key))
		h.bytes(h.content, hd.Value)
	}
	h.int(timeMicros(m.Time))
	h.bytes(h.content, m.Value)
	h.bytes(h.values, m.Value)
}

// Sums returns the hex content and values hashes.
func (h *ContentHash) Sums() (content, values string) {
	return hex.EncodeToString(h.content.Sum(nil)), hex.EncodeToString(h.values.Sum(nil))
}

func timeMicros(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMicro()
}

func fromMicros(us int64) time.Time {
	if us == 0 {
		return time.Time{}
	}
	return time.UnixMicro(us).UTC()
}

// ShortTopic returns topic without its "<run>." prefix.
func ShortTopic(run, topic string) string {
	return strings.TrimPrefix(topic, run+".")
}

// RunDir is DIR/run=<run>.
func RunDir(dir, run string) string { return filepath.Join(dir, "run="+run) }

// PartitionDir is the directory of one topic partition's files.
func PartitionDir(dir, run, topic string, partition int) string {
	return filepath.Join(RunDir(dir, run), "topic="+ShortTopic(run, topic), "partition="+strconv.Itoa(partition))
}

// FileName is the name of the file holding offsets first..last.
func FileName(first, last int64) string {
	return fmt.Sprintf("%020d-%020d.parquet", first, last)
}

// ChecksumSuffix is appended to a snapshot file's name, after the prefix
// "_", for its sidecar: "_<first>-<last>.parquet.sha256". Readers of
// datasets (pyarrow, Spark) skip names starting with "_"; globs of
// "*.parquet" do not match it.
const ChecksumSuffix = ".sha256"

// SidecarPath returns the checksum sidecar of a snapshot file.
func SidecarPath(path string) string {
	return filepath.Join(filepath.Dir(path), "_"+filepath.Base(path)+ChecksumSuffix)
}

// ParseFileName returns the offsets named by a snapshot file name.
func ParseFileName(name string) (first, last int64, ok bool) {
	base, found := strings.CutSuffix(filepath.Base(name), ".parquet")
	if !found {
		return 0, 0, false
	}
	a, b, found := strings.Cut(base, "-")
	if !found {
		return 0, 0, false
	}
	f, err1 := strconv.ParseInt(a, 10, 64)
	l, err2 := strconv.ParseInt(b, 10, 64)
	if err1 != nil || err2 != nil || f < 0 || l < f {
		return 0, 0, false
	}
	return f, l, true
}

// File is one snapshot file found in a directory.
type File struct {
	Path        string
	Run         string
	Topic       string // short topic name
	Partition   int
	FirstOffset int64
	LastOffset  int64
	// Err, when not nil, is why the listing found the file damaged: it
	// is not a regular file (a named pipe, a device, a directory, a
	// symbolic link that does not resolve to a regular file inside its
	// run directory), or its partition directory is not named
	// partition=<number> (Partition is then -1). It names Path and wraps
	// ErrCorrupt; ReadFile refuses the file with the same error, and
	// every reader reports it as a file that does not verify.
	Err error
}

// List finds every snapshot file under dir (a snapshot root or a run
// directory), sorted by run, topic, partition and first offset. Temporary
// files and sidecars are skipped. An entry named like a snapshot file
// that cannot be one is listed with its File.Err set, not skipped: a
// reader reports it as damaged.
func List(dir string) ([]File, error) {
	files, err := walkFiles(dir, func(path string, d fs.DirEntry) (string, bool) {
		return path, strings.HasSuffix(path, ".parquet") && !strings.HasPrefix(d.Name(), ".")
	})
	for i := range files {
		if files[i].Err != nil {
			continue
		}
		if _, err := resolveRegular(files[i].Path, layoutRunDir(files[i].Path)); err != nil {
			files[i].Err = fileError(files[i].Path, err)
		}
	}
	return files, err
}

// walkFiles returns the snapshot files under dir that pick names: for
// every file of the tree, pick returns the path of the data file it
// stands for and whether it does. They are parsed from their names and
// sorted as List sorts.
func walkFiles(dir string, pick func(path string, d fs.DirEntry) (string, bool)) ([]File, error) {
	var out []File
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, ok := pick(path, d)
		if !ok {
			return nil
		}
		if f, ok := parseFile(data); ok {
			out = append(out, f)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("snapshot: list %s: %w", dir, err)
	}
	sortFiles(out)
	return out, nil
}

// ErrMissing wraps the error of a snapshot file whose checksum sidecar
// remains but whose data file does not (it was removed, or its write was
// interrupted between the two renames). errors.Is also matches it with
// fs.ErrNotExist.
var ErrMissing error = errMissing{}

type errMissing struct{}

func (errMissing) Error() string        { return "snapshot: file missing" }
func (errMissing) Is(target error) bool { return target == fs.ErrNotExist }

// Missing finds every snapshot file under dir (a snapshot root or a run
// directory) whose checksum sidecar "_<first>-<last>.parquet.sha256" is
// there but whose data file is not, sorted as List sorts. Each File's Path
// is the missing data file's. The snapshot stage removes such sidecars
// when it restarts; every reader reports them as missing files.
func Missing(dir string) ([]File, error) {
	return walkFiles(dir, func(path string, d fs.DirEntry) (string, bool) {
		base, ok := strings.CutSuffix(d.Name(), ChecksumSuffix)
		if !ok || !strings.HasPrefix(base, "_") || !strings.HasSuffix(base, ".parquet") {
			return "", false
		}
		data := filepath.Join(filepath.Dir(path), base[1:])
		_, err := os.Lstat(data)
		return data, errors.Is(err, fs.ErrNotExist) // present (or unreadable: reading it reports that)
	})
}

// MissingError is the error of a missing snapshot file f (see Missing):
// it wraps ErrMissing and names the file and its remaining sidecar.
func MissingError(f File) error {
	return fmt.Errorf("snapshot file %s: %w: its checksum sidecar %s remains (the file was removed, or its write was interrupted)",
		f.Path, ErrMissing, SidecarPath(f.Path))
}

// parseFile reads run, topic, partition and offsets from the path of a
// snapshot file; ok is false for a path outside the layout. A partition
// directory whose name is not a partition number makes the File damaged
// (File.Err), not an error: one stray directory does not hide the run.
func parseFile(path string) (File, bool) {
	first, last, ok := ParseFileName(filepath.Base(path))
	if !ok {
		return File{}, false
	}
	f := File{Path: path, FirstOffset: first, LastOffset: last, Partition: -1}
	for _, part := range strings.Split(filepath.ToSlash(filepath.Dir(path)), "/") {
		k, v, ok := strings.Cut(part, "=")
		if !ok {
			continue
		}
		switch k {
		case "run":
			f.Run = v
		case "topic":
			f.Topic = v
		case "partition":
			p, err := parsePartition(v)
			if err != nil {
				f.Partition, f.Err = -1, fileError(path, err)
				continue
			}
			f.Partition = p
		}
	}
	return f, f.Run != "" && f.Topic != "" && (f.Partition >= 0 || f.Err != nil)
}

// parsePartition parses the value of a partition=<p> directory: a
// partition number, written as the writer writes it.
func parsePartition(v string) (int, error) {
	p, err := strconv.Atoi(v)
	if err != nil || p < 0 || strconv.Itoa(p) != v {
		return -1, fmt.Errorf("%w: directory partition=%s: %q is not a partition number", ErrCorrupt, v, v)
	}
	return p, nil
}

// fileError names path in err, as ReadFile does.
func fileError(path string, err error) error {
	return fmt.Errorf("snapshot file %s: %w", path, err)
}

// sortFiles sorts by run, topic, partition and first offset.
func sortFiles(files []File) { slices.SortFunc(files, compareFiles) }

// compareFiles orders files by run, topic, partition and first offset.
func compareFiles(a, b File) int {
	if c := strings.Compare(a.Run, b.Run); c != 0 {
		return c
	}
	if c := strings.Compare(a.Topic, b.Topic); c != 0 {
		return c
	}
	if a.Partition != b.Partition {
		return a.Partition - b.Partition
	}
	return cmp.Compare(a.FirstOffset, b.FirstOffset)
}

// RunInfo is DIR/run=<run>/run.json: what replay needs beyond the
// contract to rebuild the stages exactly as they ran.
type RunInfo struct {
	Run          string `json:"run"`
	ContractHash string `json:"contract_hash"`
	VocabSize    int32  `json:"vocab_size"`
	Writer       string `json:"writer"`
}

// RunInfoFile and ContractFile are the names of the run-level files.
const (
	RunInfoFile  = "run.json"
	ContractFile = "contract.yaml"
)

// ReadRunInfo reads DIR/run=<run>/run.json.
func ReadRunInfo(runDir string) (RunInfo, error) {
	var ri RunInfo
	b, err := ReadRegular(filepath.Join(runDir, RunInfoFile), runDir, maxRunInfoBytes)
	if err != nil {
		return ri, pathError(filepath.Join(runDir, RunInfoFile), err)
	}
	if err := json.Unmarshal(b, &ri); err != nil {
		return ri, fmt.Errorf("%w: %s: %w", ErrCorrupt, filepath.Join(runDir, RunInfoFile), err)
	}
	return ri, nil
}

// Gap is a hole (or an overlap, when Missing is negative) between two
// consecutive files of one partition.
type Gap struct {
	Topic     string
	Partition int
	After     int64 // last offset of the earlier file
	Next      int64 // first offset of the later file
}

func (g Gap) String() string {
	if g.Next <= g.After {
		return fmt.Sprintf("%s/%d: offsets %d..%d written twice", g.Topic, g.Partition, g.Next, g.After)
	}
	return fmt.Sprintf("%s/%d: offsets %d..%d missing", g.Topic, g.Partition, g.After+1, g.Next-1)
}

// Contiguity reports every gap or overlap between consecutive files of a
// partition (files as returned by List, for one run).
func Contiguity(files []File) []Gap {
	var gaps []Gap
	for i := 1; i < len(files); i++ {
		a, b := files[i-1], files[i]
		if a.Run != b.Run || a.Topic != b.Topic || a.Partition != b.Partition {
			continue
		}
		if b.FirstOffset != a.LastOffset+1 {
			gaps = append(gaps, Gap{Topic: a.Topic, Partition: a.Partition, After: a.LastOffset, Next: b.FirstOffset})
		}
	}
	return gaps
}
