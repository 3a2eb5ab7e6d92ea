// Package state is the local state of stateful operators (group assembly,
// pack window, deduplication ids, cursors) on Badger. Nothing here is the
// source of truth: every operator can rebuild its state from its topics
// when the directory is lost (see pipeline.Hold and the operators' Start).
package state

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/dgraph-io/badger/v4"
	"github.com/dgraph-io/badger/v4/options"
	"github.com/dgraph-io/badger/v4/table"
)

// Options sizes the store. The defaults suit a 2-core machine: Badger's own
// defaults (64 MiB memtables x 5, 256 MiB block cache) take ~400 MB RSS for
// a million keys; these take well under half of that.
type Options struct {
	MemTableSize   int64 // bytes per memtable (default 8 MiB)
	NumMemtables   int   // default 2
	BlockCacheSize int64 // default 16 MiB
	IndexCacheSize int64 // default 8 MiB
	// SyncWrites fsyncs every write. Off by default: the state is a cache
	// of what the topics hold.
	SyncWrites bool
	// MinFreeBytes is the free space the directory must keep: while less
	// is available to the process, every write is refused with
	// ErrLowSpace and nothing is written (Badger writes through memory
	// mapped files, and a full disk would kill the process with SIGBUS
	// instead of failing the write). 0 takes the default, Reserve(o):
	// 2 x NumMemtables x MemTableSize (the write-ahead log of each
	// memtable, and the table it is flushed to) plus one value-log file
	// (64 MiB); with the defaults 96 MiB. Negative: no check. An
	// in-memory store has none.
	MinFreeBytes int64
	// FreeSpace returns the bytes available to the process in dir
	// (default: statfs(2)). An error from it fails the store (Err): the
	// directory is unusable.
	FreeSpace func(dir string) (uint64, error)
	Logger    *slog.Logger
}

// valueLogFileSize is the size of one value-log file.
const valueLogFileSize = 64 << 20

// Reserve is the default MinFreeBytes of o (its zero sizes taking their
// defaults): 2 x NumMemtables x MemTableSize + 64 MiB.
func Reserve(o Options) int64 {
	o.defaults()
	return reserve(o)
}

func reserve(o Options) int64 { return 2*int64(o.NumMemtables)*o.MemTableSize + valueLogFileSize }

func (o *Options) defaults() {
	if o.MemTableSize <= 0 {
		o.MemTableSize = 8 << 20
	}
	if o.NumMemtables <= 0 {
		o.NumMemtables = 2
	}
	if o.BlockCacheSize <= 0 {
		o.BlockCacheSize = 16 << 20
	}
	if o.IndexCacheSize <= 0 {
		o.IndexCacheSize = 8 << 20
	}
	if o.MinFreeBytes == 0 {
		o.MinFreeBytes = reserve(*o)
	}
	if o.FreeSpace == nil {
		o.FreeSpace = statfsFree
	}
}

// statfsFree is the space available to an unprivileged process in dir.
func statfsFree(dir string) (uint64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return st.Bavail * uint64(st.Bsize), nil
}

// Store is a key-value store with optional per-key expiry.
//
// A write that fails for any reason other than the request itself (a
// directory that became unwritable, a full disk, an I/O error) fails the
// store: Badger cannot be written again after such an error (its next
// write would abort the process), so every later write returns ErrFailed
// without touching Badger, and Err reports the failure. Reads go on. Only
// a restart (a new Open) clears it.
type Store struct {
	db        *badger.DB
	dir       string
	minFree   int64
	freeSpace func(string) (uint64, error)
	// update runs a read-write transaction (db.Update; tests inject
	// failures).
	update func(func(*badger.Txn) error) error

	mu     sync.Mutex
	failed error
}

var (
	// ErrNotFound is returned by Get for a missing key.
	ErrNotFound = errors.New("state: key not found")
	// ErrLowSpace is wrapped by the errors of writes refused because the
	// directory has less free space than Options.MinFreeBytes. Nothing
	// was written; the write may succeed once space is freed.
	ErrLowSpace = errors.New("state: too little free space")
	// ErrFailed is wrapped by Err and by every write of a failed store.
	ErrFailed = errors.New("state: store failed")
	// ErrDamaged is wrapped by Open's errors about a damaged directory.
	ErrDamaged = errors.New("state: store damaged")
)

