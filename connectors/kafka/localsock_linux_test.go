package kafka

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"
)

func TestLocalSocketName(t *testing.T) {
	tests := []struct {
		addr, want string
	}{
		{"127.0.0.1:9092", "@trajflow-kafka/127.0.0.1:9092"},
		{"localhost:9092", "@trajflow-kafka/127.0.0.1:9092"},
		{"127.0.0.2:19092", "@trajflow-kafka/127.0.0.2:19092"},
		{"[::1]:9092", "@trajflow-kafka/[::1]:9092"},
		{"10.0.0.7:9092", ""},        // another host's, or this host's outward address
		{"kafka-0.example:9092", ""}, // a name: not resolved
		{"127.0.0.1", ""},            // no port
		{"127.0.0.1:", ""},           // empty port
		{"", ""},
	}
	for _, tc := range tests {
		got, ok := LocalSocketName(tc.addr)
		if got != tc.want || ok != (tc.want != "") {
			t.Errorf("LocalSocketName(%q) = %q, %v; want %q", tc.addr, got, ok, tc.want)
		}
	}
}

// TestLocalSocketCarriesTheClients: an embedded broker on 127.0.0.1
// listens on its local socket too, the project's dials connect there (a
// connection that reports the broker's TCP address as its remote one), and
// kafka-go's writer and group reader and a franz-go client produce and
// consume through it.
func TestLocalSocketCarriesTheClients(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{})
	name, _ := LocalSocketName(b.Addr())
	if got := b.LocalSocket(); got != name || name == "" {
		t.Fatalf("LocalSocket() = %q, want %q", got, name)
	}
	ctx := testCtx(t, 30*time.Second)
	for label, dial := range map[string]func(context.Context, string, string) (net.Conn, error){"ProbingDial": ProbingDial, "Dial": Dial} {
		conn, err := dial(ctx, "tcp", b.Addr())
		if err != nil {
			t.Fatalf("%s: %v", label, err)
		}
		if _, ok := conn.(localConn); !ok || conn.RemoteAddr().String() != b.Addr() {
			t.Errorf("%s: %T to %s, want the local socket standing in for %s", label, conn, conn.RemoteAddr(), b.Addr())
		}
		conn.Close()
	}

	if err := CreateTopics(ctx, ClientConfig{}, []string{b.Addr()}, []TopicSpec{{Name: "local", Partitions: 1}}); err != nil {
		t.Fatal(err)
	}
	cc := ClientConfig{Brokers: []string{b.Addr()}}
	tr, err := cc.Transport()
	if err != nil {
		t.Fatal(err)
	}
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{Addr: kafkago.TCP(b.Addr()), Topic: "local", BatchTimeout: time.Millisecond, Transport: tr}
	if err := w.WriteMessages(ctx, kafkago.Message{Value: []byte("kafka-go")}); err != nil {
		t.Fatal(err)
	}
	w.Close()
	fc, err := kgo.NewClient(kgo.SeedBrokers(b.Addr()), kgo.Dialer(Dial), kgo.DefaultProduceTopic("local"))
	if err != nil {
		t.Fatal(err)
	}
	defer fc.Close()
	if err := fc.ProduceSync(ctx, &kgo.Record{Value: []byte("franz-go")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	d, err := cc.Dialer()
	if err != nil {
		t.Fatal(err)
	}
	r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: []string{b.Addr()}, GroupID: "local-g", Topic: "local",
		Dialer: d, MaxWait: 200 * time.Millisecond, StartOffset: kafkago.FirstOffset})
	defer r.Close()
	var got []string
	for range 2 {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			t.Fatalf("group reader over the local socket: %v", err)
		}
		got = append(got, string(m.Value))
		if err := r.CommitMessages(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	if strings.Join(got, ",") != "kafka-go,franz-go" {
		t.Fatalf("read %q", got)
	}
}

// TestTCPOnlyBroker: a broker started TCPOnly has no local socket, and the
// dials fall back to TCP; so do they for a broker with none (the closed
// broker's name is gone with its listener).
func TestTCPOnlyBroker(t *testing.T) {
	ctx := testCtx(t, 20*time.Second)
	b := startTestBroker(t, BrokerConfig{TCPOnly: true})
	if s := b.LocalSocket(); s != "" {
		t.Fatalf("LocalSocket() = %q with TCPOnly", s)
	}
	name, _ := LocalSocketName(b.Addr())
	if c, err := net.Dial("unix", name); err == nil {
		c.Close()
		t.Fatalf("%s answers beside a TCP-only broker", name)
	}
	conn, err := ProbingDial(ctx, "tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := conn.(*net.TCPConn); !ok {
		t.Errorf("ProbingDial to a TCP-only broker: %T, want *net.TCPConn", conn)
	}
	conn.Close()

	gone := startTestBroker(t, BrokerConfig{})
	addr := gone.Addr()
	if err := gone.Close(); err != nil {
		t.Fatal(err)
	}
	_, err = Dial(ctx, "tcp", addr)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("Dial of a closed broker %s: %v, want connection refused (over TCP, after the local socket)", addr, err)
	}
}

