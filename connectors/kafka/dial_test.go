package kafka

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/internal/nettest"
)

// closedAddr is a 127.0.0.1 address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// silentAddr accepts connections and never answers, like a broker stopped
// with SIGSTOP.
func silentAddr(t *testing.T) string {
	t.Helper()
	return nettest.Greeter(t, nil)
}

func TestDialFirstSkipsUnreachable(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{})
	closed, silent := closedAddr(t), silentAddr(t)
	d := &kafkago.Dialer{Timeout: 500 * time.Millisecond}
	ctx := testCtx(t, 10*time.Second)

	start := time.Now()
	conn, addr, err := DialFirst(ctx, d, []string{closed, silent, b.Addr()})
	if err != nil {
		t.Fatalf("DialFirst: %v", err)
	}
	took := time.Since(start)
	defer conn.Close()
	if addr != b.Addr() {
		t.Fatalf("reached %s, want the broker %s", addr, b.Addr())
	}
	// The silent address costs its bound, not the whole context.
	if took > 5*time.Second {
		t.Fatalf("DialFirst took %s with a 500ms bound per address", took)
	}
	// The connection works and has no deadline left from the probe.
	time.Sleep(600 * time.Millisecond)
	if _, err := conn.ApiVersions(); err != nil {
		t.Fatalf("ApiVersions on the returned connection: %v", err)
	}

	_, _, err = DialFirst(ctx, d, []string{closed, silent})
	if err == nil {
		t.Fatal("no broker reachable, want an error")
	}
	for _, a := range []string{closed, silent} {
		if !strings.Contains(err.Error(), a) {
			t.Errorf("error does not name %s: %v", a, err)
		}
	}
	t.Logf("all unreachable: %v", err)

	if _, _, err := DialFirst(ctx, d, nil); !errors.Is(err, ErrInvalidConfig) {
		t.Fatalf("no addresses: %v, want ErrInvalidConfig", err)
	}
}

// The admin paths bootstrap from any listed broker: the first address
// being down does not fail them.
func TestAdminFirstBrokerDown(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{})
	brokers := []string{closedAddr(t), b.Addr()}
	cc := ClientConfig{Brokers: brokers, DialTimeout: 2 * time.Second}
	ctx := testCtx(t, 20*time.Second)
	if err := CreateTopics(ctx, cc, nil, []TopicSpec{{Name: "first-down", Partitions: 2}}); err != nil {
		t.Fatalf("CreateTopics with the first broker down: %v", err)
	}
	topics, err := ListTopics(ctx, cc, nil)
	if err != nil || len(topics) != 1 || topics[0].Name != "first-down" || topics[0].Partitions != 2 {
		t.Fatalf("ListTopics = %+v, %v", topics, err)
	}
	// The broker's own answer (no such group) shows GroupGaps reached it.
	if _, err := GroupGaps(ctx, cc, nil, "g", "first-down"); !errors.Is(err, kafkago.GroupIdNotFound) {
		t.Fatalf("GroupGaps with the first broker down: %v, want the broker's GROUP_ID_NOT_FOUND", err)
	}
	bs, err := ListBrokers(ctx, cc, nil)
	if err != nil || len(bs) != 1 || bs[0].Addr != b.Addr() {
		t.Fatalf("ListBrokers = %+v, %v", bs, err)
	}
	cc.Brokers = brokers[:1]
	err = CreateTopics(ctx, cc, nil, []TopicSpec{{Name: "never"}})
	if err == nil || !strings.Contains(err.Error(), brokers[0]) {
		t.Fatalf("only a closed address: %v, want an error naming %s", err, brokers[0])
	}
}

