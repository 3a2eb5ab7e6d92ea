package parquet

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	pq "github.com/parquet-go/parquet-go"
	pqzstd "github.com/parquet-go/parquet-go/compress/zstd"

	"github.com/trajflow/trajflow/pipeline"
)

// StageConfig configures the snapshot stage.
type StageConfig struct {
	Dir    string   // snapshot root
	Run    string   // run id
	Topics []string // full names of the topics to snapshot
	// ContractHash is recorded in every file; ContractYAML (the resolved
	// contract) and VocabSize are written once per run for replay.
	ContractHash string
	ContractYAML []byte
	VocabSize    int32
	// RollBytes closes a partition's file once it holds this many bytes
	// of messages (default 64 MiB); RollInterval once its first message
	// is this old (default 30 s; checked on each tick).
	RollBytes    int64
	RollInterval time.Duration
	// MaxBufferedBytes bounds the messages held in memory over all
	// partitions (default 256 MiB): past it the largest buffer is written.
	MaxBufferedBytes int64
	Write            WriteOptions
	Now              func() time.Time
	// Tasks is the task registry (public fields only: never the hidden
	// answers), written once per run to TasksFile for analysts' joins.
	Tasks []TaskRow
}

// TaskRow is one task of the registry, as written to TasksFile.
type TaskRow struct {
	TaskID      string `parquet:"task_id"`
	TaskVersion string `parquet:"task_version"`
	Domain      string `parquet:"domain"`
	Split       string `parquet:"split"`
	EnvVersion  string `parquet:"env_version"`
	Key         int32  `parquet:"key"`
}

// TasksFile is the run-level Parquet file of the task registry.
const TasksFile = "tasks.parquet"

// ReadTasks reads the task registry of a run, checking its sidecar.
func ReadTasks(runDir string) ([]TaskRow, error) {
	path := filepath.Join(runDir, TasksFile)
	data, err := ReadRegular(path, runDir, MaxFileBytes)
	if err != nil {
		return nil, pathError(path, err)
	}
	if err := checkSidecar(path, runDir, data); err != nil {
		return nil, fmt.Errorf("snapshot file %s: %w", path, err)
	}
	rows, err := pq.Read[TaskRow](bytes.NewReader(data), int64(len(data)))
	if err != nil {
		return nil, fmt.Errorf("%w: snapshot file %s: %w", ErrCorrupt, path, err)
	}
	return rows, nil
}

type topicPart struct {
	topic     string
	partition int
}

type partBuf struct {
	msgs   []Message
	bytes  int64
	opened time.Time
}

// Stage is the snapshot operator (`trajflow run snapshot`): it consumes
// every topic of a run as its own consumer group and writes each topic
// partition to Parquet files (see the package doc).
//
// Every input is held (pipeline.Result.Hold) until the file holding it is
// durable, then released: the committed offset never passes data that is
// not on disk. At start the stage reads back which offsets its files
// already hold and skips them when they are redelivered, so a restart
// after a crash writes no duplicate and leaves no gap. A directory holds
// the snapshot of one life of a run's topics: a run id reused on a fresh
// cluster (offsets restarting at 0) needs a fresh directory, or the offsets
// already on disk are taken as written.
type Stage struct {
	cfg      StageConfig
	shorts   map[string]string // full topic -> short name
	written  map[topicPart]int64
	parts    map[topicPart]*partBuf
	buffered int64
	files    int

	mu   sync.Mutex
	next map[topicPart]int64 // offset after the last one processed
}