// TestLocalSocketTaken: a process holding the local socket name of the
// broker's address fails the broker's start with an error naming it: the
// host's clients would otherwise reach that process.
func TestLocalSocketTaken(t *testing.T) {
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := tcp.Addr().String()
	tcp.Close()
	name, _ := LocalSocketName(addr)
	squat, err := net.Listen("unix", name)
	if err != nil {
		t.Fatal(err)
	}
	defer squat.Close()
	b, err := StartBroker(testCtx(t, 10*time.Second), BrokerConfig{Addr: addr, Logger: testLogger(t)})
	if err == nil {
		b.Close()
		t.Fatalf("StartBroker on %s with %s taken: no error", addr, name)
	}
	if !strings.Contains(err.Error(), name) || !strings.Contains(err.Error(), "TCP only") {
		t.Fatalf("StartBroker with the local socket taken: %v, want an error naming %s and the way out", err, name)
	}
	// The address itself is free again: the failed start closed its TCP
	// listener.
	b = startTestBroker(t, BrokerConfig{Addr: addr, TCPOnly: true})
	if b.Addr() != addr {
		t.Fatalf("restarted on %s, want %s", b.Addr(), addr)
	}
}

// TestDualListenerClose: closing the listener ends Accept with
// net.ErrClosed and frees both the port and the name.
func TestDualListenerClose(t *testing.T) {
	ln, err := listenLocal("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l, ok := ln.(*dualListener)
	if !ok {
		t.Fatalf("listenLocal on 127.0.0.1: %T, want a dual listener", ln)
	}
	addr := l.Addr().String()
	name, _ := LocalSocketName(addr)
	accepted := make(chan net.Conn, 2)
	errc := make(chan error, 1)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				errc <- err
				return
			}
			accepted <- c
		}
	}()
	for _, d := range [][2]string{{"tcp", addr}, {"unix", name}} {
		c, err := net.Dial(d[0], d[1])
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		select {
		case a := <-accepted:
			if d[0] == "unix" && (a.RemoteAddr().String() != "127.0.0.1:0" || a.LocalAddr().String() != addr) {
				t.Errorf("accepted on %s: %s -> %s, want 127.0.0.1:0 -> %s", name, a.RemoteAddr(), a.LocalAddr(), addr)
			}
			a.Close()
		case <-time.After(5 * time.Second):
			t.Fatalf("no connection accepted from %s %s", d[0], d[1])
		}
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Accept after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Accept still blocked after Close")
	}
	for _, d := range [][2]string{{"tcp", addr}, {"unix", name}} {
		if c, err := net.Dial(d[0], d[1]); err == nil {
			c.Close()
			t.Errorf("%s %s still answers after Close", d[0], d[1])
		}
	}
}

// TestLocalSocketOfAnotherUser: another user binds the local socket name
// of a loopback address where Apache Kafka would listen (here a TCP-only
// embedded broker); the dials do not use that user's socket and reach the
// broker over TCP. Changing user needs root, as CI runs the tests.
func TestLocalSocketOfAnotherUser(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("starting a process as another user needs root")
	}
	b := startTestBroker(t, BrokerConfig{TCPOnly: true})
	name, _ := LocalSocketName(b.Addr())
	// This test binary binds it, copied where the other user may run it.
	dir, err := os.MkdirTemp("", "trajflow-squat-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	exe := filepath.Join(dir, "squat")
	if err := copyExecutable(exe); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), squatEnv+"="+name)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("squatter as uid 65534: %q, %v", line, err)
	}
	ctx := testCtx(t, 20*time.Second)
	for label, dial := range map[string]func(context.Context, string, string) (net.Conn, error){"ProbingDial": ProbingDial, "Dial": Dial} {
		conn, err := dial(ctx, "tcp", b.Addr())
		if err != nil {
			t.Fatalf("%s with another user on %s: %v", label, name, err)
		}
		if _, ok := conn.(*net.TCPConn); !ok {
			t.Errorf("%s with another user on %s: %T, want TCP to the broker", label, name, conn)
		}
		conn.Close()
	}
	// The same name bound by this user is used: the check is on the owner.
	own := startTestBroker(t, BrokerConfig{})
	conn, err := Dial(ctx, "tcp", own.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := conn.(localConn); !ok {
		t.Errorf("Dial of this user's broker: %T, want its local socket", conn)
	}
	conn.Close()
}

// squatEnv makes the test binary a process that binds the abstract socket
// name it holds, prints "ready" and holds what connects, answering
// nothing (TestLocalSocketOfAnotherUser).
const squatEnv = "TRAJFLOW_TEST_SQUAT_LOCAL_SOCKET"

func TestMain(m *testing.M) {
	if name := os.Getenv(squatEnv); name != "" {
		ln, err := net.Listen("unix", name)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		fmt.Println("ready")
		var held []net.Conn
		for {
			c, err := ln.Accept()
			if err != nil {
				os.Exit(0)
			}
			held = append(held, c)
		}
	}
	os.Exit(m.Run())
}

// copyExecutable copies the running test binary to path, executable by
// every user.
func copyExecutable(path string) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	b, err := os.ReadFile(self)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o755)
}
