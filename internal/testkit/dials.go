package testkit

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"
)

// NoDials listens on addr (a broker's address, its broker closed) for d and
// fails t if anything of this process connects (on Linux; elsewhere
// anything): a kafka-go transport left open refreshes its metadata for
// the life of the process, dialing the address of a broker long gone.
// Whatever listens there next gets those connections, and a reply that
// is not Kafka's (a ZeroMQ greeting reads as a negative size) panics in
// kafka-go's own goroutine, where no caller can recover it. d must exceed
// the refresh interval of the transports checked (kafka-go's default 6 s,
// the project's connectors/kafka.MetadataTTL).
func NoDials(t testing.TB, addr string, d time.Duration) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listen on the closed broker's address %s: %v", addr, err)
	}
	accepted := make(chan []string)
	go func() {
		var from []string
		for {
			c, err := ln.Accept()
			if err != nil {
				accepted <- from
				return
			}
			here, err := dialedHere(c)
			switch {
			case err != nil:
				from = append(from, fmt.Sprintf("%s (whose: %v) %s", c.RemoteAddr(), err, requestOf(c)))
			case here:
				from = append(from, c.RemoteAddr().String()+" "+requestOf(c))
			default:
				t.Logf("NoDials: %s connected from another process %s", addr, requestOf(c))
			}
			c.Close()
		}
	}()
	time.Sleep(d)
	ln.Close()
	if from := <-accepted; len(from) > 0 {
		t.Fatalf("%d connections to %s in the %v after the run ended (from %v): a kafka-go transport was not closed", len(from), addr, d, from)
	}
}

// requestOf reads the head of the first Kafka request on c (within
// 500 ms) and names its API key and client id: who dialed.
func requestOf(c net.Conn) string {
	_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	var head [14]byte // size, api key, version, correlation id, client id length
	if _, err := io.ReadFull(c, head[:]); err != nil {
		return fmt.Sprintf("(no request: %v)", err)
	}
	key, n := binary.BigEndian.Uint16(head[4:]), int(int16(binary.BigEndian.Uint16(head[12:])))
	id := make([]byte, max(0, min(n, 256)))
	if _, err := io.ReadFull(c, id); err != nil {
		return fmt.Sprintf("(api key %d, client id unread: %v)", key, err)
	}
	return fmt.Sprintf("(api key %d, client id %q)", key, id)
}

// NoGoroutines fails t if a goroutine whose stack contains fn (a function
// name, "github.com/trajflow/trajflow/bench.(*run)") still runs: call it
// when the code that started them has returned, which must have waited
// for every goroutine it owns.
func NoGoroutines(t testing.TB, fn string) {
	t.Helper()
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var left []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, fn) {
			left = append(left, g)
		}
	}
	if len(left) > 0 {
		t.Fatalf("%d goroutines of %s still run after it returned:\n%s", len(left), fn, strings.Join(left, "\n\n"))
	}
}