// NewStage validates cfg and returns the stage.
func NewStage(cfg StageConfig) (*Stage, error) {
	if cfg.Dir == "" {
		return nil, errors.New("snapshot: no output directory")
	}
	if cfg.Run == "" || len(cfg.Topics) == 0 {
		return nil, errors.New("snapshot: no run or no topics")
	}
	if cfg.RollBytes <= 0 {
		cfg.RollBytes = 64 << 20
	}
	if cfg.RollInterval <= 0 {
		cfg.RollInterval = 30 * time.Second
	}
	if cfg.MaxBufferedBytes <= 0 {
		cfg.MaxBufferedBytes = 256 << 20
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	s := &Stage{cfg: cfg, shorts: map[string]string{}, written: map[topicPart]int64{}, parts: map[topicPart]*partBuf{}, next: map[topicPart]int64{}}
	for _, t := range cfg.Topics {
		s.shorts[ShortTopic(cfg.Run, t)] = t
	}
	return s, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "snapshot" }

// Topics implements pipeline.Stage.
func (s *Stage) Topics() []string { return s.cfg.Topics }

// Caught reports whether the stage has processed every offset below ends
// (topic -> partition -> end offset, as Kafka reports high-water marks);
// a graceful stop (Flush) then writes them all. Safe for concurrent use.
func (s *Stage) Caught(ends map[string]map[int]int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for topic, parts := range ends {
		for p, end := range parts {
			k := topicPart{topic, p}
			if s.next[k] < end {
				return false
			}
		}
	}
	return true
}

// Files is the number of files written since start.
func (s *Stage) Files() int { return s.files }

// Start writes the run files and restores the last offset written per
// partition; it removes temporary files and sidecars without a file left by
// a crash.
func (s *Stage) Start(_ context.Context, env *pipeline.Env) error {
	runDir := RunDir(s.cfg.Dir, s.cfg.Run)
	if err := os.MkdirAll(runDir, 0o755); err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	if err := s.cleanup(runDir); err != nil {
		return err
	}
	info, err := json.MarshalIndent(RunInfo{Run: s.cfg.Run, ContractHash: s.cfg.ContractHash, VocabSize: s.cfg.VocabSize, Writer: WriterVersion}, "", "  ")
	if err != nil {
		return err
	}
	for name, body := range map[string][]byte{RunInfoFile: append(info, '\n'), ContractFile: s.cfg.ContractYAML} {
		if len(body) == 0 {
			continue
		}
		if old, err := os.ReadFile(filepath.Join(runDir, name)); err == nil && bytes.Equal(old, body) {
			continue
		}
		if err := writeAtomic(runDir, name, func(w io.Writer) error { _, err := w.Write(body); return err }); err != nil {
			return fmt.Errorf("snapshot: write %s: %w", name, err)
		}
	}
	if len(s.cfg.Tasks) > 0 {
		err := writeAtomic(runDir, TasksFile, func(w io.Writer) error {
			return pq.Write(w, s.cfg.Tasks, pq.Compression(&pqzstd.Codec{}), pq.KeyValueMetadata(MetaRun, s.cfg.Run),
				pq.KeyValueMetadata(MetaContractHash, s.cfg.ContractHash), pq.KeyValueMetadata(MetaWriter, WriterVersion))
		})
		if err != nil {
			return fmt.Errorf("snapshot: write %s: %w", TasksFile, err)
		}
	}
	files, err := List(runDir)
	if err != nil {
		return err
	}
	for _, f := range files {
		full, ok := s.shorts[f.Topic]
		if !ok || f.Err != nil { // a damaged entry holds no offset this stage wrote
			continue
		}
		k := topicPart{full, f.Partition}
		if last, ok := s.written[k]; !ok || f.LastOffset > last {
			s.written[k] = f.LastOffset
			s.mu.Lock()
			s.next[k] = f.LastOffset + 1
			s.mu.Unlock()
		}
	}
	if env != nil && env.Logger != nil {
		env.Logger.Info("snapshot state restored", "dir", runDir, "files", len(files), "partitions", len(s.written))
	}
	return nil
}

// cleanup removes temporary files and sidecars whose file is missing.
func (s *Stage) cleanup(runDir string) error {
	return filepath.WalkDir(runDir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		name := d.Name()
		stale := strings.HasPrefix(name, ".") && strings.Contains(name, ".tmp-")
		if base, ok := strings.CutSuffix(name, ChecksumSuffix); ok && strings.HasPrefix(base, "_") && strings.HasSuffix(base, ".parquet") {
			if _, err := os.Stat(filepath.Join(filepath.Dir(path), base[1:])); errors.Is(err, os.ErrNotExist) {
				stale = true
			}
		}
		if stale {
			if err := os.Remove(path); err != nil {
				return fmt.Errorf("snapshot: remove %s: %w", path, err)
			}
		}
		return nil
	})
}

