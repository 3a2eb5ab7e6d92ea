package pipeline

import (
	"context"
	"testing"
	"time"
)

// TestFlowControlBlocksAtBounds checks both bounds, the release that
// unblocks, the context that gives up, and the time each acquire reports
// having waited: none when admitted at once, at least the time it was
// held otherwise (half the hold as a bound: the wait starts a little
// after the test's clock).
func TestFlowControlBlocksAtBounds(t *testing.T) {
	f := newFlowControl(3, 100)
	ctx := context.Background()
	if waited, err := f.acquire(ctx, 2, 40); err != nil || waited != 0 {
		t.Fatalf("acquire within the bounds: waited %v, %v", waited, err)
	}
	// 2+2 records > 3: must block until a release.
	type result struct {
		waited time.Duration
		err    error
	}
	got := make(chan result, 1)
	go func() { w, err := f.acquire(ctx, 2, 10); got <- result{w, err} }()
	const hold = 50 * time.Millisecond
	select {
	case r := <-got:
		t.Fatalf("acquire beyond the record bound returned %v without blocking", r.err)
	case <-time.After(hold):
	}
	f.release(2, 40)
	if r := <-got; r.err != nil || r.waited < hold/2 {
		t.Fatalf("acquire held %v by the record bound: waited %v, %v", hold, r.waited, r.err)
	}
	if n, b := f.inFlight(); n != 2 || b != 10 {
		t.Fatalf("in flight = %d records %d bytes, want 2, 10", n, b)
	}
	// The byte bound blocks too, and a cancelled context unblocks.
	const giveUp = 30 * time.Millisecond
	cctx, cancel := context.WithTimeout(ctx, giveUp)
	defer cancel()
	if waited, err := f.acquire(cctx, 1, 95); err == nil || waited < giveUp/2 {
		t.Fatalf("acquire beyond the byte bound: waited %v, %v; want a wait of %v ended by the context", waited, err, giveUp)
	}
	f.release(2, 10)
	// A single request larger than the byte bound passes when nothing is in flight.
	if waited, err := f.acquire(ctx, 1, 1000); err != nil || waited != 0 {
		t.Fatalf("a request over the byte bound with nothing in flight: waited %v, %v", waited, err)
	}
}
