package parquet

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// writeTestRun writes a run of testRun under dir: three trajectories
// files of partition 0 (offsets 0-2, 3-5, 6-8), one windows file and
// run.json, and returns the paths of the trajectories files and of the
// windows file.
func writeTestRun(t *testing.T, dir string) (trajs []string, windows string) {
	t.Helper()
	all := trajMessages(t, 9, 0)
	target := Target{Dir: dir, Run: testRun, Topic: testRun + ".trajectories", ContractHash: "sha256:00"}
	for _, r := range [][2]int{{0, 3}, {3, 6}, {6, 9}} {
		path, _, err := WriteFile(target, 0, all[r[0]:r[1]], WriteOptions{})
		if err != nil {
			t.Fatal(err)
		}
		trajs = append(trajs, path)
	}
	target.Topic = testRun + ".windows"
	windows, _, err := WriteFile(target, 0, []Message{{Offset: 0, Value: []byte(`{"batch_id":"b"}`)}}, WriteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	info, err := json.Marshal(RunInfo{Run: testRun, ContractHash: "sha256:00"})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(RunDir(dir, testRun), RunInfoFile), info, 0o644); err != nil {
		t.Fatal(err)
	}
	return trajs, windows
}

func flipByte(t *testing.T, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0x20
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestMissing: a sidecar whose data file is gone is a missing file; a
// complete file, a temporary file and a run-level sidecar are not.
func TestMissing(t *testing.T) {
	dir := t.TempDir()
	trajs, _ := writeTestRun(t, dir)
	runDir := RunDir(dir, testRun)
	for _, name := range []string{".00000000000000000009-00000000000000000009.parquet.tmp-1", "_" + RunInfoFile + ChecksumSuffix} {
		if err := os.WriteFile(filepath.Join(filepath.Dir(trajs[0]), name), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := Missing(dir); err != nil || len(got) != 0 {
		t.Fatalf("complete run: missing %+v, %v", got, err)
	}
	if err := os.Remove(trajs[1]); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{dir, runDir} {
		got, err := Missing(d)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 1 || got[0].Path != trajs[1] || got[0].Topic != "trajectories" || got[0].Partition != 0 ||
			got[0].FirstOffset != 3 || got[0].LastOffset != 5 || got[0].Run != testRun {
			t.Errorf("Missing(%s) = %+v, want %s", d, got, trajs[1])
		}
	}
	err := MissingError(File{Path: trajs[1]})
	if !errors.Is(err, ErrMissing) || !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), trajs[1]) ||
		!strings.Contains(err.Error(), SidecarPath(trajs[1])) {
		t.Errorf("missing file error %v", err)
	}
}

// TestReadRunEveryBadFile: ReadRun reports every unreadable file of the
// topics it reads — corrupt or missing — not only the first, skips the
// topics it is not asked for, and with Partial returns the rest.
func TestReadRunEveryBadFile(t *testing.T) {
	dir := t.TempDir()
	trajs, windows := writeTestRun(t, dir)
	runDir := RunDir(dir, testRun)
	flipByte(t, trajs[0])
	if err := os.Remove(trajs[1]); err != nil {
		t.Fatal(err)
	}
	flipByte(t, windows)

	_, err := ReadRun(t.Context(), runDir, nil, ReadOptions{})
	var re *ReadError
	if !errors.As(err, &re) {
		t.Fatalf("ReadRun of three bad files: %v, want a *ReadError", err)
	}
	if want := []string{trajs[0], trajs[1], windows}; !slices.Equal(re.Paths(), want) {
		t.Errorf("unreadable %v, want %v", re.Paths(), want)
	}
	for _, p := range []string{trajs[0], trajs[1], windows} {
		if !strings.Contains(err.Error(), p) {
			t.Errorf("error does not name %s: %v", p, err)
		}
	}
	if !errors.Is(err, ErrCorrupt) || !errors.Is(err, ErrMissing) {
		t.Errorf("error %v: want it to match ErrCorrupt and ErrMissing", err)
	}

	tests := []struct {
		name       string
		topics     []string
		opts       ReadOptions
		unreadable []string
		read       int // trajectories messages read
	}{
		{"another topic is not read", []string{"census"}, ReadOptions{}, nil, 0},
		{"partial", nil, ReadOptions{Partial: true}, []string{trajs[0], trajs[1], windows}, 3},
		{"partial, one topic", []string{"trajectories"}, ReadOptions{Partial: true}, []string{trajs[0], trajs[1]}, 3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r, err := ReadRun(t.Context(), runDir, tc.topics, tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, f := range r.Unreadable {
				got = append(got, f.File.Path)
				if !strings.Contains(f.Error(), f.File.Path) {
					t.Errorf("error %q does not name %s", f.Error(), f.File.Path)
				}
			}
			if !slices.Equal(got, tc.unreadable) || len(r.Topics["trajectories"]) != tc.read || len(r.Topics["windows"]) != 0 {
				t.Errorf("unreadable %v (want %v), %d trajectories messages read (want %d), %d windows",
					got, tc.unreadable, len(r.Topics["trajectories"]), tc.read, len(r.Topics["windows"]))
			}
		})
	}
}

// TestFindRun finds a run in a demo's output directory, in trajflow up's
// (OUT/snapshots/run=<run>) and as the run directory itself.
func TestFindRun(t *testing.T) {
	demo := t.TempDir()
	writeTestRun(t, demo)
	up := t.TempDir()
	writeTestRun(t, filepath.Join(up, SnapshotsDir))
	two := t.TempDir()
	for _, run := range []string{"a", "b"} {
		if err := os.MkdirAll(RunDir(filepath.Join(two, SnapshotsDir), run), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	emptySnapshots := t.TempDir()
	if err := os.Mkdir(filepath.Join(emptySnapshots, SnapshotsDir), 0o755); err != nil {
		t.Fatal(err)
	}
	empty := t.TempDir()
	tests := []struct {
		name    string
		dir     string
		run     string
		want    string
		wantErr string
	}{
		{"demo output", demo, "", RunDir(demo, testRun), ""},
		{"demo output, named", demo, testRun, RunDir(demo, testRun), ""},
		{"run directory", RunDir(demo, testRun), "", RunDir(demo, testRun), ""},
		{"up output", up, "", RunDir(filepath.Join(up, SnapshotsDir), testRun), ""},
		{"up output, named", up, testRun, RunDir(filepath.Join(up, SnapshotsDir), testRun), ""},
		{"up snapshots", filepath.Join(up, SnapshotsDir), "", RunDir(filepath.Join(up, SnapshotsDir), testRun), ""},
		{"up output, no such run", up, "other", "", "nor in " + filepath.Join(up, SnapshotsDir)},
		{"up output, two runs", two, "", "", "holds [run=a run=b]: name one"},
		{"empty snapshots", emptySnapshots, "", "", "no run=<run> directory in " + emptySnapshots + " (nor in"},
		{"empty", empty, "", "", "no run=<run> directory in " + empty},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := FindRun(tc.dir, tc.run)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("FindRun(%s, %q) = %q, %v; want an error containing %q", tc.dir, tc.run, got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("FindRun(%s, %q) = %q, %v; want %s", tc.dir, tc.run, got, err, tc.want)
			}
		})
	}
}

// TestReadRunStopsWhenCancelled: a cancelled context ends ReadRun before
// its next file, with the context's error and the run directory named.
func TestReadRunStopsWhenCancelled(t *testing.T) {
	dir := t.TempDir()
	writeTestRun(t, dir)
	runDir := RunDir(dir, testRun)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	r, err := ReadRun(ctx, runDir, nil, ReadOptions{})
	if !errors.Is(err, context.Canceled) || r != nil {
		t.Fatalf("ReadRun with a cancelled context: %v, %v; want context.Canceled", r, err)
	}
	if !strings.Contains(err.Error(), runDir) {
		t.Errorf("error does not name %s: %v", runDir, err)
	}
	if _, err := ReadRun(t.Context(), runDir, nil, ReadOptions{}); err != nil {
		t.Fatalf("the same run, not cancelled: %v", err)
	}
}
