// Package nettest starts TCP servers that are not what a client expects,
// for tests of how clients fail. It imports only the standard library, so
// tests of any package (connectors/kafka and pipeline included) can use
// it.
package nettest

import (
	"net"
	"sync"
	"testing"
)

// Greeter listens on 127.0.0.1 until the test ends and returns its
// address. It writes greeting (nil: nothing) on each connection, then
// holds the connection open, reading and answering nothing: with nil, a
// server that accepts and never answers (a broker stopped with SIGSTOP);
// with a greeting, a server of another protocol that speaks first (SSH,
// ZeroMQ). The test's cleanup closes the listener and every connection.
func Greeter(t testing.TB, greeting []byte) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if len(greeting) > 0 {
				_, _ = c.Write(greeting)
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String()
}
