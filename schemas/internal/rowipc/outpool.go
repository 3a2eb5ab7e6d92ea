package rowipc

import (
	"math/bits"
	"sync"
)

// outPool recycles the output buffers of pooled encodes (Codec.Encode
// with pooled). A stage's outputs live from their encode until the broker
// acknowledges them (milliseconds) and come in a few sizes (a group's
// message, a packed batch of many MB), so a handful of free buffers per
// size class serves a steady stream without allocating and zeroing a
// fresh one per message. Unlike a
// sync.Pool, the free buffers survive garbage collections (a multi-MB
// batch buffer is needed only every few collections); their total is
// bounded by outPoolBytes.
type outPool struct {
	mu    sync.Mutex
	free  map[int][][]byte // class size -> free buffers
	bytes int              // total capacity of the free buffers
	limit int
}

const (
	minOutClass  = 64 << 10 // smaller outputs are allocated exactly
	outPoolBytes = 96 << 20
)

var outputs = &outPool{free: map[int][][]byte{}, limit: outPoolBytes}

// outClass rounds n up to the next size class: four classes per power of
// two (at most 25% unused capacity). Sizes below minOutClass have class 0.
func outClass(n int) int {
	if n < minOutClass {
		return 0
	}
	shift := bits.Len(uint(n-1)) - 3 // 2^shift = a quarter of the power of two below
	step := 1 << shift
	return (n + step - 1) &^ (step - 1)
}

// get returns a buffer of length 0 and capacity at least n; its bytes are
// not zeroed.
func (p *outPool) get(n int) []byte {
	c := outClass(n)
	if c == 0 {
		return make([]byte, 0, n)
	}
	p.mu.Lock()
	if fs := p.free[c]; len(fs) > 0 {
		b := fs[len(fs)-1]
		p.free[c] = fs[:len(fs)-1]
		p.bytes -= cap(b)
		p.mu.Unlock()
		return b[:0]
	}
	p.mu.Unlock()
	return make([]byte, 0, c)
}

// put keeps b for a later get, unless its capacity is not a class size or
// the pool already holds its limit.
func (p *outPool) put(b []byte) {
	c := cap(b)
	if c == 0 || outClass(c) != c {
		return
	}
	p.mu.Lock()
	if p.bytes+c <= p.limit {
		p.free[c] = append(p.free[c], b[:0])
		p.bytes += c
	}
	p.mu.Unlock()
}
