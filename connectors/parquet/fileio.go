package parquet

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/trajflow/trajflow/internal/regfile"
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
	b, err := regfile.Read(target, limit)
	var bad *regfile.Error
	if errors.As(err, &bad) {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return b, err
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
		return "", fmt.Errorf("%w: not a regular file (%s)", ErrCorrupt, regfile.Kind(mode))
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
		return "", fmt.Errorf("%w: not a regular file (symbolic link to %s, a %s)", ErrCorrupt, target, regfile.Kind(tfi.Mode()))
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
