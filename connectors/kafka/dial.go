package kafka

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	kafkago "github.com/segmentio/kafka-go"
)

// DialFirst connects to the first address of addrs that answers, trying
// them in order, and returns the connection and the address it reached.
// An address answers when the connection (TCP, then TLS and SASL as d
// configures them) and one ApiVersions round trip complete within d.Timeout
// (DefaultDialTimeout when zero) and ctx: a broker that is down is skipped
// at once, one that accepts connections but does not serve (stopped with
// SIGSTOP, overloaded) after that bound. When none answers, the error joins
// every address's error, each naming its address.
//
// Use it wherever one connection to any broker of the cluster is needed
// (metadata, partition lists, admin bootstrap): dialing the first address
// of a list makes that broker a single point of failure.
func DialFirst(ctx context.Context, d *kafkago.Dialer, addrs []string) (*kafkago.Conn, string, error) {
	if len(addrs) == 0 {
		return nil, "", fmt.Errorf("%w: no broker addresses", ErrInvalidConfig)
	}
	if d == nil {
		d = &kafkago.Dialer{}
	}
	per := d.Timeout
	if per <= 0 {
		per = DefaultDialTimeout
	}
	errs := make([]error, 0, len(addrs))
	for _, a := range addrs {
		conn, err := dialOne(ctx, d, a, per)
		if err == nil {
			return conn, a, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", a, err))
	}
	return nil, "", fmt.Errorf("kafka: no broker answered (%d addresses): %w", len(addrs), errors.Join(errs...))
}

// dialOne connects to addr and checks that it answers ApiVersions, all
// within per and ctx.
func dialOne(ctx context.Context, d *kafkago.Dialer, addr string, per time.Duration) (*kafkago.Conn, error) {
	actx, cancel := context.WithTimeout(ctx, per)
	defer cancel()
	conn, err := d.DialContext(actx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	deadline, _ := actx.Deadline()
	if err := conn.SetDeadline(deadline); err != nil {
		conn.Close()
		return nil, err
	}
	// A cancelled ctx interrupts the round trip at once.
	stop := context.AfterFunc(actx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	_, err = conn.ApiVersions()
	if !stop() {
		conn.Close()
		if err == nil {
			err = actx.Err()
		}
		return nil, fmt.Errorf("api versions: %w (%w)", context.Cause(actx), err)
	}
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("api versions: %w", err)
	}
	if err := conn.SetDeadline(time.Time{}); err != nil {
		conn.Close()
		return nil, err
	}
	return conn, nil
}

// ProbeTimeout bounds ProbingDial's connection and ApiVersions round trip,
// and ConnectDial's connection.
const ProbeTimeout = 2 * time.Second

// ProbingDial is a kafka-go Dialer.DialFunc and Transport.Dial for
// plaintext listeners (SASL included): it connects and completes one
// ApiVersions round trip before it hands the connection over, all within
// ProbeTimeout and ctx (the Dialer's Timeout).
//
// kafka-go's reader and consumer group open connections through their
// Dialer and then send requests without a deadline (a partition's leader
// lookup, FindCoordinator, and JoinGroup bounded only by the group's
// timeouts), trying the bootstrap addresses in order. A broker that
// accepts connections but does not serve (stopped with SIGSTOP, hung)
// completes the TCP handshake in the kernel, so those requests wait for
// it: with the first listed broker hung, every reader of the operator
// stopped until the broker came back. With the probe such a dial fails
// and kafka-go moves on to the next address or retries.
//
// The connection itself is bounded too: once a hung broker's accept queue
// is full, the kernel drops new connection attempts and a dial waits out
// the Dialer's whole Timeout (10 s). Goroutine dumps of a fleet taken 9 s
// into a broker's SIGSTOP showed every operator's consumer group and
// partition readers in such dials.
func ProbingDial(ctx context.Context, network, address string) (net.Conn, error) {
	deadline := dialDeadline(ctx)
	conn, err := (&net.Dialer{Deadline: deadline}).DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	if err := probe(ctx, conn, deadline); err != nil {
		conn.Close()
		return nil, fmt.Errorf("%s did not answer ApiVersions: %w", address, err)
	}
	return conn, nil
}

// ConnectDial is ProbingDial for TLS listeners: the TCP connection within
// ProbeTimeout and ctx, and no probe (kafka-go's TLS handshake that follows
// is bounded by the Dialer's Timeout).
func ConnectDial(ctx context.Context, network, address string) (net.Conn, error) {
	return (&net.Dialer{Deadline: dialDeadline(ctx)}).DialContext(ctx, network, address)
}

// dialDeadline is ProbeTimeout from now, or ctx's deadline when earlier.
func dialDeadline(ctx context.Context) time.Time {
	deadline := time.Now().Add(ProbeTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	return deadline
}

// probe sends ApiVersions v0 (which every broker answers, if only to say
// which versions it supports) and reads the whole response.
func probe(ctx context.Context, conn net.Conn, deadline time.Time) error {
	if err := conn.SetDeadline(deadline); err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	const correlation = 0x7472666c // "trfl"
	clientID := "trajflow-probe"
	req := make([]byte, 0, 4+10+len(clientID))
	req = binary.BigEndian.AppendUint32(req, uint32(2+2+4+2+len(clientID)))
	req = binary.BigEndian.AppendUint16(req, 18) // ApiVersions
	req = binary.BigEndian.AppendUint16(req, 0)  // version 0
	req = binary.BigEndian.AppendUint32(req, correlation)
	req = binary.BigEndian.AppendUint16(req, uint16(len(clientID)))
	req = append(req, clientID...)
	if _, err := conn.Write(req); err != nil {
		return err
	}
	var head [8]byte
	if _, err := io.ReadFull(conn, head[:]); err != nil {
		return err
	}
	size := binary.BigEndian.Uint32(head[:4])
	if got := binary.BigEndian.Uint32(head[4:]); got != correlation || size < 4 || size > 1<<20 {
		return fmt.Errorf("unexpected ApiVersions response (size %d, correlation id %#x)", size, got)
	}
	if _, err := io.CopyN(io.Discard, conn, int64(size-4)); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return conn.SetDeadline(time.Time{})
}
