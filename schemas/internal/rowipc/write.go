package rowipc

import (
	"encoding/binary"
	"fmt"
	"math"
	"sync"
	"unsafe"

	"github.com/apache/arrow-go/v18/arrow/bitutil"
	flatbuffers "github.com/google/flatbuffers/go"
)

// This file writes the record batch message of a codec's rows straight
// from the Go values into the output stream: no intermediate Arrow arrays,
// no second copy of the column values. The bytes are the ones ToRecord
// followed by Arrow's IPC writer produce (asserted by the round-trip tests
// and fuzz targets here and, for every record kind, in schemas): the same
// depth-first field nodes and buffers, each buffer padded to 8 bytes, and
// the flatbuffer metadata built in the same order. Columns are laid out in a first pass (node lengths, buffer
// sizes), so the output is allocated once at its exact size and each value
// is copied once, in a second pass.

// ipcWriter carries one direct encode: in the layout pass it records the
// field nodes and buffer sizes, in the write pass it hands out each
// buffer's place in the body.
type ipcWriter struct {
	writing bool
	nodes   []int64 // length, null count per field node
	lens    []int   // buffer sizes
	offs    []int   // buffer offsets in the body (write pass)
	next    int     // next buffer (write pass)
	body    []byte
	elems   [][]unsafe.Pointer // kindList elements, in traversal order
	nextEl  int
	err     error
}

var ipcWriters = sync.Pool{New: func() any { return &ipcWriter{} }}

func (w *ipcWriter) reset() {
	w.writing, w.nodes, w.lens, w.offs, w.next, w.body = false, w.nodes[:0], w.lens[:0], w.offs[:0], 0, nil
	clear(w.elems)
	w.elems, w.nextEl, w.err = w.elems[:0], 0, nil
}

func (w *ipcWriter) node(n, nulls int) {
	if !w.writing {
		w.nodes = append(w.nodes, int64(n), int64(nulls))
	}
}

// buf reserves the next buffer, of n bytes, in the layout pass (nil) and
// returns its place in the body in the write pass.
func (w *ipcWriter) buf(n int) []byte {
	if !w.writing {
		w.lens = append(w.lens, n)
		return nil
	}
	off := w.offs[w.next]
	w.next++
	return w.body[off : off+n : off+n]
}

// offsets writes the n+1 offsets of a list or string column from the
// length of each row and returns the total.
func (w *ipcWriter) offsets(n int, size func(i int) int) int {
	dst := w.buf((n + 1) * 4)
	total := 0
	for i := range n {
		total += size(i)
		if dst != nil {
			binary.LittleEndian.PutUint32(dst[(i+1)*4:], uint32(total))
		}
	}
	if dst != nil {
		binary.LittleEndian.PutUint32(dst, 0)
	}
	if total > math.MaxInt32 && w.err == nil {
		w.err = fmt.Errorf("schemas: more than %d values in one column", math.MaxInt32)
	}
	return total
}

// emit lays out or writes column c over n rows (see col.build, whose
// arrays Arrow's writer would serialize to the same buffers).
func (c *col) emit(w *ipcWriter, n int, row at) {
	ptr := func(i int) unsafe.Pointer { return unsafe.Add(row(i), c.off) }
	switch c.kind {
	case kindFixed:
		w.node(n, 0)
		w.buf(0) // no validity bitmap
		if dst := w.buf(n * c.width); dst != nil {
			for i := range n {
				copy(dst[i*c.width:], rawBytes(ptr(i), c.width))
			}
		}
	case kindBool:
		w.node(n, 0)
		w.buf(0)
		if dst := w.buf(int(bitutil.BytesForBits(int64(n)))); dst != nil {
			clear(dst)
			for i := range n {
				if *(*bool)(ptr(i)) {
					bitutil.SetBit(dst, i)
				}
			}
		}
	case kindString:
		w.node(n, 0)
		w.buf(0)
		total := w.offsets(n, func(i int) int { return len(*(*string)(ptr(i))) })
		if dst := w.buf(total); dst != nil {
			pos := 0
			for i := 0; i < n && total > 0; i++ {
				pos += copy(dst[pos:], *(*string)(ptr(i)))
			}
		}
	case kindFixedList:
		nulls := 0
		if c.nullable {
			for i := range n {
				if (*sliceHeader)(ptr(i)).data == nil {
					nulls++
				}
			}
		}
		w.node(n, nulls)
		if nulls == 0 {
			w.buf(0)
		} else if dst := w.buf(int(bitutil.BytesForBits(int64(n)))); dst != nil {
			clear(dst) // the bits past n too: the output may be a reused buffer
			bitutil.SetBitsTo(dst, 0, int64(n), true)
			for i := range n {
				if (*sliceHeader)(ptr(i)).data == nil {
					bitutil.ClearBit(dst, i)
				}
			}
		}
		total := w.offsets(n, func(i int) int { return (*sliceHeader)(ptr(i)).len })
		w.node(total, 0)
		w.buf(0)
		if dst := w.buf(total * c.width); dst != nil {
			pos := 0
			for i := range n {
				if s := (*sliceHeader)(ptr(i)); s.len > 0 {
					pos += copy(dst[pos:], rawBytes(s.data, s.len*c.width))
				}
			}
		}
	case kindList:
		w.node(n, 0)
		w.buf(0)
		total := w.offsets(n, func(i int) int { return (*sliceHeader)(ptr(i)).len })
		var elems []unsafe.Pointer
		if w.writing {
			elems = w.elems[w.nextEl]
			w.nextEl++
		} else {
			elems = make([]unsafe.Pointer, 0, total)
			for i := 0; i < n && total > 0 && w.err == nil; i++ {
				s := (*sliceHeader)(ptr(i))
				for k := range s.len {
					elems = append(elems, unsafe.Add(s.data, uintptr(k)*c.elemSize))
				}
			}
			w.elems = append(w.elems, elems)
		}
		c.elem.emit(w, len(elems), func(k int) unsafe.Pointer { return elems[k] })
	case kindStruct:
		w.node(n, 0)
		w.buf(0)
		for j := range c.fields {
			c.fields[j].emit(w, n, ptr)
		}
	default:
		panic("rowipc: unknown column kind")
	}
}

