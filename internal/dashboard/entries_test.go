package dashboard

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/internal/pipetest"
	"github.com/trajflow/trajflow/schemas"
)

// newWithin is New, failing the test when it has not returned within a
// minute.
func newWithin(t *testing.T, ctx context.Context, cfg Config) (*Dashboard, error) {
	t.Helper()
	type result struct {
		d   *Dashboard
		err error
	}
	c := make(chan result, 1)
	go func() {
		d, err := New(ctx, cfg)
		c <- result{d, err}
	}()
	select {
	case r := <-c:
		return r.d, r.err
	case <-time.After(time.Minute):
		t.Fatal("the dashboard did not read the run within a minute")
	}
	return nil, nil
}

// TestDamagedEntries: a named pipe and a link leading out of the run,
// named like snapshot files, and a stray partition=abc directory holding
// a copy of a valid file, are listed among the unreadable files, each
// with why; the dashboard neither blocks on the pipe nor refuses the run.
func TestDamagedEntries(t *testing.T) {
	out, sum := demoRun(t)
	dir := copyDir(t, out)
	files, err := parquet.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	var last parquet.File
	for _, f := range files {
		if f.Topic == "valid" && f.Partition == 0 {
			last = f
		}
	}
	if last.Path == "" {
		t.Fatal("the run has no file of valid/0")
	}
	part0 := filepath.Dir(last.Path)
	pipe := filepath.Join(part0, parquet.FileName(last.LastOffset+100, last.LastOffset+101))
	pipetest.Mkfifo(t, pipe)
	away := filepath.Join(t.TempDir(), "away.parquet")
	link := filepath.Join(part0, parquet.FileName(last.LastOffset+200, last.LastOffset+201))
	if err := os.Symlink(away, link); err != nil {
		t.Fatal(err)
	}
	abc := filepath.Join(filepath.Dir(part0), "partition=abc", filepath.Base(last.Path))
	if err := os.MkdirAll(filepath.Dir(abc), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, p := range [][2]string{{last.Path, abc}, {parquet.SidecarPath(last.Path), parquet.SidecarPath(abc)}, {last.Path, away}} {
		b, err := os.ReadFile(p[0])
		if err == nil {
			err = os.WriteFile(p[1], b, 0o644)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	rel := func(p string) string { r, _ := filepath.Rel(dir, p); return r }
	want := map[string]string{
		rel(pipe): "not a regular file (named pipe)",
		rel(link): "outside the run directory",
		rel(abc):  `directory partition=abc: "abc" is not a partition number`,
	}

	d, err := newWithin(t, context.Background(), Config{Dir: dir, EvalSamples: 0})
	if err != nil {
		t.Fatalf("a run with damaged entries: %v", err)
	}
	s := d.view.Summary
	failures := map[string]string{}
	for _, f := range s.Integrity.Hashes.Files.Failures {
		failures[f.File] = f.Error
	}
	for file, why := range want {
		if !strings.Contains(failures[file], why) || !strings.Contains(failures[file], file) {
			t.Errorf("failure of %s: %q, want it named, with %q", file, failures[file], why)
		}
		if !slices.Contains(s.Overview.UnreadableFiles, file) {
			t.Errorf("overview unreadable files %v lack %s", s.Overview.UnreadableFiles, file)
		}
	}
	if len(failures) != len(want) || len(s.Overview.UnreadableFiles) != len(want) {
		t.Errorf("failures %v, unreadable %v: want exactly %d", failures, s.Overview.UnreadableFiles, len(want))
	}
	if s.Overview.Launched != sum.AttemptsLaunched {
		t.Errorf("the rest of the run was not read: %d launched, summary.json %d", s.Overview.Launched, sum.AttemptsLaunched)
	}
}

// TestReadStopsWhenCancelled: reading a run stops between files once its
// context is done (SIGTERM while the dashboard loads).
func TestReadStopsWhenCancelled(t *testing.T) {
	out, _ := demoRun(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := newWithin(t, ctx, Config{Dir: out, EvalSamples: 0}); !errors.Is(err, context.Canceled) {
		t.Errorf("New with a cancelled context: %v, want context.Canceled", err)
	}
}

// TestDamagedReleaseEntries: a named pipe named like a manifest, and one
// in place of a manifest's checkpoint, are reported, each with why; the
// release directory is read without blocking on them.
func TestDamagedReleaseEntries(t *testing.T) {
	dir := t.TempDir()
	pipe := filepath.Join(dir, gpu.ManifestName(2))
	pipetest.Mkfifo(t, pipe)
	ckpt := filepath.Join(dir, gpu.CheckpointName(1))
	pipetest.Mkfifo(t, ckpt)
	m, err := json.Marshal(schemas.PolicyRelease{PolicyVersion: 1, Ready: true, CheckpointURI: "file://" + filepath.ToSlash(ckpt)})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, gpu.ManifestName(1)), m, 0o644); err != nil {
		t.Fatal(err)
	}
	r, err := readReleases(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	const why = "not a regular file (named pipe)"
	if len(r.Problems) != 1 || !strings.Contains(r.Problems[0], gpu.ManifestName(2)) || !strings.Contains(r.Problems[0], why) {
		t.Errorf("problems %q, want one naming %s with %q", r.Problems, gpu.ManifestName(2), why)
	}
	if c := r.Checks[1]; c.OK || !strings.Contains(c.Error, ckpt) || !strings.Contains(c.Error, why) {
		t.Errorf("check of release 1: %+v, want an error naming %s with %q", c, ckpt, why)
	}
}