// TestProbingDialSkipsHungBroker: kafka-go's group reader tries its
// bootstrap addresses in order and sends requests without deadlines; with
// the first address accepting connections but never answering (a broker
// stopped with SIGSTOP) it waits for that broker forever. With
// ProbingDial the dial fails within ProbeTimeout, the reader moves on to
// the next address and consumes.
func TestProbingDialSkipsHungBroker(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{})
	silent := silentAddr(t)
	ctx := testCtx(t, 30*time.Second)
	if err := CreateTopics(ctx, ClientConfig{}, []string{b.Addr()}, []TopicSpec{{Name: "probe", Partitions: 1}}); err != nil {
		t.Fatal(err)
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := ProbingDial(pctx, "tcp", silent); err == nil || pctx.Err() != nil {
		t.Fatalf("ProbingDial to a silent listener: %v (context %v), want its own timeout", err, pctx.Err())
	}
	d := &kafkago.Dialer{Timeout: 10 * time.Second, DialFunc: ProbingDial}
	conn, err := d.DialContext(ctx, "tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ApiVersions(); err != nil { // the probe left the stream in step
		t.Fatalf("ApiVersions after the probe: %v", err)
	}
	conn.Close()

	tr := &kafkago.Transport{Dial: ProbingDial}
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{Addr: kafkago.TCP(b.Addr()), Topic: "probe", BatchTimeout: time.Millisecond, Transport: tr}
	if err := w.WriteMessages(ctx, kafkago.Message{Value: []byte("through the second address")}); err != nil {
		t.Fatal(err)
	}
	w.Close()
	r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: []string{silent, b.Addr()}, GroupID: "probe-g", Topic: "probe",
		Dialer: d, MaxWait: 500 * time.Millisecond, StartOffset: kafkago.FirstOffset})
	defer r.Close()
	m, err := r.FetchMessage(ctx)
	if err != nil {
		t.Fatalf("group reader with the first broker hung: %v", err)
	}
	if string(m.Value) != "through the second address" {
		t.Fatalf("read %q", m.Value)
	}
}

// TestUnresponsiveAdmit: the record of unanswered probes, step by step at
// hand-set times (HungBackoff 1 s, ProbeTimeout 2 s).
func TestUnresponsiveAdmit(t *testing.T) {
	t0 := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	u := unresponsive{until: map[string]time.Time{}}
	steps := []struct {
		name  string
		do    func()
		ms    int
		admit bool
	}{
		{"unknown address dials", nil, 0, true},
		{"after an unanswered probe: fails at once", func() { u.silent("a", at(0)) }, 500, false},
		{"still within the backoff", nil, 999, false},
		{"backoff over: this dial probes again", nil, 1000, true},
		{"others fail while it probes", nil, 1500, false},
		{"and until its probe's time is up", nil, 3999, false},
		{"a probe that never reported frees the slot", nil, 4000, true},
		{"the re-probe was silent again", func() { u.silent("a", at(4100)) }, 4200, false},
		{"refused or reset: the next dial may probe", func() { u.release("a") }, 4300, true},
		{"answered: forgotten", func() { u.answered("a") }, 4400, true},
		{"forgotten stays forgotten", nil, 4401, true},
	}
	for _, s := range steps {
		if s.do != nil {
			s.do()
		}
		if _, got := u.admit("a", at(s.ms)); got != s.admit {
			t.Fatalf("%s (t=%d ms): admit %v, want %v", s.name, s.ms, got, s.admit)
		}
	}
	if _, ok := u.admit("b", at(500)); !ok {
		t.Fatal("another address is not affected")
	}
}

