package pipeline

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/state"
	"github.com/trajflow/trajflow/internal/pipetest"
)

func TestBackoffDelay(t *testing.T) {
	b := Backoff{Initial: 100 * time.Millisecond, Max: time.Second}
	for _, c := range []struct {
		n    int
		want time.Duration
	}{{0, 0}, {1, 100 * time.Millisecond}, {2, 200 * time.Millisecond}, {4, 800 * time.Millisecond}, {5, time.Second}, {40, time.Second}} {
		if got := b.Delay(c.n); got != c.want {
			t.Errorf("Delay(%d) = %v, want %v", c.n, got, c.want)
		}
	}
}

func TestRetry(t *testing.T) {
	ctx := context.Background()
	calls := 0
	flaky := errors.New("flaky")
	err := Retry(ctx, Backoff{Attempts: 4}, func(context.Context, int) error {
		calls++
		if calls < 3 {
			return flaky
		}
		return nil
	})
	if err != nil || calls != 3 {
		t.Fatalf("retry until success: err %v after %d calls, want nil after 3", err, calls)
	}
	calls = 0
	err = Retry(ctx, Backoff{Attempts: 3}, func(context.Context, int) error { calls++; return flaky })
	if !errors.Is(err, flaky) || calls != 3 {
		t.Fatalf("attempts spent: err %v after %d calls, want flaky after 3", err, calls)
	}
	calls = 0
	err = Retry(ctx, Backoff{Attempts: 5}, func(context.Context, int) error {
		calls++
		return errors.Join(ErrPermanent, flaky)
	})
	if !errors.Is(err, flaky) || calls != 1 {
		t.Fatalf("permanent error: err %v after %d calls, want one call", err, calls)
	}
	// A cancelled context ends the wait at once, not after the backoff.
	cctx, cancel := context.WithCancel(ctx)
	start := time.Now()
	go func() { time.Sleep(20 * time.Millisecond); cancel() }()
	err = Retry(cctx, Backoff{Attempts: 3, Initial: time.Hour}, func(context.Context, int) error { return flaky })
	if !errors.Is(err, context.Canceled) || time.Since(start) > 10*time.Second {
		t.Fatalf("cancelled during backoff: %v after %v", err, time.Since(start))
	}
}

