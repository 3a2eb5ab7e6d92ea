package offline

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestReadWhole: a regular file reads whole; a pipe reads to its end; a
// stream longer than the limit (a device that never ends) and a directory
// are refused, naming the path, without reading past the limit.
func TestReadWhole(t *testing.T) {
	dir := t.TempDir()
	data := bytes.Repeat([]byte("trajflow"), 1000)
	regular := filepath.Join(dir, "in.arrow")
	if err := os.WriteFile(regular, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := readWhole(regular, 10); err != nil || !bytes.Equal(b, data) {
		t.Errorf("regular file over the stream limit: %d bytes, %v; want all %d", len(b), err, len(data))
	}

	fifo := filepath.Join(dir, "pipe")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { // joined below
		f, err := os.OpenFile(fifo, os.O_WRONLY, 0)
		if err == nil {
			_, err = f.Write(data)
			f.Close()
		}
		done <- err
	}()
	b, err := readWhole(fifo, int64(len(data)))
	if werr := <-done; werr != nil {
		t.Fatal(werr)
	}
	if err != nil || !bytes.Equal(b, data) {
		t.Errorf("pipe within the limit: %d bytes, %v; want all %d", len(b), err, len(data))
	}

	for _, tc := range []struct{ path, want string }{
		{"/dev/zero", "not a regular file and longer than 4096 bytes"},
		{dir, "is a directory"},
	} {
		b, err := readWhole(tc.path, 4096)
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.path) {
			t.Errorf("readWhole(%s): %d bytes, %v; want an error naming it and %q", tc.path, len(b), err, tc.want)
		}
	}
}
