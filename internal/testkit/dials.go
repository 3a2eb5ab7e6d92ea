package testkit

import (
	"net"
	"testing"
	"time"
)

// NoDials listens on addr (a broker's address, its broker closed) for d and
// fails t if anything connects: a kafka-go transport left open refreshes
// its metadata for the life of the process, dialing the address of a
// broker long gone. Whatever listens there next gets those connections,
// and a reply that is not Kafka's (a ZeroMQ greeting reads as a negative
// size) panics in kafka-go's own goroutine, where no caller can recover
// it. d must exceed the refresh interval of the transports checked
// (kafka-go's default 6 s, the project's connectors/kafka.MetadataTTL).
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
			from = append(from, c.RemoteAddr().String())
			c.Close()
		}
	}()
	time.Sleep(d)
	ln.Close()
	if from := <-accepted; len(from) > 0 {
		t.Fatalf("%d connections to %s in the %v after the run ended (from %v): a kafka-go transport was not closed", len(from), addr, d, from)
	}
}
