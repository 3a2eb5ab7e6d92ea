package state

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// crashCopy writes n synced keys (values of size bytes) to a store in a
// new directory and returns a copy of that directory taken while the
// store is still open: the files a kill -9 after the last write leaves.
func crashCopy(t *testing.T, n, size int) string {
	t.Helper()
	dir := t.TempDir()
	s, err := Open(dir, Options{SyncWrites: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i := range n {
		v := bytes.Repeat([]byte{'v'}, size)
		copy(v, fmt.Sprintf("value-%03d-", i))
		if err := s.Set(logKey(i), v, 0); err != nil {
			t.Fatal(err)
		}
	}
	cp := t.TempDir()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(cp, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return cp
}

func logKey(i int) []byte { return fmt.Appendf(nil, "k%03d", i) }

// only returns the one file of dir with extension ext.
func only(t *testing.T, dir, ext string) string {
	t.Helper()
	m, _ := filepath.Glob(filepath.Join(dir, "*"+ext))
	if len(m) != 1 {
		t.Fatalf("%d %s files in %s, want 1", len(m), ext, dir)
	}
	return m[0]
}

// patch applies fn to the bytes of the file at path.
func patch(t *testing.T, path string, fn func([]byte)) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	fn(b)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// found counts the keys 0..n-1 the store in dir holds.
func found(t *testing.T, dir string, n int) int {
	t.Helper()
	s, err := Open(dir, Options{SyncWrites: true})
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	defer s.Close()
	c := 0
	for i := range n {
		if v, err := s.Get(logKey(i)); err == nil && v != nil {
			c++
		}
	}
	return c
}

// TestOpenRefusesDamagedLog: a changed byte in the middle of a
// memtable's write-ahead log, or of the value log, would make Badger drop
// every synced write after it (50 of 100 before this check); Open refuses
// the directory, naming the file and the offsets. A log that ends in a
// torn write (a crash in the middle of the last write) opens, losing only
// that write, and an intact one loses nothing.
func TestOpenRefusesDamagedLog(t *testing.T) {
	const n = 100
	t.Run("intact", func(t *testing.T) {
		if got := found(t, crashCopy(t, n, 40), n); got != n {
			t.Fatalf("%d of %d keys", got, n)
		}
	})
	t.Run("torn last write", func(t *testing.T) {
		dir := crashCopy(t, n, 40)
		patch(t, only(t, dir, ".mem"), func(b []byte) {
			end := bytes.LastIndex(b, []byte("value-099-"))
			for i := end; i < len(b); i++ { // the write never reached the disk past here
				b[i] = 0
			}
		})
		if got := found(t, dir, n); got != n-1 {
			t.Fatalf("%d of %d keys, want all but the torn last", got, n)
		}
	})
	t.Run("damaged write-ahead log", func(t *testing.T) {
		dir := crashCopy(t, n, 40)
		mem := only(t, dir, ".mem")
		patch(t, mem, func(b []byte) { b[bytes.Index(b, []byte("value-050-"))+3] ^= 0x20 })
		_, err := Open(dir, Options{SyncWrites: true})
		if !errors.Is(err, ErrDamaged) || !strings.Contains(err.Error(), mem) || !strings.Contains(err.Error(), "intact entries follow") {
			t.Fatalf("open: %v, want ErrDamaged naming %s", err, mem)
		}
	})
	t.Run("damaged value log", func(t *testing.T) {
		const big = 3
		dir := crashCopy(t, big, 3<<20/2) // values over the 1 MiB value threshold go to the value log
		vlog := only(t, dir, ".vlog")
		patch(t, vlog, func(b []byte) { b[bytes.Index(b, []byte("value-000-"))+1<<20] ^= 1 })
		_, err := Open(dir, Options{SyncWrites: true})
		if !errors.Is(err, ErrDamaged) || !strings.Contains(err.Error(), vlog) {
			t.Fatalf("open: %v, want ErrDamaged naming %s", err, vlog)
		}
	})
}

// logEntry encodes one log entry (logcheck.go's layout).
func logEntry(key, value string) []byte {
	b := []byte{0x40, 0}
	b = binary.AppendUvarint(b, uint64(len(key)))
	b = binary.AppendUvarint(b, uint64(len(value)))
	b = binary.AppendUvarint(b, 0)
	b = append(append(b, key...), value...)
	return binary.BigEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
}

func TestCheckLogData(t *testing.T) {
	head := bytes.Repeat([]byte{7}, logHeader)
	e1, e2, e3 := logEntry("key-one-", "v1"), logEntry("key-two-", "value two"), logEntry("key-three", "3")
	join := func(parts ...[]byte) []byte { return append(append([]byte{}, head...), bytes.Join(parts, nil)...) }
	flip := func(e []byte, i int) []byte { c := bytes.Clone(e); c[i] ^= 1; return c }
	zeros := make([]byte, 64)
	for _, tc := range []struct {
		name        string
		data        []byte
		stop, later int
	}{
		{"header only", join(zeros), logHeader, -1},
		{"whole", join(e1, e2, e3, zeros), logHeader + len(e1) + len(e2) + len(e3), -1},
		{"full to the end", join(e1, e2), logHeader + len(e1) + len(e2), -1},
		{"torn last entry", join(e1, e2, e3[:len(e3)-3], zeros), logHeader + len(e1) + len(e2), -1},
		{"damaged last entry", join(e1, e2, flip(e3, 12), zeros), logHeader + len(e1) + len(e2), -1},
		{"damaged value, entries follow", join(e1, flip(e2, 12), e3, zeros), logHeader + len(e1), logHeader + len(e1) + len(e2)},
		{"damaged length, entries follow", join(e1, flip(e2, 3), e3, zeros), logHeader + len(e1), logHeader + len(e1) + len(e2)},
		{"damaged checksum, entries follow", join(flip(e1, len(e1)-1), e2), logHeader, logHeader + len(e1)},
		{"zeros inside, entries follow", join(e1, make([]byte, len(e2)), e3), logHeader + len(e1), logHeader + len(e1) + len(e2)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if stop, later := checkLogData(tc.data); stop != tc.stop || later != tc.later {
				t.Fatalf("stop %d later %d, want %d %d", stop, later, tc.stop, tc.later)
			}
		})
	}
}

// FuzzCheckLogData: any bytes are answered without a panic; the replay
// stops inside the data, and an intact entry reported after it is one.
func FuzzCheckLogData(f *testing.F) {
	head := make([]byte, logHeader)
	f.Add(append(head, logEntry("key-one-", "v")...))
	f.Add(append(append(head, 1, 2, 3), logEntry("key-two-", "w")...))
	f.Add([]byte{1, 2})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) <= logHeader {
			return // checkLog does not look at such a file
		}
		stop, later := checkLogData(data)
		if stop < logHeader || stop > len(data) {
			t.Fatalf("stop %d outside %d bytes", stop, len(data))
		}
		if later >= 0 {
			if _, ok := logEntryAt(data, later); !ok || later <= stop {
				t.Fatalf("later %d (stop %d) is no intact entry", later, stop)
			}
		}
	})
}

// BenchmarkCheckLogEmptyValueLog: what Open spends on a store's value
// log file as Badger preallocates it (128 MiB, a header and zeros).
func BenchmarkCheckLogEmptyValueLog(b *testing.B) {
	path := filepath.Join(b.TempDir(), "000001.vlog")
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := f.Write(bytes.Repeat([]byte{9}, logHeader)); err != nil {
		b.Fatal(err)
	}
	if err := f.Truncate(2 * valueLogFileSize); err != nil {
		b.Fatal(err)
	}
	f.Close()
	b.SetBytes(2 * valueLogFileSize)
	for b.Loop() {
		if err := checkLog(path); err != nil {
			b.Fatal(err)
		}
	}
}
