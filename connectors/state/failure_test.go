package state

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/dgraph-io/badger/v4"
)

// TestWritesRefusedWhileSpaceLow: below the reserve nothing reaches
// Badger and the write fails with ErrLowSpace naming the directory; once
// space is back, writes go through (a low disk does not fail the store).
func TestWritesRefusedWhileSpaceLow(t *testing.T) {
	dir := t.TempDir()
	var free atomic.Uint64
	free.Store(1 << 40)
	s, err := Open(dir, Options{FreeSpace: func(d string) (uint64, error) {
		if d != dir {
			t.Errorf("free space asked of %s, want %s", d, dir)
		}
		return free.Load(), nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Set([]byte("a"), []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
	free.Store(uint64(Reserve(Options{})) - 1)
	for name, write := range map[string]func() error{
		"set":    func() error { return s.Set([]byte("b"), []byte("2"), 0) },
		"delete": func() error { return s.Delete([]byte("a")) },
	} {
		err := write()
		if !errors.Is(err, ErrLowSpace) || !strings.Contains(err.Error(), dir) {
			t.Fatalf("%s with too little space: %v, want ErrLowSpace naming %s", name, err, dir)
		}
	}
	if ok, _ := s.Has([]byte("b")); ok {
		t.Fatal("refused write reached the store")
	}
	if ok, _ := s.Has([]byte("a")); !ok {
		t.Fatal("refused delete reached the store")
	}
	if err := s.Err(); err != nil {
		t.Fatalf("low space failed the store: %v", err)
	}
	free.Store(1 << 40)
	if err := s.Set([]byte("b"), []byte("2"), 0); err != nil {
		t.Fatalf("write once space is back: %v", err)
	}
}

// TestReserveFollowsOptions: the default reserve is derived from the
// memtable sizes.
func TestReserveFollowsOptions(t *testing.T) {
	for _, c := range []struct {
		o    Options
		want int64
	}{
		{Options{}, 2*2*(8<<20) + 64<<20},
		{Options{MemTableSize: 1 << 20, NumMemtables: 3}, 2*3*(1<<20) + 64<<20},
	} {
		if got := Reserve(c.o); got != c.want {
			t.Errorf("Reserve(%+v) = %d, want %d", c.o, got, c.want)
		}
	}
}

// TestFailedWriteFailsStore: after a write fails for a reason other than
// the request, no write reaches Badger again (its next write would abort
// the process), and Err names the directory and the cause.
func TestFailedWriteFailsStore(t *testing.T) {
	for _, c := range []struct {
		name  string
		err   error
		fails bool
	}{
		{"memtable", errors.New("cannot create new mem table err: open 00003.mem: permission denied"), true},
		{"enospc", fmt.Errorf("write: %w", syscall.ENOSPC), true},
		{"erofs", fmt.Errorf("write: %w", syscall.EROFS), true},
		{"txn too big", badger.ErrTxnTooBig, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			s, err := Open(dir, Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			var calls atomic.Int32
			real := s.update
			s.update = func(fn func(*badger.Txn) error) error {
				if calls.Add(1) == 1 {
					return c.err
				}
				return real(fn)
			}
			if err := s.Set([]byte("k"), []byte("v"), 0); err == nil || !strings.Contains(err.Error(), `"k"`) {
				t.Fatalf("first write: %v, want its error naming the key", err)
			}
			err = s.Set([]byte("k2"), []byte("v"), 0)
			if !c.fails {
				if err != nil || s.Err() != nil {
					t.Fatalf("after a request error: write %v, Err %v; want the store working", err, s.Err())
				}
				return
			}
			if !errors.Is(err, ErrFailed) || calls.Load() != 1 {
				t.Fatalf("write after a failure: %v after %d Badger writes; want ErrFailed and no Badger write", err, calls.Load())
			}
			if err := s.Delete([]byte("k")); !errors.Is(err, ErrFailed) || calls.Load() != 1 {
				t.Fatalf("delete after a failure: %v after %d Badger writes", err, calls.Load())
			}
			ferr := s.Err()
			if !errors.Is(ferr, ErrFailed) || !strings.Contains(ferr.Error(), dir) || !strings.Contains(ferr.Error(), c.err.Error()) {
				t.Fatalf("Err() = %v, want ErrFailed naming %s and the cause", ferr, dir)
			}
			if _, err := s.Get([]byte("k")); !errors.Is(err, ErrNotFound) {
				t.Fatalf("read of a failed store: %v", err)
			}
		})
	}
}

// TestFreeSpaceErrorFailsStore: a directory whose free space cannot be
// read is unusable.
func TestFreeSpaceErrorFailsStore(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, Options{FreeSpace: func(string) (uint64, error) { return 0, syscall.EIO }})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Set([]byte("k"), nil, 0); !errors.Is(err, ErrFailed) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("write: %v, want ErrFailed wrapping EIO", err)
	}
	if s.Err() == nil {
		t.Fatal("store not failed")
	}
}

// storeWithTables writes records and closes the store, which flushes
// them to a table file; it returns the table files.
func storeWithTables(t *testing.T, dir string) []string {
	t.Helper()
	s, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3000; i++ {
		if err := s.Set([]byte(fmt.Sprintf("env/1/ep/%05d/meta", i)), []byte(strings.Repeat("x", 300)), 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	tables, _ := filepath.Glob(filepath.Join(dir, "*.sst"))
	if len(tables) == 0 {
		t.Fatal("no table file written")
	}
	return tables
}

// TestOpenRefusesDamagedStore: a store whose tables Badger would discard
// silently or cannot read is refused with an error naming the directory
// and the file, never a panic or an empty store.
func TestOpenRefusesDamagedStore(t *testing.T) {
	for _, c := range []struct {
		name   string
		damage func(dir, table string) error
		file   string // named in the error
	}{
		{"manifest removed", func(dir, _ string) error { return os.Remove(filepath.Join(dir, "MANIFEST")) }, "MANIFEST"},
		{"manifest header only", func(dir, _ string) error { return os.Truncate(filepath.Join(dir, "MANIFEST"), 8) }, "MANIFEST"},
		{"manifest shorter than its header", func(dir, _ string) error { return os.Truncate(filepath.Join(dir, "MANIFEST"), 5) }, "MANIFEST"},
		{"manifest torn", func(dir, _ string) error { return os.Truncate(filepath.Join(dir, "MANIFEST"), 12) }, "MANIFEST"},
		{"table truncated", func(_, table string) error { return os.Truncate(table, 50000) }, ".sst"},
		{"table cut to its head", func(_, table string) error { return os.Truncate(table, 100) }, ".sst"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			tables := storeWithTables(t, dir)
			if err := c.damage(dir, tables[0]); err != nil {
				t.Fatal(err)
			}
			s, err := Open(dir, Options{})
			if err == nil {
				s.Close()
				t.Fatal("damaged store opened")
			}
			if !errors.Is(err, ErrDamaged) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), c.file) {
				t.Fatalf("Open: %v, want ErrDamaged naming %s and the %s file", err, dir, c.file)
			}
			if _, serr := os.Stat(tables[0]); serr != nil {
				t.Fatalf("table file gone after the refusal: %v", serr)
			}
		})
	}
}

// TestOpenIntactStoreWithTables: the checks pass a healthy store with
// tables, and its records are all there.
func TestOpenIntactStoreWithTables(t *testing.T) {
	dir := t.TempDir()
	storeWithTables(t, dir)
	s, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if ok, err := s.Has([]byte("env/1/ep/02999/meta")); !ok || err != nil {
		t.Fatalf("record after reopen: %v, %v", ok, err)
	}
}