// Process implements pipeline.Stage.
func (s *Stage) Process(_ context.Context, m pipeline.Message) (pipeline.Result, error) {
	k := topicPart{m.Topic, m.Partition}
	s.mu.Lock()
	s.next[k] = max(s.next[k], m.Offset+1)
	s.mu.Unlock()
	if last, ok := s.written[k]; ok && m.Offset <= last {
		return pipeline.Result{}, nil // already durable (redelivered after a restart)
	}
	b := s.parts[k]
	if b == nil {
		b = &partBuf{}
		s.parts[k] = b
	}
	if n := len(b.msgs); n > 0 && m.Offset <= b.msgs[n-1].Offset {
		return pipeline.Result{}, nil // redelivered while still buffered
	}
	if len(b.msgs) == 0 {
		b.opened = s.cfg.Now()
	}
	b.msgs = append(b.msgs, FromPipeline(m))
	size := int64(len(m.Value) + len(m.Key))
	b.bytes += size
	s.buffered += size
	var res pipeline.Result
	res.Hold = true
	if b.bytes >= s.cfg.RollBytes {
		if err := s.roll(&res, k); err != nil {
			return pipeline.Result{}, err
		}
	}
	for s.buffered > s.cfg.MaxBufferedBytes {
		var big topicPart
		var max int64 = -1
		for kk, bb := range s.parts {
			if bb.bytes > max {
				big, max = kk, bb.bytes
			}
		}
		if err := s.roll(&res, big); err != nil {
			return pipeline.Result{}, err
		}
	}
	if i := slices.Index(res.Release, m.Ref); i >= 0 {
		res.Hold = false
		res.Release = slices.Delete(res.Release, i, i+1)
	}
	return res, nil
}

// roll writes the buffer of k and lists its messages in res.Release.
func (s *Stage) roll(res *pipeline.Result, k topicPart) error {
	b := s.parts[k]
	if b == nil || len(b.msgs) == 0 {
		return nil
	}
	t := Target{Dir: s.cfg.Dir, Run: s.cfg.Run, Topic: k.topic, ContractHash: s.cfg.ContractHash}
	if _, _, err := WriteFile(t, k.partition, b.msgs, s.cfg.Write); err != nil {
		return err
	}
	s.files++
	s.written[k] = b.msgs[len(b.msgs)-1].Offset
	for i := range b.msgs {
		res.Release = append(res.Release, pipeline.Ref{Topic: k.topic, Partition: k.partition, Offset: b.msgs[i].Offset})
	}
	s.buffered -= b.bytes
	delete(s.parts, k)
	return nil
}

// Tick writes the buffers older than RollInterval.
func (s *Stage) Tick(_ context.Context, now time.Time) (pipeline.Result, error) {
	var res pipeline.Result
	for _, k := range s.sortedParts() {
		if now.Sub(s.parts[k].opened) >= s.cfg.RollInterval {
			if err := s.roll(&res, k); err != nil {
				return pipeline.Result{}, err
			}
		}
	}
	return res, nil
}

// Flush writes every buffer (graceful shutdown).
func (s *Stage) Flush(context.Context) (pipeline.Result, error) {
	var res pipeline.Result
	for _, k := range s.sortedParts() {
		if err := s.roll(&res, k); err != nil {
			return pipeline.Result{}, err
		}
	}
	return res, nil
}

func (s *Stage) sortedParts() []topicPart {
	ks := make([]topicPart, 0, len(s.parts))
	for k := range s.parts {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b topicPart) int {
		if c := strings.Compare(a.topic, b.topic); c != 0 {
			return c
		}
		return a.partition - b.partition
	})
	return ks
}
