package schemas

import (
	"math/bits"
	"sync"
)

// scratchAllocator serves the Arrow buffers that Encode builds and releases
// before it returns. Buffers are recycled through size-class pools, so a
// steady stream of encodes does not allocate (and zero) fresh memory for
// every intermediate column. Memory handed out is not zeroed; the column
// builders write every byte they use.
type scratchAllocator struct{}

const minScratchClass = 6 // 64 bytes

var scratchPools [64]sync.Pool

func scratchClass(size int) int {
	if size <= 1<<minScratchClass {
		return minScratchClass
	}
	return bits.Len(uint(size - 1))
}

func (scratchAllocator) Allocate(size int) []byte {
	class := scratchClass(size)
	if p, ok := scratchPools[class].Get().(*[]byte); ok {
		return (*p)[:size]
	}
	// Allocated as uint64 words: aligned for any fixed-width view.
	words := make([]uint64, (1<<class)/8)
	return unsafeBytes(words)[:size]
}

func (scratchAllocator) Free(b []byte) {
	class := scratchClass(cap(b))
	if cap(b) == 1<<class {
		b = b[:cap(b)]
		scratchPools[class].Put(&b)
	}
}

func (a scratchAllocator) Reallocate(size int, b []byte) []byte {
	if size <= cap(b) {
		return b[:size]
	}
	nb := a.Allocate(size)
	copy(nb, b)
	a.Free(b)
	return nb
}
