package parquet

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Run is a run's snapshot read back and verified.
type Run struct {
	Dir  string // DIR/run=<run>
	Info RunInfo
	// Files lists every file read, in List order.
	Files []File
	// Topics maps a short topic name to its messages, sorted by partition
	// then offset.
	Topics map[string][]Message
	// FullTopics maps a short topic name to its Kafka name.
	FullTopics map[string]string
	// Lineage holds each file's lineage, by path.
	Lineage map[string]Lineage
	// Gaps lists offsets missing (or written twice) between files.
	Gaps []Gap
	// Bytes is the total size of the message values read.
	Bytes int64
}

// FindRun returns the run directory under dir: dir itself when it is a
// run directory, else DIR/run=<run> (run may be empty when dir holds
// exactly one run).
func FindRun(dir, run string) (string, error) {
	if strings.HasPrefix(filepath.Base(filepath.Clean(dir)), "run=") {
		return dir, nil
	}
	if run != "" {
		d := RunDir(dir, run)
		if _, err := os.Stat(d); err != nil {
			return "", fmt.Errorf("snapshot: run %s: %w", run, err)
		}
		return d, nil
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", fmt.Errorf("snapshot: %w", err)
	}
	var runs []string
	for _, e := range ents {
		if e.IsDir() && strings.HasPrefix(e.Name(), "run=") {
			runs = append(runs, e.Name())
		}
	}
	switch len(runs) {
	case 0:
		return "", fmt.Errorf("snapshot: no run=<run> directory in %s", dir)
	case 1:
		return filepath.Join(dir, runs[0]), nil
	}
	return "", fmt.Errorf("snapshot: %s holds runs %v: name one", dir, runs)
}

// ReadRun reads and verifies every file of the run in runDir whose short
// topic is in topics (all topics when topics is empty). The first file
// that fails to verify stops it with an error naming that file.
func ReadRun(runDir string, topics []string, opts ReadOptions) (*Run, error) {
	info, err := ReadRunInfo(runDir)
	if err != nil {
		return nil, err
	}
	files, err := List(runDir)
	if err != nil {
		return nil, err
	}
	r := &Run{Dir: runDir, Info: info, Topics: map[string][]Message{}, FullTopics: map[string]string{}, Lineage: map[string]Lineage{}}
	for _, f := range files {
		if len(topics) > 0 && !slices.Contains(topics, f.Topic) {
			continue
		}
		lin, msgs, err := ReadFile(f.Path, opts)
		if err != nil {
			return nil, err
		}
		if lin.Run != info.Run {
			return nil, fmt.Errorf("%w: snapshot file %s: run %q, run directory of %q", ErrCorrupt, f.Path, lin.Run, info.Run)
		}
		if lin.ContractHash != info.ContractHash {
			return nil, fmt.Errorf("%w: snapshot file %s: contract %s, run's contract %s", ErrCorrupt, f.Path, lin.ContractHash, info.ContractHash)
		}
		r.Files = append(r.Files, f)
		r.Lineage[f.Path] = lin
		r.FullTopics[f.Topic] = lin.Topic
		r.Topics[f.Topic] = append(r.Topics[f.Topic], msgs...)
		for i := range msgs {
			r.Bytes += int64(len(msgs[i].Value))
		}
	}
	r.Gaps = Contiguity(r.Files)
	return r, nil
}

// Hole is something a snapshot lacks of a topic it holds: a partition
// with no file, or offsets missing before a partition's first file.
type Hole struct {
	Topic     string // short topic name
	Partition int
	// Partitions is the topic's partition count; Before, when > 0, the
	// first offset of the partition's first file (offsets 0..Before-1
	// are missing). Before == 0 means the partition has no file.
	Partitions int
	Before     int64
}

func (h Hole) String() string {
	if h.Before > 0 {
		return fmt.Sprintf("%s/%d: offsets 0..%d missing before the first snapshot file", h.Topic, h.Partition, h.Before-1)
	}
	return fmt.Sprintf("%s/%d: no snapshot file for partition %d of %d (it received no record, or the snapshot is incomplete)",
		h.Topic, h.Partition, h.Partition, h.Partitions)
}

// Holes lists the holes of the files of one run (as List returns them)
// for every topic of partitions (short name -> partition count) that has
// at least one file: a topic with no file at all is not a hole here (the
// caller knows which topics it needs). Topics in fromStart must begin at
// offset 0 in every partition (not compacted, retention not yet
// reached).
func Holes(files []File, partitions map[string]int, fromStart map[string]bool) []Hole {
	first := map[string]map[int]int64{}
	for _, f := range files {
		if first[f.Topic] == nil {
			first[f.Topic] = map[int]int64{}
		}
		if o, ok := first[f.Topic][f.Partition]; !ok || f.FirstOffset < o {
			first[f.Topic][f.Partition] = f.FirstOffset
		}
	}
	var out []Hole
	topics := make([]string, 0, len(partitions))
	for t := range partitions {
		topics = append(topics, t)
	}
	slices.Sort(topics)
	for _, t := range topics {
		parts := first[t]
		if len(parts) == 0 {
			continue
		}
		for p := 0; p < partitions[t]; p++ {
			o, ok := parts[p]
			switch {
			case !ok:
				out = append(out, Hole{Topic: t, Partition: p, Partitions: partitions[t]})
			case o > 0 && fromStart[t]:
				out = append(out, Hole{Topic: t, Partition: p, Partitions: partitions[t], Before: o})
			}
		}
	}
	return out
}