// Open opens (or creates) the store in dir. An empty dir opens an in-memory
// store.
//
// Open refuses (ErrDamaged, naming the directory and the file) a directory
// whose tables Badger would discard or cannot read: table (.sst) files
// with a MANIFEST that is missing or holds no complete record after its
// header (Badger would silently start empty), a table the MANIFEST lists
// that is truncated or corrupt, or a write-ahead or value log with a
// damaged entry followed by intact ones (Badger would drop those: a log
// that ends in a torn write, as a crash leaves it, is not damaged). Move the directory aside (or restore
// it) to start afresh.
func Open(dir string, o Options) (*Store, error) {
	o.defaults()
	bo := badger.DefaultOptions(dir).
		WithInMemory(dir == "").
		WithMemTableSize(o.MemTableSize).
		WithNumMemtables(o.NumMemtables).
		WithNumLevelZeroTables(2).
		WithNumLevelZeroTablesStall(8).
		WithBaseTableSize(4 << 20).
		WithValueLogFileSize(valueLogFileSize).
		WithBlockCacheSize(o.BlockCacheSize).
		WithIndexCacheSize(o.IndexCacheSize).
		WithNumCompactors(2).
		WithSyncWrites(o.SyncWrites).
		WithDetectConflicts(false).
		WithLogger(badgerLogger{o.Logger})
	if dir != "" {
		if err := checkDir(dir, bo); err != nil {
			return nil, err
		}
	}
	db, err := openBadger(bo)
	if err != nil {
		return nil, fmt.Errorf("state: open %q: %w", dir, err)
	}
	s := &Store{db: db, dir: dir, minFree: o.MinFreeBytes, freeSpace: o.FreeSpace}
	s.update = db.Update
	return s, nil
}

// openBadger is badger.Open, with a panic of the opening goroutine
// turned into an error.
func openBadger(bo badger.Options) (db *badger.DB, err error) {
	defer func() {
		if r := recover(); r != nil {
			db, err = nil, fmt.Errorf("%w: %v", ErrDamaged, r)
		}
	}()
	return badger.Open(bo)
}

// manifestHeader is the length of the MANIFEST's header (magic and
// versions).
const manifestHeader = 8

// checkDir refuses a damaged store directory before Badger opens it: a
// missing or empty MANIFEST beside table files (Badger would delete the
// tables and start empty), an unreadable MANIFEST, a listed table that
// cannot be read (Badger would panic on one of its own goroutines, which
// nothing can recover), or a log file damaged before its end (Badger
// would drop the entries after the damage: checkLog).
func checkDir(dir string, bo badger.Options) error {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("state: open %q: %w", dir, err)
	}
	var tables []string
	for _, e := range ents {
		switch filepath.Ext(e.Name()) {
		case ".sst":
			tables = append(tables, e.Name())
		case ".mem", ".vlog":
			if err := checkLog(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	if len(tables) == 0 {
		return nil
	}
	sort.Strings(tables)
	mpath := filepath.Join(dir, badger.ManifestFilename)
	f, err := os.Open(mpath)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: %s: %d table file(s) (%s) but no %s: opening would discard them", ErrDamaged, dir, len(tables), strings.Join(tables, ", "), badger.ManifestFilename)
	}
	if err != nil {
		return fmt.Errorf("state: open %q: %w", dir, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("state: open %q: %w", mpath, err)
	}
	m, complete, err := badger.ReplayManifestFile(f, bo.ExternalMagicVersion, bo)
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrDamaged, mpath, err)
	}
	if complete <= manifestHeader {
		return fmt.Errorf("%w: %s: %d bytes, no complete record after its %d-byte header, beside %d table file(s) (%s): opening would discard them",
			ErrDamaged, mpath, fi.Size(), manifestHeader, len(tables), strings.Join(tables, ", "))
	}
	ids := make([]uint64, 0, len(m.Tables))
	for id := range m.Tables {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	for _, id := range ids {
		tm := m.Tables[id]
		if tm.KeyID != 0 {
			continue // encrypted: this store never writes one
		}
		if err := checkTable(table.NewFilename(id, dir), id, bo, tm.Compression); err != nil {
			return err
		}
	}
	return nil
}

// checkTable opens one table file read-only as Badger would, and returns
// an error naming it if that fails (or panics). A missing file is left to
// Badger, which refuses it itself.
func checkTable(path string, id uint64, bo badger.Options, c options.CompressionType) (err error) {
	data, unmap, err := mapFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // left to Badger, which refuses it itself
	}
	if err != nil {
		return err
	}
	defer unmap()
	if len(data) < 8 {
		return fmt.Errorf("%w: %s: table of %d bytes, truncated", ErrDamaged, path, len(data))
	}
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %s: table of %d bytes unreadable (truncated or corrupt)", ErrDamaged, path, len(data))
		}
	}()
	if _, err := table.OpenInMemoryTable(data, id, &table.Options{BlockSize: bo.BlockSize, Compression: c,
		BloomFalsePositive: bo.BloomFalsePositive, ChkMode: options.NoVerification}); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrDamaged, path, err)
	}
	return nil
}

// Close flushes and closes the store; on a nil Store it does nothing.
func (s *Store) Close() error {
	if s == nil {
		return nil
	}
	if err := s.db.Close(); err != nil {
		return fmt.Errorf("state: close: %w", err)
	}
	return nil
}

// Err returns nil while the store can be written, or the error (wrapping
// ErrFailed, naming the directory and the first failed write) that failed
// it.
func (s *Store) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failed
}

func (s *Store) fail(cause error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failed == nil {
		s.failed = fmt.Errorf("%w: directory %s: no more writes after: %w", ErrFailed, s.dir, cause)
	}
	return s.failed
}

