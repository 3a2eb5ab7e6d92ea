// Package zmqpeer is the Go ZeroMQ peer of `trajflow bench peers`: the
// same corpus bytes over the same hops (rollout → validate → reward →
// advantage → pack → trainer) as the other systems, one Go process per
// hop, PUSH/PULL sockets on 127.0.0.1, and the bytes carried as ZeroMQ
// frames with no serialization around them. It is what a Go team would
// build in memory instead of a durable log: nothing is written anywhere,
// so what a killed stage had received and not yet sent on is gone. The
// sockets are those of one of two implementations (socket.go): the pure-Go
// github.com/go-zeromq/zmq4, whose PUSH socket also drops what its
// upstream sends while the stage is down, or libzmq through
// github.com/pebbe/zmq4 (build tag libzmq), which queues that up to the
// high-water mark and loses only what was on the wire.
//
// Like the Python peers (bench/peers/README.md), the stages re-implement
// only the data movement: stage h answers group g with the corpus's hop
// h+1 messages of group g mod N, and pack emits the corpus's batch at the
// same count of groups (or after PackMaxWait).
//
// Frames: a group's message is a 16-byte header (group number, the
// rollout's send time in Unix nanoseconds, both little-endian) followed by
// one frame per hop message; a batch is a header frame (count, then count
// group headers) followed by the batch; the trainer's acknowledgement to
// the driver is its receive time and the batch's size followed by the
// batch's group headers, in one frame.
package zmqpeer

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/trajflow/trajflow/bench/peers"
)

// Roles are the stage processes in hop order; "trainer" acknowledges
// batches to the driver.
var Roles = []string{"validate", "reward", "advantage", "pack", "trainer"}

// PackMaxWait closes pack's window when no batch came due for this long
// after its first group (trajflow's bench window_max_wait).
const PackMaxWait = 2 * time.Second

// groupHeader is the 16-byte header of a group: its number and send time.
type groupHeader struct {
	group int64
	sent  int64
}

const headerSize = 16

func (h groupHeader) append(b []byte) []byte {
	b = binary.LittleEndian.AppendUint64(b, uint64(h.group))
	return binary.LittleEndian.AppendUint64(b, uint64(h.sent))
}

func readHeader(b []byte) (groupHeader, error) {
	if len(b) < headerSize {
		return groupHeader{}, fmt.Errorf("zmqpeer: group header of %d bytes, want %d", len(b), headerSize)
	}
	return groupHeader{group: int64(binary.LittleEndian.Uint64(b)), sent: int64(binary.LittleEndian.Uint64(b[8:]))}, nil
}

// readHeaders reads count group headers from b.
func readHeaders(b []byte, count int) ([]groupHeader, error) {
	if count < 0 || len(b) != count*headerSize {
		return nil, fmt.Errorf("zmqpeer: %d bytes of group headers, want %d", len(b), count*headerSize)
	}
	hs := make([]groupHeader, count)
	for i := range hs {
		hs[i], _ = readHeader(b[i*headerSize:])
	}
	return hs, nil
}

// receive hands every message of pull to out until ctx ends, then closes
// pull; it runs in its own goroutine, which the caller owns and ends by
// cancelling ctx.
func receive(ctx context.Context, pull puller, out chan<- [][]byte) {
	defer pull.close()
	for {
		m, err := pull.recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			continue // a peer's connection went away; the socket goes on
		}
		select {
		case out <- m:
		case <-ctx.Done():
			return
		}
	}
}

// next is the next message of in; ok is false once ctx has ended.
func next(ctx context.Context, in <-chan [][]byte) (m [][]byte, ok bool) {
	select {
	case <-ctx.Done():
		return m, false
	case m = <-in:
		return m, true
	}
}

