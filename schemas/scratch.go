package schemas

import (
	"math/bits"
	"sync"
	"unsafe"
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

// The pools hold the start of each free buffer as an unsafe.Pointer (its
// length is the class size): a pointer goes into an interface without an
// allocation, where a slice would cost one per Free.

func (scratchAllocator) Allocate(size int) []byte {
	class := scratchClass(size)
	if p, ok := scratchPools[class].Get().(unsafe.Pointer); ok {
		return unsafe.Slice((*byte)(p), 1<<class)[:size]
	}
	// Allocated as uint64 words: aligned for any fixed-width view.
	words := make([]uint64, (1<<class)/8)
	return unsafeBytes(words)[:size]
}

func (scratchAllocator) Free(b []byte) {
	class := scratchClass(cap(b))
	if cap(b) == 1<<class {
		scratchPools[class].Put(unsafe.Pointer(unsafe.SliceData(b[:cap(b)])))
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
