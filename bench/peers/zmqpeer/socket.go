package zmqpeer

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/trajflow/trajflow/bench/peers"
)

// The ZeroMQ implementations a peer can run on.
const (
	// ImplPure is github.com/go-zeromq/zmq4, ZeroMQ written in Go: it
	// builds from the module proxy alone, and its PUSH socket drops a
	// message it has no connected peer for.
	ImplPure = peers.ZmqImplPure
	// ImplLibzmq is libzmq, the C library every other ZeroMQ binding
	// wraps, through github.com/pebbe/zmq4 (cgo). It is compiled in only
	// with the build tag libzmq and libzmq's headers (Debian:
	// libzmq3-dev); its PUSH socket queues up to the high-water mark while
	// its peer is away.
	ImplLibzmq = peers.ZmqImplLibzmq
)

// pusher sends multipart messages to the one PULL socket it connects to,
// reconnecting when that peer restarts.
type pusher interface {
	send(frames [][]byte) error
	close() error
}

// puller receives the multipart messages of every PUSH socket connected to
// the address it binds. recv returns an error once its context has ended.
// A puller is used by one goroutine, which closes it.
type puller interface {
	recv() ([][]byte, error)
	close() error
}

// impl opens the sockets of one ZeroMQ implementation; ctx bounds every
// blocking call of the sockets it opens.
type impl struct {
	dial   func(ctx context.Context, addr string) (pusher, error)
	listen func(ctx context.Context, addr string) (puller, error)
}

// impls holds the implementations compiled into this binary (socket_*.go).
var impls = map[string]impl{}

// Impls lists the implementations compiled into this binary.
func Impls() []string {
	names := make([]string, 0, len(impls))
	for n := range impls {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// SystemName is the peer's system name (bench peers --systems) on the
// implementation named.
func SystemName(name string) string {
	if name == ImplLibzmq {
		return peers.SysZeroMQLibzmq
	}
	return peers.SysZeroMQGo
}

// Available says whether the implementation named is compiled into this
// binary, and if not why (how to build it in, or which there are).
func Available(name string) error {
	_, err := implOf(name)
	return err
}

func implOf(name string) (impl, error) {
	if name == "" {
		name = ImplPure
	}
	im, ok := impls[name]
	if ok {
		return im, nil
	}
	if name == ImplLibzmq {
		return impl{}, fmt.Errorf("zmqpeer: this trajflow was built without libzmq: build it with `go build -tags libzmq` (needs cgo and libzmq's headers, Debian's libzmq3-dev)")
	}
	return impl{}, fmt.Errorf("zmqpeer: no ZeroMQ implementation %q (have %s)", name, strings.Join(Impls(), ", "))
}
