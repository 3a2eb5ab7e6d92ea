package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/trajflow/trajflow/bench/peers"
	"github.com/trajflow/trajflow/bench/peers/zmqpeer"
)

// cmdBenchPeersZmq is `trajflow bench peers-zmq`: one run of the Go
// ZeroMQ peer of bench peers (the driver, which prints its report as one
// JSON line), or with --stage one of its stage processes; --impl picks the
// ZeroMQ implementation.
func cmdBenchPeersZmq(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("bench peers-zmq", stderr)
	var (
		corpus   = fs.String("corpus", "", "corpus file exported by trajflow bench peers --export-corpus")
		impl     = fs.String("impl", zmqpeer.ImplPure, "ZeroMQ implementation: zmq4 (pure Go) or libzmq (the C library through cgo, in a trajflow built with -tags libzmq)")
		trans    = fs.String("transport", peers.ZmqTCP, "ZeroMQ transport between the processes: tcp (127.0.0.1) or ipc (Unix sockets)")
		stage    = fs.String("stage", "", "run this stage process instead of the driver (bench peers starts them)")
		pull     = fs.String("pull", "", "with --stage: the address its PULL socket binds (tcp://127.0.0.1:PORT or ipc://@NAME)")
		push     = fs.String("push", "", "with --stage: the address its PUSH socket connects to")
		duration = fs.Duration("duration", 15*time.Second, "measurement window")
		warmup   = fs.Duration("warmup", 3*time.Second, "warm-up before the window")
		inflight = fs.Int("inflight-groups", 192, "groups sent and not yet acknowledged (closed loop)")
		kill     = fs.String("kill", "", "SIGKILL this stage's process once in the window and restart it")
		killAt   = fs.Duration("kill-at", 0, "when --kill strikes, into the window (0: half of --duration)")
		lossTO   = fs.Duration("loss-timeout", 5*time.Second, "a group in flight this long is presumed lost and its slot freed")
		drain    = fs.Duration("drain", 10*time.Second, "after the window, wait this long at most for the groups in flight")
	)
	if _, err := parseFlags(fs, args); err != nil {
		return err
	}
	if *corpus == "" {
		return fmt.Errorf("%w: bench peers-zmq: --corpus is required", errUsage)
	}
	if *impl != zmqpeer.ImplPure && *impl != zmqpeer.ImplLibzmq {
		return fmt.Errorf("%w: bench peers-zmq: --impl %q: want %s or %s", errUsage, *impl, zmqpeer.ImplPure, zmqpeer.ImplLibzmq)
	}
	if err := peers.CheckZmqTransport(*trans); err != nil {
		return fmt.Errorf("%w: bench peers-zmq: --transport %v", errUsage, err)
	}
	if err := zmqpeer.Available(*impl); err != nil {
		return fmt.Errorf("%w: bench peers-zmq: --impl %s: %v", errUsage, *impl, err)
	}
	if *stage != "" {
		if *pull == "" || *push == "" {
			return fmt.Errorf("%w: bench peers-zmq: --stage needs --pull and --push", errUsage)
		}
		return zmqpeer.RunStage(ctx, *impl, *stage, *corpus, *pull, *push)
	}
	bin, err := os.Executable()
	if err != nil {
		return err
	}
	rep, err := zmqpeer.Run(ctx, zmqpeer.Config{Binary: bin, Corpus: *corpus, Impl: *impl, Transport: *trans, Duration: *duration, Warmup: *warmup,
		InFlight: *inflight, Kill: *kill, KillAt: *killAt, LossTimeout: *lossTO, Drain: *drain})
	if err != nil {
		return err
	}
	b, err := json.Marshal(rep)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(stdout, "%s\n", b)
	return err
}
