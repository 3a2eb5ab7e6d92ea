package zmqpeer

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/bench/peers"
)

// TestImplOf: the pure-Go implementation is the default; libzmq is there
// exactly when compiled in, and its absence is refused with the build
// command; an unknown name lists what there is.
func TestImplOf(t *testing.T) {
	if _, err := implOf(""); err != nil {
		t.Fatalf("default: %v", err)
	}
	_, err := implOf(ImplLibzmq)
	if LibzmqBuilt != (err == nil) {
		t.Fatalf("libzmq built %v, implOf: %v", LibzmqBuilt, err)
	}
	if err != nil && !strings.Contains(err.Error(), "go build -tags libzmq") {
		t.Fatalf("refusal does not say how to build it: %v", err)
	}
	if _, err := implOf("nanomsg"); err == nil || !strings.Contains(err.Error(), `"nanomsg" (have `+strings.Join(Impls(), ", ")) {
		t.Fatalf("unknown implementation: %v", err)
	}
	if got, want := SystemName(ImplLibzmq), "zeromq-libzmq"; got != want {
		t.Fatalf("SystemName(libzmq) = %q, want %q", got, want)
	}
}

// TestSocketsCarryFrames: on every implementation compiled in, a PUSH
// socket's multipart messages reach the PULL socket whole and in order,
// an empty frame and a 1 MiB one included, and a blocked receive ends when
// its context does.
func TestSocketsCarryFrames(t *testing.T) {
	for _, run := range transportRuns() {
		t.Run(run.name, func(t *testing.T) {
			im, _ := implOf(run.impl)
			addrs, err := freeAddrs(1, run.transport)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			pull, err := im.listen(ctx, addrs[0])
			if err != nil {
				t.Fatal(err)
			}
			defer pull.close()
			push, err := im.dial(ctx, addrs[0])
			if err != nil {
				t.Fatal(err)
			}
			defer push.close()
			big := bytes.Repeat([]byte{7}, 1<<20)
			sent := [][][]byte{
				{[]byte("header"), big},
				{[]byte("a"), {}, []byte("c")},
				{groupHeader{group: 3, sent: 42}.append(nil)},
			}
			for _, m := range sent {
				if err := push.send(m); err != nil {
					t.Fatal(err)
				}
			}
			for i, want := range sent {
				got, err := pull.recv()
				if err != nil {
					t.Fatalf("message %d: %v", i, err)
				}
				if len(got) != len(want) {
					t.Fatalf("message %d: %d frames, want %d", i, len(got), len(want))
				}
				for j := range want {
					if !bytes.Equal(got[j], want[j]) {
						t.Fatalf("message %d frame %d: %d bytes differ from the %d sent", i, j, len(got[j]), len(want[j]))
					}
				}
			}
			done := make(chan error, 1)
			go func() { _, err := pull.recv(); done <- err }()
			cancel()
			select {
			case err := <-done:
				if err == nil {
					t.Fatal("recv after the context ended returned a message")
				}
			case <-time.After(5 * time.Second):
				t.Fatal("recv still blocked 5 s after its context ended")
			}
		})
	}
}

// transportRuns is every implementation compiled in on every transport.
func transportRuns() []struct{ name, impl, transport string } {
	var runs []struct{ name, impl, transport string }
	for _, impl := range Impls() {
		for _, tr := range []string{peers.ZmqTCP, peers.ZmqIPC} {
			runs = append(runs, struct{ name, impl, transport string }{impl + "/" + tr, impl, tr})
		}
	}
	return runs
}
