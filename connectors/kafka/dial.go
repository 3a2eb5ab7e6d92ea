package kafka

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
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
// plaintext listeners (SASL included): it connects (as Dial does: to an
// embedded broker of this host through its local socket) and completes one
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
//
// A broker whose probe went unanswered is not probed again for
// HungBackoff: dials of it fail at once with ErrUnresponsive, so that
// kafka-go, which tries the bootstrap addresses in order and opens new
// connections on every rebalance and leader lookup, does not pay the
// probe's 2 s on each dial while the first listed broker hangs. After the
// backoff one dial probes it again (the others still fail at once until
// that probe is answered or times out); a broker that answers is
// forgotten. Refused connections are not remembered: they fail at once
// anyway, and a restarting broker is dialed as soon as it listens.
func ProbingDial(ctx context.Context, network, address string) (net.Conn, error) {
	if until, ok := hung.admit(address, clock()); !ok {
		return nil, fmt.Errorf("%s: %w (not probed again before %s)", address, ErrUnresponsive, until.Format("15:04:05.000"))
	}
	deadline, own := dialDeadline(ctx)
	conn, err := dialDeadlined(ctx, network, address, deadline)
	if err == nil {
		if err = probe(ctx, conn, deadline); err != nil {
			conn.Close()
			err = fmt.Errorf("%s did not answer ApiVersions: %w", address, err)
		}
	}
	switch {
	case err == nil:
		hung.answered(address)
		return conn, nil
	case own && ctx.Err() == nil && timedOut(err):
		hung.silent(address, clock())
	default:
		hung.release(address)
	}
	return nil, err
}

// HungBackoff is how long ProbingDial fails dials of an address at once
// after a probe of it went unanswered.
const HungBackoff = time.Second

// ErrUnresponsive is the error of a dial ProbingDial did not try: the
// address's last probe went unanswered less than HungBackoff ago. It is a
// net.Error that reports a timeout, as the unanswered probe did, so that
// callers retry it as they retry that.
var ErrUnresponsive net.Error = unresponsiveError{}

type unresponsiveError struct{}

func (unresponsiveError) Error() string   { return "broker did not answer its last probe" }
func (unresponsiveError) Timeout() bool   { return true }
func (unresponsiveError) Temporary() bool { return true }

// clock is time.Now; tests move it.
var clock = time.Now

// hung is the process's record of unresponsive broker addresses.
var hung = unresponsive{until: map[string]time.Time{}}

// unresponsive records, per address, until when dials of it fail at once.
type unresponsive struct {
	mu    sync.Mutex
	until map[string]time.Time
}

// admit reports whether a dial of address may go ahead at now; when it
// may and the address is recorded, this dial is the one that probes it
// again, and the others keep failing until it is done.
func (u *unresponsive) admit(address string, now time.Time) (time.Time, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	until, ok := u.until[address]
	if !ok {
		return time.Time{}, true
	}
	if now.Before(until) {
		return until, false
	}
	u.until[address] = now.Add(ProbeTimeout + HungBackoff)
	return time.Time{}, true
}

// silent records that address did not answer at now.
func (u *unresponsive) silent(address string, now time.Time) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.until[address] = now.Add(HungBackoff)
}

// answered forgets address: it served a probe.
func (u *unresponsive) answered(address string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	delete(u.until, address)
}

// release ends a re-probe that failed for another reason than silence
// (refused, reset, the caller's own deadline): the next dial may probe.
func (u *unresponsive) release(address string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if _, ok := u.until[address]; ok {
		u.until[address] = time.Time{}
	}
}

// timedOut reports whether err is a network timeout.
func timedOut(err error) bool {
	var ne net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

// ConnectDial is ProbingDial for TLS listeners: the TCP connection within
// ProbeTimeout and ctx, and no probe (kafka-go's TLS handshake that follows
// is bounded by the Dialer's Timeout).
func ConnectDial(ctx context.Context, network, address string) (net.Conn, error) {
	deadline, _ := dialDeadline(ctx)
	return (&net.Dialer{Deadline: deadline}).DialContext(ctx, network, address)
}

// dialDeadline is ProbeTimeout from now, or ctx's deadline when earlier;
// own reports the first.
func dialDeadline(ctx context.Context) (deadline time.Time, own bool) {
	deadline = time.Now().Add(ProbeTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		return dl, false
	}
	return deadline, true
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
		return fmt.Errorf("unexpected ApiVersions response (size %d, correlation id %#x): %w", size, got, ErrNotKafka)
	}
	if _, err := io.CopyN(io.Discard, conn, int64(size-4)); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return conn.SetDeadline(time.Time{})
}

// ErrNotKafka is the error of a probe answered with bytes that are not a
// Kafka response (another protocol's greeting, an HTTP reply): the
// address is wrong, and waiting does not change that answer. A server
// that accepts and never answers is not this error (it may be a hung
// broker): that is a timeout.
var ErrNotKafka = errors.New("the server answered, but not in the Kafka protocol")

// Refused reports whether err is the broker or the TLS handshake refusing
// this client's credentials or trust settings: a failed SASL
// authentication, a mechanism the broker does not enable, or a server
// certificate that does not verify against the configured CA or name.
// Waiting does not heal such an error, so callers that retry until a broker
// answers stop at once and report it.
func Refused(err error) bool {
	var ke kafkago.Error
	if errors.As(err, &ke) {
		switch ke {
		case kafkago.SASLAuthenticationFailed, kafkago.UnsupportedSASLMechanism, kafkago.IllegalSASLState,
			kafkago.ClusterAuthorizationFailed:
			return true
		}
	}
	var (
		verify   *tls.CertificateVerificationError
		unknown  x509.UnknownAuthorityError
		hostname x509.HostnameError
		invalid  x509.CertificateInvalidError
	)
	return errors.As(err, &verify) || errors.As(err, &unknown) || errors.As(err, &hostname) || errors.As(err, &invalid)
}
