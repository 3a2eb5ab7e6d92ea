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
	"log/slog"
	"time"

	"github.com/dgraph-io/badger/v4"
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
	Logger     *slog.Logger
}

// Store is a key-value store with optional per-key expiry.
type Store struct {
	db *badger.DB
}

// ErrNotFound is returned by Get for a missing key.
var ErrNotFound = errors.New("state: key not found")

// Open opens (or creates) the store in dir. An empty dir opens an in-memory
// store.
func Open(dir string, o Options) (*Store, error) {
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
	bo := badger.DefaultOptions(dir).
		WithInMemory(dir == "").
		WithMemTableSize(o.MemTableSize).
		WithNumMemtables(o.NumMemtables).
		WithNumLevelZeroTables(2).
		WithNumLevelZeroTablesStall(8).
		WithBaseTableSize(4 << 20).
		WithValueLogFileSize(64 << 20).
		WithBlockCacheSize(o.BlockCacheSize).
		WithIndexCacheSize(o.IndexCacheSize).
		WithNumCompactors(2).
		WithSyncWrites(o.SyncWrites).
		WithDetectConflicts(false).
		WithLogger(badgerLogger{o.Logger})
	db, err := badger.Open(bo)
	if err != nil {
		return nil, fmt.Errorf("state: open %q: %w", dir, err)
	}
	return &Store{db: db}, nil
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

// Set writes key=value; ttl > 0 makes the key expire (a bounded horizon
// for deduplication ids).
func (s *Store) Set(key, value []byte, ttl time.Duration) error {
	err := s.db.Update(func(txn *badger.Txn) error {
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
	if err := s.db.Update(func(txn *badger.Txn) error { return txn.Delete(key) }); err != nil {
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
