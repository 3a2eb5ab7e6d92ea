package pipeline

import (
	"context"
	"sync"
	"time"
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

// acquire admits n records of b bytes, waiting while the bound is full;
// waited is how long it waited (0 when admitted at once), also when ctx
// ends the wait.
func (f *flowControl) acquire(ctx context.Context, n int, b int64) (waited time.Duration, err error) {
	var since time.Time
	for {
		f.mu.Lock()
		empty := f.records == 0
		if empty || (f.records+n <= f.maxRecs && f.bytes+b <= f.maxBytes) {
			f.records += n
			f.bytes += b
			f.mu.Unlock()
			return sinceOrZero(since), nil
		}
		wait := f.cond
		f.mu.Unlock()
		if since.IsZero() {
			since = time.Now()
		}
		select {
		case <-ctx.Done():
			return sinceOrZero(since), ctx.Err()
		case <-wait:
		}
	}
}

func sinceOrZero(t time.Time) time.Duration {
	if t.IsZero() {
		return 0
	}
	return time.Since(t)
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
