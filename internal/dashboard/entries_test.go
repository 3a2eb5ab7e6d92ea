package dashboard

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/pipetest"
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
