package nettest

import (
	"io"
	"net"
	"testing"
	"time"
)

// TestGreeter: a connection gets the greeting and then nothing more (a
// read past it times out); without a greeting, nothing at all.
func TestGreeter(t *testing.T) {
	for _, greeting := range []string{"SSH-2.0-x\r\n", ""} {
		c, err := net.Dial("tcp", Greeter(t, []byte(greeting)))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		got := make([]byte, len(greeting))
		if _, err := io.ReadFull(c, got); err != nil || string(got) != greeting {
			t.Fatalf("greeting %q: read %q, %v", greeting, got, err)
		}
		_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
			t.Fatalf("greeting %q: read %d more bytes (%v), want a timeout", greeting, n, err)
		}
	}
}