// requestError reports whether a Badger write error is about the request
// itself (after which Badger goes on working).
func requestError(err error) bool {
	for _, e := range []error{badger.ErrTxnTooBig, badger.ErrEmptyKey, badger.ErrInvalidKey, badger.ErrBannedKey,
		badger.ErrInvalidRequest, badger.ErrConflict, badger.ErrDBClosed, badger.ErrBlockedWrites} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// write runs fn in a read-write transaction unless the store failed or
// the directory is low on space.
func (s *Store) write(fn func(*badger.Txn) error) error {
	if err := s.Err(); err != nil {
		return err
	}
	if s.dir != "" && s.minFree > 0 {
		free, err := s.freeSpace(s.dir)
		if err != nil {
			return s.fail(fmt.Errorf("free space of %s: %w", s.dir, err))
		}
		if free < uint64(s.minFree) {
			return fmt.Errorf("%w: directory %s has %d bytes free, the store keeps %d in reserve", ErrLowSpace, s.dir, free, s.minFree)
		}
	}
	err := s.update(fn)
	if err != nil && !requestError(err) {
		return s.fail(err)
	}
	return err
}

// Set writes key=value; ttl > 0 makes the key expire (a bounded horizon
// for deduplication ids).
func (s *Store) Set(key, value []byte, ttl time.Duration) error {
	err := s.write(func(txn *badger.Txn) error {
		e := badger.NewEntry(key, value)
		if ttl > 0 {
			e = e.WithTTL(ttl)
		}
		return txn.SetEntry(e)
	})
	if err != nil {
		return fmt.Errorf("state: set %q: %w", key, err)
	}
	return nil
}

// Get returns the value of key or ErrNotFound.
func (s *Store) Get(key []byte) ([]byte, error) {
	var out []byte
	err := s.db.View(func(txn *badger.Txn) error {
		it, err := txn.Get(key)
		if err != nil {
			return err
		}
		out, err = it.ValueCopy(nil)
		return err
	})
	if errors.Is(err, badger.ErrKeyNotFound) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("state: get %q: %w", key, err)
	}
	return out, nil
}

// Has reports whether key is present (and not expired).
func (s *Store) Has(key []byte) (bool, error) {
	_, err := s.Get(key)
	if errors.Is(err, ErrNotFound) {
		return false, nil
	}
	return err == nil, err
}

// Delete removes key.
func (s *Store) Delete(key []byte) error {
	if err := s.write(func(txn *badger.Txn) error { return txn.Delete(key) }); err != nil {
		return fmt.Errorf("state: delete %q: %w", key, err)
	}
	return nil
}

// Scan calls fn for every key with prefix, in key order.
func (s *Store) Scan(ctx context.Context, prefix []byte, fn func(key, value []byte) error) error {
	err := s.db.View(func(txn *badger.Txn) error {
		it := txn.NewIterator(badger.IteratorOptions{PrefetchValues: true, PrefetchSize: 64, Prefix: prefix})
		defer it.Close()
		for it.Seek(prefix); it.ValidForPrefix(prefix); it.Next() {
			if err := ctx.Err(); err != nil {
				return err
			}
			item := it.Item()
			v, err := item.ValueCopy(nil)
			if err != nil {
				return err
			}
			if err := fn(item.KeyCopy(nil), v); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("state: scan %q: %w", prefix, err)
	}
	return nil
}

// SetInt64 and GetInt64 store cursors.
func (s *Store) SetInt64(key []byte, v int64) error {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(v))
	return s.Set(key, b[:], 0)
}

// GetInt64 returns the cursor at key, or def when absent.
func (s *Store) GetInt64(key []byte, def int64) (int64, error) {
	b, err := s.Get(key)
	if errors.Is(err, ErrNotFound) {
		return def, nil
	}
	if err != nil {
		return 0, err
	}
	if len(b) != 8 {
		return 0, fmt.Errorf("state: cursor %q has %d bytes, want 8", key, len(b))
	}
	return int64(binary.BigEndian.Uint64(b)), nil
}

type badgerLogger struct{ l *slog.Logger }

func (b badgerLogger) Errorf(f string, a ...any) {
	if b.l != nil {
		b.l.Error(fmt.Sprintf(f, a...), "component", "badger")
	}
}
func (b badgerLogger) Warningf(f string, a ...any) {
	if b.l != nil {
		b.l.Warn(fmt.Sprintf(f, a...), "component", "badger")
	}
}
func (badgerLogger) Infof(string, ...any)  {}
func (badgerLogger) Debugf(string, ...any) {}

// IDSet is a set of ids stored under a key prefix, each kept for ttl (0:
// forever). Stages use it for deduplication memory that outlives a
// restart.
type IDSet struct {
	store  *Store
	prefix string
	ttl    time.Duration
}

// IDSet returns the set of ids under prefix.
func (s *Store) IDSet(prefix string, ttl time.Duration) IDSet {
	return IDSet{store: s, prefix: prefix, ttl: ttl}
}

func (i IDSet) key(id string) []byte { return []byte(i.prefix + id) }

// Add puts id in the set.
func (i IDSet) Add(id string) error { return i.store.Set(i.key(id), nil, i.ttl) }

// Has reports whether id is in the set (and not expired).
func (i IDSet) Has(id string) (bool, error) { return i.store.Has(i.key(id)) }
