package parquet

import (
	"errors"
	"strings"
	"testing"
)

// TestReadRegularReadsItsSize: a file is read no further than the size it
// had when opened. /proc files are regular files of size 0 that hold
// text: read to their end, like a file growing while it is read.
func TestReadRegularReadsItsSize(t *testing.T) {
	const path = "/proc/self/status"
	_, err := ReadRegular(path, "/proc", MaxFileBytes)
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "grew past its 0 bytes") {
		t.Errorf("ReadRegular(%s) = %v, want it refused as grown past its size", path, err)
	}
}
