package parquet

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// Bounds on what a reader reads of one file. A snapshot file holds about
// RollBytes of messages (64 MiB by default); MaxFileBytes leaves room
// for any roll size a run would use. Run-level JSON and sidecars are
// small.
const (
	MaxFileBytes    = 4 << 30
	maxSidecarBytes = 4 << 10
	maxRunInfoBytes = 1 << 20
)

// ReadRegular reads the file at path when it is a regular file, or a
// symbolic link that resolves to a regular file inside root, and holds
// at most limit bytes. Anything else — a named pipe, a device, a
// directory, a link leading elsewhere, a larger file, a file that grows
// while it is read — is an error wrapping ErrCorrupt that says why: it
// never blocks on a pipe nor reads more than limit bytes. root is the
// run directory of a snapshot's files.
func ReadRegular(path, root string, limit int64) ([]byte, error) {
	target, err := resolveRegular(path, root)
	if err != nil {
		return nil, err
	}
	// O_NONBLOCK: should the file have been replaced by a named pipe
	// since it was checked, opening it does not wait for a writer.
	f, err := os.OpenFile(target, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: not a regular file (%s)", ErrCorrupt, fileKind(fi.Mode()))
	}
	size := fi.Size()
	if size > limit {
		return nil, fmt.Errorf("%w: %d bytes, more than the %d bytes such a file may hold", ErrCorrupt, size, limit)
	}
	// One byte more than its size tells a file that grows while read.
	buf := make([]byte, size+1)
	n, err := io.ReadFull(io.LimitReader(f, size+1), buf)
	switch {
	case err == nil:
		return nil, fmt.Errorf("%w: the file grew past its %d bytes while it was read", ErrCorrupt, size)
	case errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF):
		if int64(n) != size {
			return nil, fmt.Errorf("%w: %d bytes read of the %d the file held when opened: it changed while it was read", ErrCorrupt, n, size)
		}
		return buf[:n], nil
	}
	return nil, err
}

// resolveRegular returns the path of the regular file that path is:
// path itself, or the target of a symbolic link resolving to a regular
// file inside root. Anything else is an error wrapping ErrCorrupt that
// says what path is instead; a path that does not exist is an error
// wrapping fs.ErrNotExist.
func resolveRegular(path, root string) (string, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return "", err
	}
	mode := fi.Mode()
	if mode.IsRegular() {
		return path, nil
	}
	if mode&fs.ModeSymlink == 0 {
		return "", fmt.Errorf("%w: not a regular file (%s)", ErrCorrupt, fileKind(mode))
	}
	link, _ := os.Readlink(path)
	// A link that does not resolve is damage, not a missing file: its
	// cause is quoted, not wrapped (it would read as fs.ErrNotExist).
	target, err := filepath.EvalSymlinks(path)
	if err != nil {
		return "", fmt.Errorf("%w: not a regular file (symbolic link to %s, which does not resolve: %s)", ErrCorrupt, link, err)
	}
	tfi, err := os.Stat(target)
	if err != nil {
		return "", fmt.Errorf("%w: not a regular file (symbolic link to %s: %s)", ErrCorrupt, target, err)
	}
	if !tfi.Mode().IsRegular() {
		return "", fmt.Errorf("%w: not a regular file (symbolic link to %s, a %s)", ErrCorrupt, target, fileKind(tfi.Mode()))
	}
	if !inside(root, target) {
		return "", fmt.Errorf("%w: not a regular file of the run (symbolic link to %s, outside the run directory %s)", ErrCorrupt, target, root)
	}
	return target, nil
}

// inside reports whether the resolved path target lies under root.
func inside(root, target string) bool {
	r, err := filepath.EvalSymlinks(root)
	if err != nil {
		return false
	}
	if r, err = filepath.Abs(r); err != nil {
		return false
	}
	t, err := filepath.Abs(target)
	if err != nil {
		return false
	}
	rel, err := filepath.Rel(r, t)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, ".."+string(filepath.Separator)) && !filepath.IsAbs(rel)
}

// fileKind names the type of a file that is not a regular file.
func fileKind(m fs.FileMode) string {
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

// layoutRunDir is the run directory of a snapshot file's path,
// DIR/run=<run>/topic=<t>/partition=<p>/<name>.
func layoutRunDir(path string) string {
	return filepath.Dir(filepath.Dir(filepath.Dir(path)))
}

// pathError is a run-level file's read error: the file named when the
// error does not name it already (ReadRegular's own errors do not).
func pathError(path string, err error) error {
	if errors.Is(err, ErrCorrupt) {
		return fmt.Errorf("snapshot file %s: %w", path, err)
	}
	return fmt.Errorf("snapshot: %w", err) // an *fs.PathError names it
}
