package zmqpeer

import (
	"context"
	"fmt"
	"time"

	"github.com/go-zeromq/zmq4"
)

func init() {
	impls[ImplPure] = impl{dial: dialPure, listen: listenPure}
}

type purePush struct{ s zmq4.Socket }

func (p purePush) send(frames [][]byte) error { return p.s.SendMulti(zmq4.NewMsgFrom(frames...)) }
func (p purePush) close() error               { return p.s.Close() }

type purePull struct{ s zmq4.Socket }

func (p purePull) recv() ([][]byte, error) {
	m, err := p.s.Recv()
	return m.Frames, err
}
func (p purePull) close() error { return p.s.Close() }

// dialPure connects a PUSH socket to addr, reconnecting when the peer
// restarts; ctx's end closes its connections.
func dialPure(ctx context.Context, addr string) (pusher, error) {
	push := zmq4.NewPush(ctx, zmq4.WithAutomaticReconnect(true), zmq4.WithDialerMaxRetries(-1), zmq4.WithDialerRetry(50*time.Millisecond))
	if err := push.Dial(addr); err != nil {
		push.Close()
		return nil, fmt.Errorf("zmqpeer: dial %s: %w", addr, err)
	}
	return purePush{push}, nil
}

// listenPure binds a PULL socket to addr; ctx's end ends a blocked recv.
func listenPure(ctx context.Context, addr string) (puller, error) {
	pull := zmq4.NewPull(ctx)
	if err := pull.Listen(addr); err != nil {
		pull.Close()
		return nil, fmt.Errorf("zmqpeer: listen %s: %w", addr, err)
	}
	return purePull{pull}, nil
}
