package schemas

import (
	"testing"

	"github.com/trajflow/trajflow/schemas/internal/rowipc"
)

// ipcEOS is the end-of-stream marker: continuation, zero-length metadata.
var ipcEOS = []byte{0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0}

// messageEnds are the offsets after the schema message and after each
// record batch of the stream b.
func messageEnds(t testing.TB, b []byte) []int {
	t.Helper()
	ends, err := rowipc.MessageEnds(b)
	if err != nil {
		t.Fatal(err)
	}
	return ends
}