// TestProbingDialRemembersSilence: after a probe of a silent listener
// timed out, the next dial fails at once with ErrUnresponsive (a timeout
// the runtime retries); once the backoff is over the broker is probed
// again, and a broker that answers is forgotten.
func TestProbingDialRemembersSilence(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	silent := silentAddr(t)
	if _, err := ProbingDial(ctx, "tcp", silent); err == nil || errors.Is(err, ErrUnresponsive) {
		t.Fatalf("first dial of a silent listener: %v, want the probe's timeout", err)
	}
	_, err := ProbingDial(ctx, "tcp", silent)
	if !errors.Is(err, ErrUnresponsive) || !strings.Contains(err.Error(), silent) {
		t.Fatalf("second dial: %v, want ErrUnresponsive naming %s", err, silent)
	}
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("ErrUnresponsive is not a net.Error timeout: %v", err)
	}

	b := startTestBroker(t, BrokerConfig{})
	hung.silent(b.Addr(), time.Now())
	if _, err := ProbingDial(ctx, "tcp", b.Addr()); !errors.Is(err, ErrUnresponsive) {
		t.Fatalf("dial within the backoff: %v, want ErrUnresponsive", err)
	}
	defer func() { clock = time.Now }()
	clock = func() time.Time { return time.Now().Add(HungBackoff) }
	conn, err := ProbingDial(ctx, "tcp", b.Addr())
	if err != nil {
		t.Fatalf("dial after the backoff: %v", err)
	}
	conn.Close()
	clock = time.Now
	conn, err = ProbingDial(ctx, "tcp", b.Addr())
	if err != nil {
		t.Fatalf("an answering broker is not forgotten: %v", err)
	}
	conn.Close()
}

func TestRefused(t *testing.T) {
	cert := &x509.Certificate{}
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"sasl authentication", fmt.Errorf("dial 127.0.0.1:19093: %w", kafkago.SASLAuthenticationFailed), true},
		{"sasl mechanism", kafkago.UnsupportedSASLMechanism, true},
		{"unknown authority", &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{Cert: cert}}, true},
		{"hostname", fmt.Errorf("no broker answered: %w", errors.Join(errors.New("a"), x509.HostnameError{Certificate: cert, Host: "b"})), true},
		{"connection refused", syscall.ECONNREFUSED, false},
		{"leader moving", kafkago.NotLeaderForPartition, false},
		{"deadline", context.DeadlineExceeded, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := Refused(tc.err); got != tc.want {
				t.Errorf("Refused(%v) = %v, want %v", tc.err, got, tc.want)
			}
		})
	}
}

// TestOtherProtocolRefused: an address where a server of another
// protocol speaks first (a ZeroMQ socket, whose greeting begins 0xFF then
// eight bytes that, read as a Kafka response size, are negative; an SSH
// server's banner, 1.4 GB as a size) fails the dial with ErrNotKafka and an
// error naming the address, and a writer of the project's transport
// returns that error. kafka-go alone reads the ZeroMQ greeting's size and
// panics in its own goroutine.
func TestOtherProtocolRefused(t *testing.T) {
	zmtp := append([]byte{0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f}, make([]byte, 54)...)
	banner := []byte("SSH-2.0-OpenSSH_9.2p1\r\n")
	for name, greeting := range map[string][]byte{"zeromq": zmtp, "ssh": banner} {
		t.Run(name, func(t *testing.T) {
			addr := nettest.Greeter(t, greeting)
			ctx := testCtx(t, 20*time.Second)
			_, err := ProbingDial(ctx, "tcp", addr)
			if !errors.Is(err, ErrNotKafka) || !strings.Contains(err.Error(), addr) || !strings.Contains(err.Error(), "unexpected ApiVersions response") {
				t.Fatalf("ProbingDial to a %s server: %v, want an unexpected ApiVersions response from %s", name, err, addr)
			}
			cc := ClientConfig{Brokers: []string{addr}}
			tr, err := cc.Transport()
			if err != nil {
				t.Fatal(err)
			}
			defer tr.CloseIdleConnections()
			w := &kafkago.Writer{Addr: kafkago.TCP(addr), Topic: "t", BatchTimeout: time.Millisecond, MaxAttempts: 2, Transport: tr}
			defer w.Close()
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			err = w.WriteMessages(wctx, kafkago.Message{Value: []byte("x")})
			if err == nil || !strings.Contains(err.Error(), addr) {
				t.Fatalf("write through a %s server: %v, want an error naming %s", name, err, addr)
			}
		})
	}
}
