package parquet

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/internal/pipetest"
)

// within runs f and fails the test when it has not returned after d: a
// reader that blocks on a named pipe must not hang the test.
func within(t *testing.T, d time.Duration, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s did not return within %s", what, d)
	}
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestDamagedEntries: entries named like snapshot files that are not
// regular files — a named pipe, a link to /dev/zero, a link to a file
// outside the run — and a file under partition=abc are listed as
// damaged, each naming its path and why, and every reader refuses them
// at once, without blocking or reading without bound; a link to a
// regular file inside the run is read. ReadRun names every one of them,
// or with Partial reads the rest.
func TestDamagedEntries(t *testing.T) {
	dir := t.TempDir()
	trajs, _ := writeTestRun(t, dir)
	runDir := RunDir(dir, testRun)
	part0 := filepath.Dir(trajs[0])

	fifo := filepath.Join(part0, FileName(9, 10))
	pipetest.Mkfifo(t, fifo)
	zero := filepath.Join(part0, FileName(11, 12))
	if err := os.Symlink("/dev/zero", zero); err != nil {
		t.Fatal(err)
	}
	away := filepath.Join(t.TempDir(), "away.parquet")
	copyFile(t, trajs[0], away)
	outside := filepath.Join(part0, FileName(13, 14))
	if err := os.Symlink(away, outside); err != nil {
		t.Fatal(err)
	}
	abc := filepath.Join(runDir, "topic=trajectories", "partition=abc", filepath.Base(trajs[0]))
	copyFile(t, trajs[0], abc)
	copyFile(t, SidecarPath(trajs[0]), SidecarPath(abc))
	// The last trajectories file, moved elsewhere in the run and linked.
	moved := filepath.Join(runDir, "moved.parquet")
	if err := os.Rename(trajs[2], moved); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join("..", "..", "moved.parquet"), trajs[2]); err != nil {
		t.Fatal(err)
	}

	damaged := map[string]string{
		abc:     `directory partition=abc: "abc" is not a partition number`,
		fifo:    "not a regular file (named pipe)",
		zero:    "not a regular file (symbolic link to /dev/zero, a character device)",
		outside: "outside the run directory",
	}
	var files []File
	var err error
	within(t, 10*time.Second, "List", func() { files, err = List(dir) })
	if err != nil {
		t.Fatalf("List with damaged entries: %v", err)
	}
	got := map[string]File{}
	for _, f := range files {
		got[f.Path] = f
	}
	for path, why := range damaged {
		f, ok := got[path]
		switch {
		case !ok:
			t.Errorf("%s not listed", path)
		case f.Err == nil || !errors.Is(f.Err, ErrCorrupt) || !strings.Contains(f.Err.Error(), path) || !strings.Contains(f.Err.Error(), why):
			t.Errorf("listed %s with error %v, want ErrCorrupt naming it and %q", path, f.Err, why)
		}
	}
	if f := got[abc]; f.Partition != -1 || f.Topic != "trajectories" || f.Run != testRun {
		t.Errorf("file under partition=abc listed as %+v", f)
	}
	for _, p := range trajs {
		if f, ok := got[p]; !ok || f.Err != nil {
			t.Errorf("%s listed %v, error %v; want it listed, whole", p, ok, f.Err)
		}
	}

	// The named pipe first: should ReadFile open it, it reads an empty
	// file; only a reader that refuses it is safe to give /dev/zero.
	for _, path := range []string{fifo, abc, zero, outside} {
		var rerr error
		within(t, 10*time.Second, "ReadFile "+path, func() { _, _, rerr = ReadFile(path, ReadOptions{}) })
		if rerr == nil || !errors.Is(rerr, ErrCorrupt) || !strings.Contains(rerr.Error(), path) || !strings.Contains(rerr.Error(), damaged[path]) {
			t.Fatalf("ReadFile(%s) = %v, want ErrCorrupt naming it and %q", path, rerr, damaged[path])
		}
	}
	if _, msgs, err := ReadFile(trajs[2], ReadOptions{}); err != nil || len(msgs) != 3 {
		t.Errorf("ReadFile of a link inside the run: %d messages, %v", len(msgs), err)
	}

	want := []string{abc, fifo, zero, outside} // List order: partition -1 first
	var re *ReadError
	within(t, 10*time.Second, "ReadRun", func() { _, err = ReadRun(t.Context(), runDir, nil, ReadOptions{}) })
	if !errors.As(err, &re) || !slices.Equal(re.Paths(), want) {
		t.Fatalf("ReadRun: %v, want a *ReadError naming %v", err, want)
	}
	for _, p := range want {
		if !strings.Contains(err.Error(), p+": "+ErrCorrupt.Error()+": "+damaged[p]) && !strings.Contains(err.Error(), damaged[p]) {
			t.Errorf("ReadRun error does not say why %s is damaged: %v", p, err)
		}
	}
	var r *Run
	within(t, 10*time.Second, "ReadRun partial", func() { r, err = ReadRun(t.Context(), runDir, nil, ReadOptions{Partial: true}) })
	if err != nil {
		t.Fatal(err)
	}
	var bad []string
	for _, f := range r.Unreadable {
		bad = append(bad, f.File.Path)
	}
	if !slices.Equal(bad, want) || len(r.Topics["trajectories"]) != 9 || len(r.Gaps) != 0 {
		t.Errorf("partial read: unreadable %v (want %v), %d trajectories messages (want 9), gaps %v", bad, want, len(r.Topics["trajectories"]), r.Gaps)
	}
}

// TestDamagedSidecarAndRunInfo: a checksum sidecar or a run.json that is
// a named pipe is refused, naming it, instead of blocking its reader.
func TestDamagedSidecarAndRunInfo(t *testing.T) {
	dir := t.TempDir()
	trajs, _ := writeTestRun(t, dir)
	runDir := RunDir(dir, testRun)
	side := SidecarPath(trajs[0])
	info := filepath.Join(runDir, RunInfoFile)
	for _, p := range []string{side, info} {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
		pipetest.Mkfifo(t, p)
	}
	var err error
	within(t, 10*time.Second, "ReadFile", func() { _, _, err = ReadFile(trajs[0], ReadOptions{}) })
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), trajs[0]) || !strings.Contains(err.Error(), "checksum sidecar: "+ErrCorrupt.Error()+": not a regular file (named pipe)") {
		t.Errorf("ReadFile with a named pipe for its sidecar: %v", err)
	}
	within(t, 10*time.Second, "ReadRunInfo", func() { _, err = ReadRunInfo(runDir) })
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), info) || !strings.Contains(err.Error(), "not a regular file (named pipe)") {
		t.Errorf("ReadRunInfo of a named pipe: %v", err)
	}
}

// TestReadRegularLimit: a file larger than the limit is refused before
// it is read; one of exactly the limit is read.
func TestReadRegularLimit(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	if err := os.WriteFile(path, make([]byte, 100), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadRegular(path, dir, 99); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "100 bytes, more than the 99") {
		t.Errorf("ReadRegular of 100 bytes, limit 99: %v", err)
	}
	if b, err := ReadRegular(path, dir, 100); err != nil || len(b) != 100 {
		t.Errorf("ReadRegular of 100 bytes, limit 100: %d bytes, %v", len(b), err)
	}
}