func TestDirReleases(t *testing.T) {
	dir := t.TempDir()
	rs, err := NewDirReleases(filepath.Join(dir, "releases"))
	if err != nil {
		t.Fatal(err)
	}
	uri, err := rs.Write("a.bin", []byte("one"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rs.Write("a.bin", []byte("two")); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"a.bin", uri} {
		b, err := rs.Read(name)
		if err != nil || string(b) != "two" {
			t.Fatalf("read %s: %q %v", name, b, err)
		}
	}
	if b, err := ReadURI(uri); err != nil || string(b) != "two" {
		t.Fatalf("ReadURI: %q %v", b, err)
	}
	entries, _ := os.ReadDir(rs.Dir())
	if len(entries) != 1 {
		t.Fatalf("files %v: a temporary file was left", entries)
	}
	if _, err := rs.Read("missing"); !IsNotExist(err) {
		t.Fatalf("missing file: %v", err)
	}
	// A release names its checkpoint by a URI in a message: one that is
	// not a regular file (a pipe, a device such as /dev/zero) is refused
	// naming it, never read until it ends.
	pipe := filepath.Join(rs.Dir(), "pipe.ckpt")
	pipetest.Mkfifo(t, pipe)
	for name, read := range map[string]func() ([]byte, error){
		"Read":    func() ([]byte, error) { return rs.Read("pipe.ckpt") },
		"ReadURI": func() ([]byte, error) { return ReadURI("file://" + filepath.ToSlash(pipe)) },
	} {
		if b, err := read(); err == nil || !strings.Contains(err.Error(), pipe) || !strings.Contains(err.Error(), "not a regular file (named pipe)") {
			t.Errorf("%s of a named pipe: %q %v, want an error naming %s", name, b, err, pipe)
		}
	}
	for _, bad := range []string{"", "../x", "a/b"} {
		if _, err := rs.Write(bad, nil); err == nil {
			t.Errorf("name %q accepted", bad)
		}
	}
}

func TestEnvStateOpenedOnceAndClosed(t *testing.T) {
	env := NewEnv(EnvConfig{StateDir: t.TempDir()})
	a, err := env.State()
	if err != nil {
		t.Fatal(err)
	}
	b, err := env.State()
	if err != nil || a != b {
		t.Fatalf("second State: %p %v, want the same store %p", b, err, a)
	}
	if err := a.Set([]byte("k"), []byte("v"), 0); err != nil {
		t.Fatal(err)
	}
	if err := env.Close(); err != nil {
		t.Fatal(err)
	}
	if err := env.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := env.Scan(context.Background(), "t", 0, nil); !errors.Is(err, ErrNoScanner) {
		t.Fatalf("scan without scanner: %v", err)
	}
	if _, err := env.Releases(); !errors.Is(err, ErrNoReleases) {
		t.Fatalf("releases without store: %v", err)
	}
}

// TestEnvStateMovesADamagedStoreAside: a state directory state.Open
// refuses as damaged (here a table beside no MANIFEST, which Badger would
// silently discard) is moved into a damaged-<time> directory inside it,
// logged, and the stage gets an empty store to rebuild from its topics;
// the next open keeps the moved store aside and opens the new one.
func TestEnvStateMovesADamagedStoreAside(t *testing.T) {
	dir := t.TempDir()
	env := NewEnv(EnvConfig{StateDir: dir})
	st, err := env.State()
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Set([]byte("k"), []byte("v"), 0); err != nil {
		t.Fatal(err)
	}
	if err := env.Close(); err != nil { // flushes the memtable into a table
		t.Fatal(err)
	}
	if m, _ := filepath.Glob(filepath.Join(dir, "*.sst")); len(m) == 0 {
		t.Fatal("no table written")
	}
	if err := os.Remove(filepath.Join(dir, "MANIFEST")); err != nil {
		t.Fatal(err)
	}
	var logged strings.Builder
	env = NewEnv(EnvConfig{StateDir: dir, Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	st, err = env.State()
	if err != nil {
		t.Fatalf("State on a damaged directory: %v", err)
	}
	if has, err := st.Has([]byte("k")); err != nil || has {
		t.Fatalf("the new store holds k (%v), want an empty store", err)
	}
	aside, _ := filepath.Glob(filepath.Join(dir, state.AsidePrefix+"*"))
	if len(aside) != 1 {
		t.Fatalf("%d directories moved aside, want 1", len(aside))
	}
	if m, _ := filepath.Glob(filepath.Join(aside[0], "*.sst")); len(m) == 0 {
		t.Fatalf("the damaged table is not kept in %s", aside[0])
	}
	if !strings.Contains(logged.String(), "state store damaged") || !strings.Contains(logged.String(), aside[0]) {
		t.Fatalf("log %q does not say where the store went", logged.String())
	}
	if err := st.Set([]byte("k2"), []byte("v2"), 0); err != nil {
		t.Fatal(err)
	}
	if err := env.Close(); err != nil {
		t.Fatal(err)
	}
	env = NewEnv(EnvConfig{StateDir: dir})
	defer env.Close()
	st, err = env.State()
	if err != nil {
		t.Fatalf("reopening: %v", err)
	}
	if v, err := st.Get([]byte("k2")); err != nil || string(v) != "v2" {
		t.Fatalf("k2 = %q (%v) after reopening", v, err)
	}
	if again, _ := filepath.Glob(filepath.Join(dir, state.AsidePrefix+"*")); len(again) != 1 {
		t.Fatalf("%d directories aside after a clean reopen, want 1", len(again))
	}
}