// RunStage runs one stage process on the ZeroMQ implementation named
// (ImplPure or ImplLibzmq) until ctx ends: it pulls on pullAddr and pushes
// to pushAddr (the next stage, or the driver for the trainer). It reads
// from the corpus only what it sends.
func RunStage(ctx context.Context, implName, role, corpusPath, pullAddr, pushAddr string) error {
	im, err := implOf(implName)
	if err != nil {
		return err
	}
	idx := slices.Index(Roles, role)
	if idx < 0 {
		return fmt.Errorf("zmqpeer: no stage %q (have %v)", role, Roles)
	}
	var hops []int
	if idx < 3 {
		hops = []int{idx + 1}
	} else {
		hops = []int{} // pack sends batches, the trainer acknowledgements
	}
	cp, err := peers.ReadCorpusHops(corpusPath, hops, role == "pack")
	if err != nil {
		return err
	}
	if len(cp.Groups) == 0 {
		return errors.New("zmqpeer: the corpus holds no group")
	}
	var owned sync.WaitGroup // the receiving goroutine, ended by cancel
	defer owned.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pull, err := im.listen(ctx, pullAddr) // bound first: the upstream stage may be waiting for it
	if err != nil {
		return err
	}
	push, err := im.dial(ctx, pushAddr)
	if err != nil {
		pull.close()
		return err
	}
	defer push.close()
	in := make(chan [][]byte, 64)
	owned.Add(1)
	go func() { defer owned.Done(); receive(ctx, pull, in) }() // closes pull
	switch role {
	case "pack":
		return runPack(ctx, cp, in, push)
	case "trainer":
		return runTrainer(ctx, in, push)
	}
	n := int64(len(cp.Groups))
	for {
		m, ok := next(ctx, in)
		if !ok {
			return nil
		}
		if len(m) == 0 {
			continue
		}
		h, err := readHeader(m[0])
		if err != nil {
			return err
		}
		frames := append([][]byte{m[0]}, cp.Groups[h.group%n].Hops[idx+1]...)
		_ = push.send(frames) // a send to a dead peer is lost, as in any in-memory hop
	}
}

// runPack holds the groups of the open window and emits the corpus's
// batch when it comes due, or batch 0 after PackMaxWait.
func runPack(ctx context.Context, cp *peers.Corpus, in <-chan [][]byte, push pusher) error {
	var (
		packed  int64
		pending []byte // group headers of the open window
		count   int
		first   time.Time
	)
	emit := func(k int) {
		head := binary.LittleEndian.AppendUint32(nil, uint32(count))
		head = append(head, pending...)
		_ = push.send([][]byte{head, cp.Batches[k].Value})
		pending, count = pending[:0], 0
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			if count > 0 && time.Since(first) > PackMaxWait && len(cp.Batches) > 0 {
				emit(0)
			}
		case m := <-in:
			if len(m) == 0 {
				continue
			}
			h, err := readHeader(m[0])
			if err != nil {
				return err
			}
			packed++
			if count == 0 {
				first = time.Now()
			}
			pending = h.append(pending)
			count++
			if k := cp.BatchDue(packed); k >= 0 {
				emit(k)
			}
		}
	}
}

// runTrainer acknowledges every batch to the driver: receive time, size,
// and the batch's group headers.
func runTrainer(ctx context.Context, in <-chan [][]byte, push pusher) error {
	for {
		m, ok := next(ctx, in)
		if !ok {
			return nil
		}
		now := time.Now().UnixNano()
		if len(m) != 2 || len(m[0]) < 4 {
			return fmt.Errorf("zmqpeer: trainer: a batch of %d frames, want 2 (header, batch)", len(m))
		}
		count := int(binary.LittleEndian.Uint32(m[0]))
		if _, err := readHeaders(m[0][4:], count); err != nil {
			return err
		}
		ack := binary.LittleEndian.AppendUint64(nil, uint64(now))
		ack = binary.LittleEndian.AppendUint64(ack, uint64(len(m[1])))
		ack = append(ack, m[0][4:]...)
		_ = push.send([][]byte{ack})
	}
}
