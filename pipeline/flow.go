package pipeline

import (
	"context"
	"sync"
)

// flowControl bounds the records and bytes produced but not acknowledged.
// acquire blocks (backpressure reaches the fetch loop, so nothing queues
// without bound). A single request larger than the byte bound is admitted
// when nothing else is in flight, so it cannot deadlock.
type flowControl struct {
	mu       sync.Mutex
	cond     chan struct{} // closed and replaced on every release
	records  int
	bytes    int64
	maxRecs  int
	maxBytes int64
}

func newFlowControl(maxRecs int, maxBytes int64) *flowControl {
	return &flowControl{cond: make(chan struct{}), maxRecs: maxRecs, maxBytes: maxBytes}
}

func (f *flowControl) acquire(ctx context.Context, n int, b int64) error {
	for {
		f.mu.Lock()
		empty := f.records == 0
		if empty || (f.records+n <= f.maxRecs && f.bytes+b <= f.maxBytes) {
			f.records += n
			f.bytes += b
			f.mu.Unlock()
			return nil
		}
		wait := f.cond
		f.mu.Unlock()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-wait:
		}
	}
}

func (f *flowControl) release(n int, b int64) {
	f.mu.Lock()
	f.records -= n
	f.bytes -= b
	close(f.cond)
	f.cond = make(chan struct{})
	f.mu.Unlock()
}

func (f *flowControl) inFlight() (int, int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.records, f.bytes
}
