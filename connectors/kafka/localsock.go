package kafka

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"sync"
	"syscall"
	"time"
)

// Local sockets (docs/ARCHITECTURE.md "The embedded broker's local
// socket"): an embedded broker listening on a loopback address also
// listens on a Unix stream socket in Linux's abstract namespace named
// after that address (LocalSocketName), and Dial connects a client of the
// same host there instead of to the loopback TCP port. Both carry the
// same Kafka protocol; the socket skips the TCP/IP stack that loopback
// traffic crosses on every produce and fetch, which is a large part of the kernel's work per
// hop when the operators share a host with the broker (bench/RESULTS.md
// "The broker's local socket").
//
// An abstract name belongs to a network namespace, as 127.0.0.1 does, and
// goes away with its listener: no file is left behind, and a client in
// another namespace (a container with its own network) cannot reach it,
// as it cannot reach the host's 127.0.0.1. A client falls back to TCP when
// nothing listens on the name (a remote broker, Apache Kafka on this host,
// an embedded broker started with TCPOnly), and when the process that does
// runs as another user than the client (and not as root): any user of the
// namespace may bind a name, so a socket is only trusted as far as its
// owner (peerTrusted).

// localSocketPrefix starts the abstract socket name of a broker address.
const localSocketPrefix = "@trajflow-kafka/"

// LocalSocketName is the abstract Unix socket name beside the loopback
// TCP address addr ("@trajflow-kafka/127.0.0.1:9092"; localhost counts as
// 127.0.0.1), and false when addr is not a loopback host:port or the
// system has no abstract namespace (only Linux has one).
func LocalSocketName(addr string) (string, bool) {
	if runtime.GOOS != "linux" {
		return "", false
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil || port == "" {
		return "", false
	}
	if host == "localhost" {
		host = "127.0.0.1"
	}
	ip := net.ParseIP(host)
	if ip == nil || !ip.IsLoopback() {
		return "", false
	}
	return localSocketPrefix + net.JoinHostPort(ip.String(), port), true
}

// Dial connects to the Kafka broker at address: through its local socket
// when address is a loopback address and an embedded broker of this host
// listens there, else over network (TCP). It has the signature of
// franz-go's kgo.Dialer; kafka-go's dialers use it through ProbingDial.
// Its deadline is ctx's.
func Dial(ctx context.Context, network, address string) (net.Conn, error) {
	deadline, _ := ctx.Deadline()
	return dialDeadlined(ctx, network, address, deadline)
}

// dialDeadlined is Dial within deadline (zero: none).
func dialDeadlined(ctx context.Context, network, address string, deadline time.Time) (net.Conn, error) {
	d := &net.Dialer{Deadline: deadline}
	if name, ok := LocalSocketName(address); ok {
		c, err := d.DialContext(ctx, "unix", name)
		switch {
		case err == nil:
			trusted, err := peerTrusted(c)
			if err != nil {
				c.Close()
				return nil, fmt.Errorf("%s: local socket %s: %w", address, name, err)
			}
			if trusted {
				return localConn{c, tcpAddr(address)}, nil
			}
			c.Close() // another user's socket: TCP, as below
		case !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, syscall.ENOENT):
			return nil, fmt.Errorf("%s: local socket %s: %w", address, name, err)
		}
		// Nothing listens on the name (the broker is not an embedded one
		// of this host, or runs TCP only), or another user does.
	}
	return d.DialContext(ctx, network, address)
}

// localConn is a client's connection over a local socket. Its addresses
// are TCP ones, the broker's for RemoteAddr: clients parse them as
// host:port (kafka-go's Conn.Broker does).
type localConn struct {
	net.Conn
	remote net.Addr
}

// RemoteAddr is the broker's TCP address the connection stands in for.
func (c localConn) RemoteAddr() net.Addr { return c.remote }

// LocalAddr is 127.0.0.1 with no port.
func (c localConn) LocalAddr() net.Addr { return loopback }

// acceptedConn is the broker's side of a local-socket connection: its
// client reports as 127.0.0.1 with no port, as the broker's ACL checks and
// group descriptions read a host from it.
type acceptedConn struct {
	net.Conn
	local net.Addr
}

// RemoteAddr is 127.0.0.1 with no port.
func (c acceptedConn) RemoteAddr() net.Addr { return loopback }

// LocalAddr is the broker's TCP address.
func (c acceptedConn) LocalAddr() net.Addr { return c.local }

var loopback = &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)}

// tcpAddr is the host:port s (an IP address, or localhost) as a
// *net.TCPAddr; 127.0.0.1 when it is neither.
func tcpAddr(s string) net.Addr {
	if ap, err := net.ResolveTCPAddr("tcp", s); err == nil {
		return ap
	}
	return loopback
}

// dualListener accepts on a TCP listener and on the local socket beside
// it. Addr is the TCP address, the one the broker advertises.
type dualListener struct {
	tcp, unix net.Listener

	conns    chan net.Conn
	done     chan struct{} // closed by stop
	stopOnce sync.Once
	wg       sync.WaitGroup // the two accept loops
	err      error          // the first accept error; set before done closes
}

// listenLocal listens on the TCP address addr and, when it is a loopback
// address, on its local socket. A local socket already bound (by a
// process that is not this broker) fails the listen: the host's clients
// would reach that process instead of this broker.
func listenLocal(network, addr string) (net.Listener, error) {
	tcp, err := net.Listen(network, addr)
	if err != nil {
		return nil, err
	}
	name, ok := LocalSocketName(tcp.Addr().String())
	if !ok {
		return tcp, nil
	}
	unix, err := net.Listen("unix", name)
	if err != nil {
		tcp.Close()
		return nil, fmt.Errorf("local socket %s beside %s (start the broker with TCP only to do without it): %w", name, tcp.Addr(), err)
	}
	l := &dualListener{tcp: tcp, unix: unix, conns: make(chan net.Conn), done: make(chan struct{})}
	l.wg.Add(2)
	go l.accept(tcp, false) // owned by l: Close stops both loops and waits
	go l.accept(unix, true)
	return l, nil
}

// accept hands ln's connections to Accept until ln fails or l closes.
func (l *dualListener) accept(ln net.Listener, local bool) {
	defer l.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			l.stop(err)
			return
		}
		if local {
			c = acceptedConn{c, l.tcp.Addr()}
		}
		select {
		case l.conns <- c:
		case <-l.done:
			c.Close()
			return
		}
	}
}

// stop ends both accept loops; err is what Accept returns from now on.
func (l *dualListener) stop(err error) {
	l.stopOnce.Do(func() {
		l.err = err
		close(l.done)
		l.tcp.Close()
		l.unix.Close()
	})
}

// Accept returns the next connection of either listener, and an error
// once either fails or the listener is closed.
func (l *dualListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, l.err
	}
}

// Close closes both listeners and waits for their accept loops.
func (l *dualListener) Close() error {
	l.stop(net.ErrClosed)
	l.wg.Wait()
	return nil
}

// Addr is the TCP listener's address.
func (l *dualListener) Addr() net.Addr { return l.tcp.Addr() }
