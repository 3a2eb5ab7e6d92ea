package parquet

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
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
	// Gaps lists offsets missing (or written twice) between the files
	// read.
	Gaps []Gap
	// Bytes is the total size of the message values read.
	Bytes int64
	// Unreadable lists the files of the topics read that are missing or
	// did not verify, in List order; only ReadOptions.Partial leaves it
	// non-empty (without it they are ReadRun's error).
	Unreadable []FileError
}

// SnapshotsDir is the directory of trajflow up's output directory that
// holds its run directories (OUT/snapshots/run=<run>).
const SnapshotsDir = "snapshots"

// ErrNoRun marks a directory that holds no run=<run> directory (of the
// name asked for); ErrSeveralRuns one that holds several when no name
// was given.
var (
	ErrNoRun       = errors.New("no run=<run> directory")
	ErrSeveralRuns = errors.New("several runs")
)

// FindRun returns the run directory under dir: dir itself when it is a
// run directory, else DIR/run=<run> (run may be empty when dir holds
// exactly one run). When dir holds no such run directory but has a
// SnapshotsDir (trajflow up's output directory), the run is looked for
// there: DIR/snapshots/run=<run>.
func FindRun(dir, run string) (string, error) {
	if strings.HasPrefix(filepath.Base(filepath.Clean(dir)), "run=") {
		return dir, nil
	}
	d, err := findRun(dir, run)
	if err == nil || !errors.Is(err, ErrNoRun) {
		return d, err
	}
	sub := filepath.Join(dir, SnapshotsDir)
	if fi, serr := os.Stat(sub); serr != nil || !fi.IsDir() {
		return "", err
	}
	d, serr := findRun(sub, run)
	if serr != nil && errors.Is(serr, ErrNoRun) {
		return "", fmt.Errorf("%w (nor in %s)", err, sub)
	}
	return d, serr
}

// findRun is FindRun without the SnapshotsDir fallback; an error wrapping
// ErrNoRun means dir holds no run directory (of that name).
func findRun(dir, run string) (string, error) {
	if run != "" {
		d := RunDir(dir, run)
		if _, err := os.Stat(d); err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return "", fmt.Errorf("snapshot: run %s: %w: %s does not exist", run, ErrNoRun, d)
			}
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
		return "", fmt.Errorf("snapshot: %w in %s", ErrNoRun, dir)
	case 1:
		return filepath.Join(dir, runs[0]), nil
	}
	return "", fmt.Errorf("snapshot: %w: %s holds %v: name one", ErrSeveralRuns, dir, runs)
}

// FileError is a snapshot file that could not be read: missing (its
// sidecar remains, ErrMissing) or not verifying (ErrCorrupt), which
// includes an entry that is not a regular file and a file under a
// directory that is not partition=<number> (File.Err). Err names
// File.Path.
type FileError struct {
	File File
	Err  error
}

func (e *FileError) Error() string { return e.Err.Error() }
func (e *FileError) Unwrap() error { return e.Err }

// ReadError is ReadRun's error when files of the run are unreadable: it
// lists every one of them, not only the first. errors.Is sees through it
// to each file's error (ErrCorrupt, ErrMissing).
type ReadError struct {
	Dir   string
	Files []FileError
}

func (e *ReadError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "snapshot %s: %d file(s) unreadable:", e.Dir, len(e.Files))
	for i := range e.Files {
		b.WriteString("\n  ")
		b.WriteString(e.Files[i].Error())
	}
	return b.String()
}

// Unwrap returns every file's error.
func (e *ReadError) Unwrap() []error {
	out := make([]error, len(e.Files))
	for i := range e.Files {
		out[i] = &e.Files[i]
	}
	return out
}

// Paths returns the paths of the unreadable files.
func (e *ReadError) Paths() []string {
	out := make([]string, len(e.Files))
	for i, f := range e.Files {
		out[i] = f.File.Path
	}
	return out
}

// ReadRun reads and verifies every file of the run in runDir whose short
// topic is in topics (all topics when topics is empty). A file that is
// missing (Missing: its sidecar remains) or fails to verify does not stop
// it: every such file is collected, and ReadRun returns a *ReadError
// listing them all, each naming its path — or, with opts.Partial, the Run
// of the files it could read with the others in Run.Unreadable. A
// run.json that does not read is an error either way. ReadRun checks ctx
// before each file: a cancelled read returns ctx's error.
func ReadRun(ctx context.Context, runDir string, topics []string, opts ReadOptions) (*Run, error) {
	info, err := ReadRunInfo(runDir)
	if err != nil {
		return nil, err
	}
	files, err := List(runDir)
	if err != nil {
		return nil, err
	}
	missing, err := Missing(runDir)
	if err != nil {
		return nil, err
	}
	want := func(f File) bool { return len(topics) == 0 || slices.Contains(topics, f.Topic) }
	r := &Run{Dir: runDir, Info: info, Topics: map[string][]Message{}, FullTopics: map[string]string{}, Lineage: map[string]Lineage{}}
	var bad []FileError
	for _, f := range missing {
		if want(f) {
			bad = append(bad, FileError{File: f, Err: MissingError(f)})
		}
	}
	for _, f := range files {
		if !want(f) {
			continue
		}
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("reading snapshot %s: %w", runDir, err)
		}
		var lin Lineage
		var msgs []Message
		err := f.Err
		if err == nil {
			lin, msgs, err = ReadFile(f.Path, opts)
		}
		switch {
		case err != nil:
		case lin.Run != info.Run:
			err = fmt.Errorf("%w: snapshot file %s: run %q, run directory of %q", ErrCorrupt, f.Path, lin.Run, info.Run)
		case lin.ContractHash != info.ContractHash:
			err = fmt.Errorf("%w: snapshot file %s: contract %s, run's contract %s", ErrCorrupt, f.Path, lin.ContractHash, info.ContractHash)
		}
		if err != nil {
			bad = append(bad, FileError{File: f, Err: err})
			continue
		}
		r.Files = append(r.Files, f)
		r.Lineage[f.Path] = lin
		r.FullTopics[f.Topic] = lin.Topic
		r.Topics[f.Topic] = append(r.Topics[f.Topic], msgs...)
		for i := range msgs {
			r.Bytes += int64(len(msgs[i].Value))
		}
	}
	slices.SortStableFunc(bad, func(a, b FileError) int { return compareFiles(a.File, b.File) })
	if len(bad) > 0 && !opts.Partial {
		return nil, &ReadError{Dir: runDir, Files: bad}
	}
	r.Unreadable = bad
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
