// Package regfile reads files that must be regular files of bounded size,
// without ever blocking on a named pipe or reading a device without end:
// what a reader of files a user or another process may have replaced
// (snapshot files, policy releases) needs.
package regfile

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
)

// Error says why a file is not one Read reads: not a regular file, larger
// than the limit, or changed while it was read. Errors opening or reading
// the file are returned as they are.
type Error struct{ msg string }

func (e *Error) Error() string { return e.msg }

func unusable(format string, args ...any) error { return &Error{fmt.Sprintf(format, args...)} }

// Read reads the file at path (a symbolic link is followed) when it is a
// regular file of at most limit bytes. It opens without waiting for a
// writer (a named pipe put there is refused, not waited on) and reads at
// most the size the file had when opened: one that grows or shrinks while
// read is refused.
func Read(path string, limit int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, unusable("not a regular file (%s)", Kind(fi.Mode()))
	}
	size := fi.Size()
	if size > limit {
		return nil, unusable("%d bytes, more than the %d bytes such a file may hold", size, limit)
	}
	// One byte more than its size tells a file that grows while read.
	buf := make([]byte, size+1)
	n, err := io.ReadFull(io.LimitReader(f, size+1), buf)
	switch {
	case err == nil:
		return nil, unusable("the file grew past its %d bytes while it was read", size)
	case errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF):
		if int64(n) != size {
			return nil, unusable("%d bytes read of the %d the file held when opened: it changed while it was read", n, size)
		}
		return buf[:n], nil
	}
	return nil, err
}

// Kind names the type of a file that is not a regular file.
func Kind(m fs.FileMode) string {
	switch {
	case m&fs.ModeNamedPipe != 0:
		return "named pipe"
	case m&fs.ModeSocket != 0:
		return "socket"
	case m&fs.ModeCharDevice != 0:
		return "character device"
	case m&fs.ModeDevice != 0:
		return "block device"
	case m.IsDir():
		return "directory"
	case m&fs.ModeSymlink != 0:
		return "symbolic link"
	}
	return "irregular file"
}
