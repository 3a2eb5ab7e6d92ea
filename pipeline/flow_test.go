package pipeline

import (
	"context"
	"testing"
	"time"
)

func TestFlowControlBlocksAtBounds(t *testing.T) {
	f := newFlowControl(3, 100)
	ctx := context.Background()
	if err := f.acquire(ctx, 2, 40); err != nil {
		t.Fatal(err)
	}
	// 2+2 records > 3: must block until a release.
	got := make(chan error, 1)
	go func() { got <- f.acquire(ctx, 2, 10) }()
	select {
	case err := <-got:
		t.Fatalf("acquire beyond the record bound returned %v without blocking", err)
	case <-time.After(50 * time.Millisecond):
	}
	f.release(2, 40)
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	if n, b := f.inFlight(); n != 2 || b != 10 {
		t.Fatalf("in flight = %d records %d bytes, want 2, 10", n, b)
	}
	// The byte bound blocks too, and a cancelled context unblocks.
	cctx, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
	defer cancel()
	if err := f.acquire(cctx, 1, 95); err == nil {
		t.Fatal("acquire beyond the byte bound did not block")
	}
	f.release(2, 10)
	// A single request larger than the byte bound passes when nothing is in flight.
	if err := f.acquire(ctx, 1, 1000); err != nil {
		t.Fatal(err)
	}
}
