//go:build libzmq

package zmqpeer

import (
	"context"
	"fmt"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// LibzmqBuilt reports whether libzmq is compiled into this binary.
const LibzmqBuilt = true

func init() {
	impls[ImplLibzmq] = impl{dial: dialLibzmq, listen: listenLibzmq}
}

// pollEvery bounds how long a blocked send or receive goes without looking
// at its context: libzmq's calls take no Go context, so they time out
// (ZMQ_SNDTIMEO, ZMQ_RCVTIMEO) and are tried again while ctx lives.
const pollEvery = 100 * time.Millisecond

// again reports whether err is a libzmq call's timeout or an interrupted
// system call, after which the call is tried again.
func again(err error) bool {
	e := zmq.AsErrno(err)
	return e == zmq.Errno(syscall.EAGAIN) || e == zmq.Errno(syscall.EINTR)
}

type libzmqSocket struct {
	ctx context.Context
	s   *zmq.Socket
}

func (l libzmqSocket) close() error { return l.s.Close() }

func (l libzmqSocket) send(frames [][]byte) error {
	for {
		_, err := l.s.SendMessage(frames)
		if err == nil || !again(err) {
			return err
		}
		if l.ctx.Err() != nil {
			return fmt.Errorf("zmqpeer: send: %w", l.ctx.Err())
		}
	}
}

func (l libzmqSocket) recv() ([][]byte, error) {
	for {
		frames, err := l.s.RecvMessageBytes(0)
		if err == nil || !again(err) {
			return frames, err
		}
		if l.ctx.Err() != nil {
			return nil, fmt.Errorf("zmqpeer: receive: %w", l.ctx.Err())
		}
	}
}

// open makes a socket of type t with the options every peer socket has: no
// linger on close (a stage's queue dies with it, as in a crash), sends and
// receives that time out every pollEvery, reconnection every 50 ms.
func open(t zmq.Type) (*zmq.Socket, error) {
	s, err := zmq.NewSocket(t)
	if err != nil {
		return nil, fmt.Errorf("zmqpeer: libzmq socket: %w", err)
	}
	for _, set := range []func() error{
		func() error { return s.SetLinger(0) },
		func() error { return s.SetSndtimeo(pollEvery) },
		func() error { return s.SetRcvtimeo(pollEvery) },
		func() error { return s.SetReconnectIvl(50 * time.Millisecond) },
	} {
		if err := set(); err != nil {
			s.Close()
			return nil, fmt.Errorf("zmqpeer: libzmq socket option: %w", err)
		}
	}
	return s, nil
}

// dialLibzmq connects a PUSH socket to addr. libzmq queues what is sent
// while the peer is away (up to the default high-water mark, 1000
// messages) and reconnects on its own.
func dialLibzmq(ctx context.Context, addr string) (pusher, error) {
	s, err := open(zmq.PUSH)
	if err != nil {
		return nil, err
	}
	if err := s.Connect(addr); err != nil {
		s.Close()
		return nil, fmt.Errorf("zmqpeer: connect %s: %w", addr, err)
	}
	return libzmqSocket{ctx: ctx, s: s}, nil
}

// listenLibzmq binds a PULL socket to addr.
func listenLibzmq(ctx context.Context, addr string) (puller, error) {
	s, err := open(zmq.PULL)
	if err != nil {
		return nil, err
	}
	if err := s.Bind(addr); err != nil {
		s.Close()
		return nil, fmt.Errorf("zmqpeer: bind %s: %w", addr, err)
	}
	return libzmqSocket{ctx: ctx, s: s}, nil
}