// ipcMetadataV5 is MetadataVersion.V5 (Schema.fbs).
const ipcMetadataV5 = 4

// recordBatchMeta builds the flatbuffer of a RecordBatch message in the
// order Arrow's writer builds it (nodes, buffers, RecordBatch, Message).
func recordBatchMeta(b *flatbuffers.Builder, length int64, nodes []int64, offs, lens []int, bodyLen int) []byte {
	b.Reset()
	nn := len(nodes) / 2
	b.StartVector(16, nn, 8)
	for i := nn - 1; i >= 0; i-- {
		b.Prep(8, 16)
		b.PrependInt64(nodes[2*i+1])
		b.PrependInt64(nodes[2*i])
	}
	nodesVec := b.EndVector(nn)
	b.StartVector(16, len(lens), 8)
	for i := len(lens) - 1; i >= 0; i-- {
		b.Prep(8, 16)
		b.PrependInt64(int64(lens[i]))
		b.PrependInt64(int64(offs[i]))
	}
	bufsVec := b.EndVector(len(lens))
	b.StartObject(5) // RecordBatch
	b.PrependInt64Slot(0, length, 0)
	b.PrependUOffsetTSlot(1, nodesVec, 0)
	b.PrependUOffsetTSlot(2, bufsVec, 0)
	rb := b.EndObject()
	b.StartObject(5) // Message
	b.PrependInt16Slot(0, ipcMetadataV5, 0)
	b.PrependByteSlot(1, msgRecordBatch, 0)
	b.PrependUOffsetTSlot(2, rb, 0)
	b.PrependInt64Slot(3, int64(bodyLen), 0)
	b.PrependUOffsetTSlot(4, 0, 0) // no custom metadata
	b.Finish(b.EndObject())
	return b.FinishedBytes()
}

var metaBuilders = sync.Pool{New: func() any { return flatbuffers.NewBuilder(1024) }}

// writeRows encodes rows of cols as one IPC stream: frame (the schema
// message), the record batch message, the end-of-stream marker. With
// pooled the output comes from the output pool and release returns it.
func writeRows(frame []byte, cols []col, n int, row at, pooled bool) ([]byte, func(), error) {
	w := ipcWriters.Get().(*ipcWriter)
	defer func() { w.reset(); ipcWriters.Put(w) }()
	for i := range cols {
		cols[i].emit(w, n, row)
	}
	if w.err != nil {
		return nil, nil, w.err
	}
	body := 0
	for _, l := range w.lens {
		w.offs = append(w.offs, body)
		body += (l + 7) &^ 7
	}
	fb := metaBuilders.Get().(*flatbuffers.Builder)
	defer metaBuilders.Put(fb)
	meta := recordBatchMeta(fb, int64(n), w.nodes, w.offs, w.lens, body)
	msg := (8 + len(meta) + 7) &^ 7 // continuation, size, flatbuffer, padding
	size := len(frame) + msg + body + len(ipcEOS)

	var out []byte
	if pooled {
		out = outputs.get(size)[:size]
	} else {
		out = make([]byte, size)
	}
	p := copy(out, frame)
	binary.LittleEndian.PutUint32(out[p:], ipcContinuation)
	binary.LittleEndian.PutUint32(out[p+4:], uint32(msg-8))
	clear(out[p+8+copy(out[p+8:], meta) : p+msg])
	p += msg
	w.writing, w.body = true, out[p:p+body]
	for i := range cols {
		cols[i].emit(w, n, row)
	}
	for i, l := range w.lens { // zero padding (a pooled buffer is not zeroed)
		clear(w.body[w.offs[i]+l : w.offs[i]+(l+7)&^7])
	}
	copy(out[p+body:], ipcEOS)
	release := func() {}
	if pooled {
		buf := out
		release = func() { // a second call must not hand the buffer out twice
			if buf != nil {
				outputs.put(buf)
				buf = nil
			}
		}
	}
	return out, release, nil
}
