package kafka

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// fullAddr listens on 127.0.0.1 with the smallest accept queue, never
// accepts, and fills the queue: a hung broker whose kernel now drops new
// connection attempts (the state of a SIGSTOPped broker once clients have
// retried a few times).
func fullAddr(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
	for range 16 {
		c, err := net.DialTimeout("tcp", addr, 300*time.Millisecond)
		if err != nil {
			return addr // the queue is full: this attempt was dropped
		}
		t.Cleanup(func() { c.Close() })
	}
	t.Fatalf("%s: the accept queue never filled", addr)
	return ""
}

// TestDialsBoundTheConnection: a dial to a listener that drops connection
// attempts ends by its own bound (ProbeTimeout), not by the caller's
// context (the Dialer's 10 s Timeout): the probe alone starts only once
// connected.
func TestDialsBoundTheConnection(t *testing.T) {
	addr := fullAddr(t)
	for name, dial := range map[string]func(context.Context, string, string) (net.Conn, error){
		"ProbingDial": ProbingDial, "ConnectDial": ConnectDial,
	} {
		t.Run(name, func(t *testing.T) {
			// The caller's context has no deadline the dial could adopt as
			// its own; it is cancelled after four times the bound.
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var cancelled atomic.Bool
			stop := time.AfterFunc(4*ProbeTimeout, func() { cancelled.Store(true); cancel() })
			defer stop.Stop()
			c, err := dial(ctx, "tcp", addr)
			if err == nil {
				c.Close()
				t.Fatalf("%s connected to %s, whose accept queue is full", name, addr)
			}
			if cancelled.Load() {
				t.Fatalf("%s to %s ended only when the caller cancelled it: %v", name, addr, err)
			}
		})
	}
}
