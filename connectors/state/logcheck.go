package state

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Badger's log files: the write-ahead log of each memtable (.mem) and the
// value log (.vlog). Each starts with a header (an encryption key id and
// IV, logHeader bytes) and holds entries back to back, each
//
//	meta, user meta (1 byte each), key length, value length, expiry
//	(unsigned varints), key, value, CRC-32C of all of these (4 bytes,
//	big-endian),
//
// then zeros up to the file's preallocated size. When Badger opens a
// store it replays each log from its header to the first entry that does
// not check, and cuts the file there. Where the log ends because a write
// was torn by a crash, that loses only the write in flight, which was
// never acknowledged. But a damaged byte in the middle of a log (a disk
// error, a stray write) ends the replay there too, and every entry after
// it — writes that were synced and acknowledged — is dropped without a
// word: a single changed byte in a memtable's log lost 50 of 100 synced
// writes. checkLog tells the two apart before Badger opens the store.
const logHeader = 20

// maxLogKey is the largest key Badger writes (its replay stops at a
// longer one).
const maxLogKey = 1 << 16

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// logEntryAt returns the end of the entry at off in data, and whether a
// whole entry whose checksum matches is there.
func logEntryAt(data []byte, off int) (int, bool) {
	if off+2 > len(data) {
		return 0, false
	}
	i := off + 2
	var lens [3]uint64
	for k := range lens {
		v, n := binary.Uvarint(data[i:])
		if n <= 0 {
			return 0, false
		}
		lens[k], i = v, i+n
	}
	klen, vlen := lens[0], lens[1]
	if klen == 0 || klen > maxLogKey || vlen > uint64(len(data)) {
		return 0, false
	}
	end := i + int(klen) + int(vlen)
	if end+crc32.Size > len(data) {
		return 0, false
	}
	if crc32.Checksum(data[off:end], castagnoli) != binary.BigEndian.Uint32(data[end:]) {
		return 0, false
	}
	return end + crc32.Size, true
}

// checkLogData returns the offset at which data's replay stops and the
// offset of an intact entry after it (-1 when none: the log is whole, or
// ends in a torn write).
func checkLogData(data []byte) (stop, later int) {
	stop = logHeader
	for {
		next, ok := logEntryAt(data, stop)
		if !ok {
			break
		}
		stop = next
	}
	last := lastNonZero(data)
	for off := stop + 1; off <= last; off++ {
		if _, ok := logEntryAt(data, off); ok {
			return stop, off
		}
	}
	return stop, -1
}

// checkLog refuses (ErrDamaged, naming the file and offsets) a log file
// in which an entry that does not check is followed by one that does: a
// damaged log whose replay would drop acknowledged writes.
func checkLog(path string) error {
	data, unmap, err := mapFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer unmap()
	if len(data) <= logHeader {
		return nil // no entry: Badger rewrites a header it lacks
	}
	if stop, later := checkLogData(data); later >= 0 {
		return fmt.Errorf("%w: %s: the entry at byte %d does not check and intact entries follow (the first at byte %d): opening would drop them",
			ErrDamaged, path, stop, later)
	}
	return nil
}

// mapFile maps the file at path read-only: its bytes (none for an empty
// file) and the call that unmaps them. A missing file's error wraps
// fs.ErrNotExist.
func mapFile(path string) ([]byte, func(), error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, fmt.Errorf("state: open %q: %w", path, err)
	}
	defer f.Close() // the mapping outlives the descriptor
	fi, err := f.Stat()
	if err != nil {
		return nil, nil, fmt.Errorf("state: open %q: %w", path, err)
	}
	if fi.Size() == 0 {
		return nil, func() {}, nil
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(fi.Size()), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil, nil, fmt.Errorf("state: open %q: mmap: %w", path, err)
	}
	return data, func() { _ = syscall.Munmap(data) }, nil
}

// zeroChunk is compared with a log's tail, a chunk at a time (a log is
// mostly its preallocated zeros).
var zeroChunk = make([]byte, 64<<10)

// lastNonZero returns the index of data's last byte that is not 0 (-1:
// none).
func lastNonZero(data []byte) int {
	end := len(data)
	for end >= len(zeroChunk) && bytes.Equal(data[end-len(zeroChunk):end], zeroChunk) {
		end -= len(zeroChunk)
	}
	for end > 0 && data[end-1] == 0 {
		end--
	}
	return end - 1
}

// AsidePrefix starts the name of a directory MoveAside makes.
const AsidePrefix = "damaged-"

// MoveAside moves every entry of the store directory dir (but the
// directories earlier calls made) into a new directory dir/damaged-<time>
// and returns its path: a store Open refuses as damaged is kept for
// inspection, and dir opens empty. It is for a store that is a cache
// (an operator rebuilds its state from its topics), never for one that is
// the source of truth.
func MoveAside(dir string, now time.Time) (string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", fmt.Errorf("state: move %q aside: %w", dir, err)
	}
	aside := filepath.Join(dir, AsidePrefix+now.UTC().Format("20060102T150405.000000000Z"))
	if err := os.Mkdir(aside, 0o755); err != nil {
		return "", fmt.Errorf("state: move %q aside: %w", dir, err)
	}
	for _, e := range ents {
		if e.IsDir() && strings.HasPrefix(e.Name(), AsidePrefix) {
			continue
		}
		if err := os.Rename(filepath.Join(dir, e.Name()), filepath.Join(aside, e.Name())); err != nil {
			return aside, fmt.Errorf("state: move %q aside: %w", dir, err)
		}
	}
	return aside, nil
}
