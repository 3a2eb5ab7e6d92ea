package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
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
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if err := noArgs("bench peers-zmq", pos); err != nil {
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
	if err := checkInFile("--corpus", *corpus); err != nil {
		return err
	}
	if *stage != "" {
		if *pull == "" || *push == "" {
			return fmt.Errorf("%w: bench peers-zmq: --stage needs --pull and --push", errUsage)
		}
		if !slices.Contains(zmqpeer.Roles, *stage) {
			return fmt.Errorf("%w: bench peers-zmq: --stage %q: want one of %s", errUsage, *stage, strings.Join(zmqpeer.Roles, ", "))
		}
		if err := onlyFlags(fs, "--stage runs one stage process (bench peers starts them)", "stage", "impl", "corpus", "pull", "push", "transport"); err != nil {
			return err
		}
		return zmqpeer.RunStage(ctx, *impl, *stage, *corpus, *pull, *push)
	}
	if err := onlyWith(fs, false, "goes with --stage", "pull", "push"); err != nil {
		return err
	}
	if err := checkZmqDriver(fs, *duration, *warmup, *inflight, *kill, *killAt, *lossTO, *drain); err != nil {
		return err
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

// checkZmqDriver refuses the driver's flag values that mean nothing.
func checkZmqDriver(fs *flag.FlagSet, duration, warmup time.Duration, inflight int, kill string, killAt, lossTO, drain time.Duration) error {
	if kill != "" && !slices.Contains(zmqpeer.Roles, kill) {
		return fmt.Errorf("%w: bench peers-zmq: --kill %q: want one of %s", errUsage, kill, strings.Join(zmqpeer.Roles, ", "))
	}
	if err := onlyWith(fs, kill != "", "needs --kill", "kill-at"); err != nil {
		return err
	}
	return firstBad(
		flagCheck{duration <= 0, fmt.Sprintf("--duration %v: want a positive window", duration)},
		flagCheck{warmup < 0, fmt.Sprintf("--warmup %v: want 0 or more", warmup)},
		flagCheck{inflight < 1, fmt.Sprintf("--inflight-groups %d: want 1 or more", inflight)},
		flagCheck{killAt < 0 || (killAt > 0 && killAt >= duration), fmt.Sprintf("--kill-at %v: want 0 (half of --duration) or a time inside --duration %v", killAt, duration)},
		flagCheck{lossTO <= 0, fmt.Sprintf("--loss-timeout %v: want a positive duration", lossTO)},
		flagCheck{drain <= 0, fmt.Sprintf("--drain %v: want a positive duration", drain)},
	)
}
