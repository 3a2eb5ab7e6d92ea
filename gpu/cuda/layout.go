package cuda

import (
	"errors"
	"fmt"
)

// Errors of this package; every error returned wraps one of them.
var (
	// ErrBatch: a packed batch cannot be staged (shapes, position ids,
	// masks, targets, token ids, capacity).
	ErrBatch = errors.New("cuda: bad batch")
	// ErrUnsupported: a behavior or model setting the device step does not
	// implement (grammar, top-k, top-p).
	ErrUnsupported = errors.New("cuda: unsupported")
	// ErrSmallBuffer: a staging buffer is smaller than the batch's Layout
	// (also wraps ErrBatch); grow it and stage again.
	ErrSmallBuffer = errors.New("cuda: staging buffer too small")
	// ErrDevice: a CUDA driver or cuBLAS call failed, or the kernels could
	// not be loaded.
	ErrDevice = errors.New("cuda: device error")
)

// Column names one per-position array of a staged batch. All rows of the
// batch are concatenated along positions (row r occupies positions
// [RowStart[r], RowStart[r+1]) of every column).
type Column int

// Columns of the staging buffer, in buffer order. 4-byte columns come
// first, the 1-byte mask last.
const (
	ColTokens    Column = iota // int32 input ids
	ColPositions               // int32 position ids (restart at 0 per segment)
	ColTargets                 // int32 next-token targets, -1 (objective.NoTarget) where none
	ColWeights                 // float32 normalization weight c_t (0 where unmasked), objective.Compute
	ColOld                     // float32 behavior log-probs
	ColRef                     // float32 reference log-probs (0 when the batch has none)
	ColAdv                     // float32 advantages
	ColMask                    // uint8 action mask
	numColumns
)

var columnNames = [numColumns]string{"tokens", "positions", "targets", "weights", "old", "ref", "adv", "mask"}

func (c Column) String() string {
	if c < 0 || c >= numColumns {
		return fmt.Sprintf("column(%d)", int(c))
	}
	return columnNames[c]
}

// elemSize is the byte width of one entry of c.
func (c Column) elemSize() int {
	if c == ColMask {
		return 1
	}
	return 4
}

// Align is the byte alignment of every column inside the staging buffer
// (and so of every device pointer derived from it): 256 bytes, the
// alignment of cuMemAlloc, which keeps loads coalesced.
const Align = 256

func alignUp(n, a int) int { return (n + a - 1) / a * a }

// Layout is the placement of the columns of a T-position batch inside one
// contiguous staging buffer. The same offsets are used on the host (pinned
// buffer) and on the device, so one copy moves the whole batch.
type Layout struct {
	T      int             // positions (all rows)
	Offset [numColumns]int // byte offset of each column
	Bytes  int             // total bytes used (a multiple of Align)
}

// PlanLayout returns the layout of a batch of T positions. It panics if T
// is negative.
func PlanLayout(T int) Layout {
	if T < 0 {
		panic(fmt.Sprintf("cuda: PlanLayout(%d)", T))
	}
	l := Layout{T: T}
	off := 0
	for c := Column(0); c < numColumns; c++ {
		l.Offset[c] = off
		off += alignUp(T*c.elemSize(), Align)
	}
	l.Bytes = off
	return l
}

// Span returns the byte range [start, end) of column c.
func (l Layout) Span(c Column) (start, end int) {
	return l.Offset[c], l.Offset[c] + l.T*c.elemSize()
}

// Capacity is the growth policy of reusable buffers: a buffer grows only
// when a batch needs more than it holds, and then to Need rounded up to
// Quantum and by at least Factor times its previous size, so a stream of
// batches of bounded size allocates O(log(max/first)) times and then never
// again (no per-batch allocation in steady state).
type Capacity struct {
	Quantum int     // bytes; a power of two (default 1 MiB)
	Factor  float64 // >= 1 (default 1.5)
}

// DefaultCapacity grows in 1 MiB steps by at least 1.5x.
func DefaultCapacity() Capacity { return Capacity{Quantum: 1 << 20, Factor: 1.5} }

// Grow returns the new capacity for a buffer of capacity have that must
// hold need bytes, and whether it must be reallocated (need > have).
func (c Capacity) Grow(have, need int) (int, bool) {
	if need <= have {
		return have, false
	}
	q := c.Quantum
	if q <= 0 {
		q = 1 << 20
	}
	f := c.Factor
	if f < 1 {
		f = 1
	}
	n := need
	if g := int(float64(have) * f); g > n {
		n = g
	}
	return alignUp(n, q), true
}
