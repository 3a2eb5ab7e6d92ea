package kafka

import (
	"context"
	"errors"
	"fmt"
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
