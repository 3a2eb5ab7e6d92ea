package schemas

import (
	"encoding/binary"
	"fmt"
	"unsafe"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/bitutil"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// This file holds the column building blocks every record kind is made of.
// A column knows its Arrow field, how to build an array from rows reached
// through an accessor, and how to read a validated array back into rows.
// Accessors (func(*T) *V) serve both directions, and lifting an accessor
// (liftCols) reuses the columns of an embedded type, so the trajectory
// columns are written once and shared by the rewarded and scored kinds.

// column is one Arrow column over rows of type T.
type column[T any] interface {
	field() arrow.Field
	// build returns the data of n values; at(i) is the i-th row.
	build(mem memory.Allocator, n int, at func(int) *T) arrow.ArrayData
	// read stores logical elements [start, start+n) of d into at(0..n-1).
	// d has passed checkData against field().
	read(d arrow.ArrayData, start, n int, at func(int) *T)
}

// fixed are the fixed-width Go types stored as Arrow primitives.
type fixed interface {
	~int32 | ~int64 | ~float32 | ~float64 | ~uint8
}

func sizeOf[V fixed]() int {
	var v V
	return int(unsafe.Sizeof(v))
}

// bytesOf views a Go slice as its bytes (no copy).
func bytesOf[V fixed](s []V) []byte {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*sizeOf[V]())
}

// newBuf allocates a buffer of size bytes from mem; the caller writes
// every byte. Buffers from memory allocators are 64-byte aligned, so they
// may be viewed as any fixed-width type.
func newBuf(mem memory.Allocator, size int) *memory.Buffer {
	b := memory.NewResizableBuffer(mem)
	b.Resize(size)
	return b
}

// newBitmap allocates a zeroed bitmap of n bits (not every allocator
// zeroes memory).
func newBitmap(mem memory.Allocator, n int) *memory.Buffer {
	b := newBuf(mem, int(bitutil.BytesForBits(int64(n))))
	clear(b.Bytes())
	return b
}

// viewAs views an aligned buffer allocated by newBuf as []V.
func viewAs[V fixed](b []byte) []V {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Slice((*V)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/sizeOf[V]())
}

// releaseAll drops the caller's references after they were handed to a
// parent ArrayData (which retains its children and buffers).
func releaseBufs(bufs ...*memory.Buffer) {
	for _, b := range bufs {
		if b != nil {
			b.Release()
		}
	}
}

func newData(dt arrow.DataType, n int, bufs []*memory.Buffer, children []arrow.ArrayData, nulls int) arrow.ArrayData {
	d := array.NewData(dt, n, bufs, children, nulls, 0)
	releaseBufs(bufs...)
	for _, c := range children {
		c.Release()
	}
	return d
}

// Raw accessors of validated data. Values are read with encoding/binary or
// copied as bytes so input of any alignment is safe.

// bufBytes is the content of buffer i of d (nil when absent).
func bufBytes(d arrow.ArrayData, i int) []byte {
	bufs := d.Buffers()
	if i >= len(bufs) || bufs[i] == nil {
		return nil
	}
	return bufs[i].Bytes()
}

func offsetAt(d arrow.ArrayData, i int) int {
	b := bufBytes(d, 1)
	return int(int32(binary.LittleEndian.Uint32(b[(d.Offset()+i)*4:])))
}

func isNull(d arrow.ArrayData, i int) bool {
	if d.NullN() == 0 {
		return false
	}
	return !bitutil.BitIsSet(bufBytes(d, 0), d.Offset()+i)
}

// ---- scalar columns ----

type fixedCol[T any, V fixed] struct {
	name string
	dt   arrow.DataType
	get  func(*T) *V
}

func (c fixedCol[T, V]) field() arrow.Field { return arrow.Field{Name: c.name, Type: c.dt} }

func (c fixedCol[T, V]) build(mem memory.Allocator, n int, at func(int) *T) arrow.ArrayData {
	buf := newBuf(mem, n*sizeOf[V]())
	vals := viewAs[V](buf.Bytes())
	for i := range n {
		vals[i] = *c.get(at(i))
	}
	return newData(c.dt, n, []*memory.Buffer{nil, buf}, nil, 0)
}

func (c fixedCol[T, V]) read(d arrow.ArrayData, start, n int, at func(int) *T) {
	w := sizeOf[V]()
	src := bufBytes(d, 1)[(d.Offset()+start)*w:]
	var v V
	vb := unsafe.Slice((*byte)(unsafe.Pointer(&v)), w)
	for i := range n {
		copy(vb, src[i*w:])
		*c.get(at(i)) = v
	}
}

func i32[T any](name string, get func(*T) *int32) column[T] {
	return fixedCol[T, int32]{name, arrow.PrimitiveTypes.Int32, get}
}
func i64[T any](name string, get func(*T) *int64) column[T] {
	return fixedCol[T, int64]{name, arrow.PrimitiveTypes.Int64, get}
}
func f32[T any](name string, get func(*T) *float32) column[T] {
	return fixedCol[T, float32]{name, arrow.PrimitiveTypes.Float32, get}
}
func f64[T any](name string, get func(*T) *float64) column[T] {
	return fixedCol[T, float64]{name, arrow.PrimitiveTypes.Float64, get}
}

type boolCol[T any] struct {
	name string
	get  func(*T) *bool
}

func boolean[T any](name string, get func(*T) *bool) column[T] { return boolCol[T]{name, get} }

func (c boolCol[T]) field() arrow.Field {
	return arrow.Field{Name: c.name, Type: arrow.FixedWidthTypes.Boolean}
}

func (c boolCol[T]) build(mem memory.Allocator, n int, at func(int) *T) arrow.ArrayData {
	buf := newBitmap(mem, n)
	bits := buf.Bytes()
	for i := range n {
		if *c.get(at(i)) {
			bitutil.SetBit(bits, i)
		}
	}
	return newData(arrow.FixedWidthTypes.Boolean, n, []*memory.Buffer{nil, buf}, nil, 0)
}

func (c boolCol[T]) read(d arrow.ArrayData, start, n int, at func(int) *T) {
	bits := bufBytes(d, 1)
	for i := range n {
		*c.get(at(i)) = bitutil.BitIsSet(bits, d.Offset()+start+i)
	}
}

type strCol[T any] struct {
	name string
	get  func(*T) *string
}

func str[T any](name string, get func(*T) *string) column[T] { return strCol[T]{name, get} }

func (c strCol[T]) field() arrow.Field {
	return arrow.Field{Name: c.name, Type: arrow.BinaryTypes.String}
}

func (c strCol[T]) build(mem memory.Allocator, n int, at func(int) *T) arrow.ArrayData {
	total := 0
	for i := range n {
		total += len(*c.get(at(i)))
	}
	offBuf := newBuf(mem, (n+1)*4)
	offs := viewAs[int32](offBuf.Bytes())
	offs[0] = 0
	dataBuf := newBuf(mem, total)
	data := dataBuf.Bytes()
	pos := 0
	for i := range n {
		pos += copy(data[pos:], *c.get(at(i)))
		offs[i+1] = int32(pos)
	}
	return newData(arrow.BinaryTypes.String, n, []*memory.Buffer{nil, offBuf, dataBuf}, nil, 0)
}

func (c strCol[T]) read(d arrow.ArrayData, start, n int, at func(int) *T) {
	if n == 0 {
		return
	}
	data := bufBytes(d, 2)
	lo := offsetAt(d, start)
	for i := range n {
		hi := offsetAt(d, start+i+1)
		*c.get(at(i)) = string(data[lo:hi])
		lo = hi
	}
}

// ---- lists ----

// fixedListCol is list<V> for fixed-width V. Building copies every row's
// slice once into one contiguous values buffer (or shares the slice's
// memory when a single row holds all values); reading copies the values
// once into one Go slice and sub-slices it per row.
type fixedListCol[T any, V fixed] struct {
	name     string
	elem     arrow.DataType
	nullable bool // a nil slice is stored as null and read back as nil
	get      func(*T) *[]V
}

func (c fixedListCol[T, V]) dt() arrow.DataType { return arrow.ListOfNonNullable(c.elem) }

func (c fixedListCol[T, V]) field() arrow.Field {
	return arrow.Field{Name: c.name, Type: c.dt(), Nullable: c.nullable}
}

// listOffsets builds the offsets (and, for nullable lists, the validity
// bitmap) of a list column whose i-th row has length size(i).
func listOffsets(mem memory.Allocator, n int, nullable bool, size func(int) (int, bool)) (offBuf, validBuf *memory.Buffer, total, nulls int) {
	offBuf = newBuf(mem, (n+1)*4)
	offs := viewAs[int32](offBuf.Bytes())
	offs[0] = 0
	var valid []byte
	if nullable {
		validBuf = newBitmap(mem, n)
		valid = validBuf.Bytes()
	}
	for i := range n {
		l, isNil := size(i)
		if nullable {
			if isNil {
				nulls++
			} else {
				bitutil.SetBit(valid, i)
			}
		}
		total += l
		offs[i+1] = int32(total)
	}
	if nulls == 0 && validBuf != nil {
		validBuf.Release()
		validBuf = nil
	}
	return offBuf, validBuf, total, nulls
}

func (c fixedListCol[T, V]) build(mem memory.Allocator, n int, at func(int) *T) arrow.ArrayData {
	nonEmpty, last := 0, -1
	offBuf, validBuf, total, nulls := listOffsets(mem, n, c.nullable, func(i int) (int, bool) {
		s := *c.get(at(i))
		if len(s) > 0 {
			nonEmpty++
			last = i
		}
		return len(s), s == nil
	})
	var valBuf *memory.Buffer
	if nonEmpty == 1 {
		// One row holds every value: share its memory instead of copying.
		valBuf = memory.NewBufferBytes(bytesOf(*c.get(at(last))))
	} else {
		valBuf = newBuf(mem, total*sizeOf[V]())
		dst := valBuf.Bytes()
		pos := 0
		for i := range n {
			pos += copy(dst[pos:], bytesOf(*c.get(at(i))))
		}
	}
	child := newData(c.elem, total, []*memory.Buffer{nil, valBuf}, nil, 0)
	return newData(c.dt(), n, []*memory.Buffer{validBuf, offBuf}, []arrow.ArrayData{child}, nulls)
}

func (c fixedListCol[T, V]) read(d arrow.ArrayData, start, n int, at func(int) *T) {
	if n == 0 {
		return
	}
	child := d.Children()[0]
	first, end := offsetAt(d, start), offsetAt(d, start+n)
	w := sizeOf[V]()
	all := make([]V, end-first)
	src := bufBytes(child, 1)
	copy(bytesOf(all), src[(child.Offset()+first)*w:(child.Offset()+end)*w])
	lo := first
	for i := range n {
		hi := offsetAt(d, start+i+1)
		dst := c.get(at(i))
		switch {
		case isNull(d, start+i):
			*dst = nil
		case hi == lo && !c.nullable:
			*dst = nil
		default:
			*dst = all[lo-first : hi-first : hi-first]
		}
		lo = hi
	}
}

func listI32[T any](name string, get func(*T) *[]int32) column[T] {
	return fixedListCol[T, int32]{name, arrow.PrimitiveTypes.Int32, false, get}
}
func listI64[T any](name string, get func(*T) *[]int64) column[T] {
	return fixedListCol[T, int64]{name, arrow.PrimitiveTypes.Int64, false, get}
}
func listF32[T any](name string, get func(*T) *[]float32) column[T] {
	return fixedListCol[T, float32]{name, arrow.PrimitiveTypes.Float32, false, get}
}
func listU8[T any](name string, get func(*T) *[]uint8) column[T] {
	return fixedListCol[T, uint8]{name, arrow.PrimitiveTypes.Uint8, false, get}
}

// nullableListF32 stores a nil slice as null, so "absent" and "empty"
// stay distinct.
func nullableListF32[T any](name string, get func(*T) *[]float32) column[T] {
	return fixedListCol[T, float32]{name, arrow.PrimitiveTypes.Float32, true, get}
}

// listCol is list<E> for any element column; the elements of all rows are
// gathered into one slice and built (or read) by the element column.
type listCol[T, E any] struct {
	name string
	elem column[E]
	get  func(*T) *[]E
}

func listOf[T, E any](name string, elem column[E], get func(*T) *[]E) column[T] {
	return listCol[T, E]{name, elem, get}
}

func (c listCol[T, E]) dt() arrow.DataType { return arrow.ListOfField(c.elem.field()) }

func (c listCol[T, E]) field() arrow.Field { return arrow.Field{Name: c.name, Type: c.dt()} }

func (c listCol[T, E]) build(mem memory.Allocator, n int, at func(int) *T) arrow.ArrayData {
	offBuf, _, total, _ := listOffsets(mem, n, false, func(i int) (int, bool) {
		return len(*c.get(at(i))), false
	})
	flat := make([]E, 0, total)
	for i := range n {
		flat = append(flat, *c.get(at(i))...)
	}
	child := c.elem.build(mem, total, func(k int) *E { return &flat[k] })
	return newData(c.dt(), n, []*memory.Buffer{nil, offBuf}, []arrow.ArrayData{child}, 0)
}

func (c listCol[T, E]) read(d arrow.ArrayData, start, n int, at func(int) *T) {
	if n == 0 {
		return
	}
	first, end := offsetAt(d, start), offsetAt(d, start+n)
	all := make([]E, end-first)
	c.elem.read(d.Children()[0], first, end-first, func(k int) *E { return &all[k] })
	lo := first
	for i := range n {
		hi := offsetAt(d, start+i+1)
		if hi == lo {
			*c.get(at(i)) = nil
		} else {
			*c.get(at(i)) = all[lo-first : hi-first : hi-first]
		}
		lo = hi
	}
}

// ---- structs and embedding ----

// structCol is struct<fields of E> for a value of type E inside T.
type structCol[T, E any] struct {
	name   string
	fields []column[E]
	get    func(*T) *E
}

func structOf[T, E any](name string, fields []column[E], get func(*T) *E) column[T] {
	return structCol[T, E]{name, fields, get}
}

func self[E any](e *E) *E { return e }

func (c structCol[T, E]) dt() arrow.DataType { return arrow.StructOf(fieldsOf(c.fields)...) }

func (c structCol[T, E]) field() arrow.Field { return arrow.Field{Name: c.name, Type: c.dt()} }

func (c structCol[T, E]) build(mem memory.Allocator, n int, at func(int) *T) arrow.ArrayData {
	children := make([]arrow.ArrayData, len(c.fields))
	for j, f := range c.fields {
		children[j] = f.build(mem, n, func(i int) *E { return c.get(at(i)) })
	}
	return newData(c.dt(), n, []*memory.Buffer{nil}, children, 0)
}

func (c structCol[T, E]) read(d arrow.ArrayData, start, n int, at func(int) *T) {
	for j, f := range c.fields {
		f.read(d.Children()[j], d.Offset()+start, n, func(i int) *E { return c.get(at(i)) })
	}
}

// lifted reaches the columns of an embedded E through get.
type lifted[T, E any] struct {
	inner column[E]
	get   func(*T) *E
}

func (c lifted[T, E]) field() arrow.Field { return c.inner.field() }

func (c lifted[T, E]) build(mem memory.Allocator, n int, at func(int) *T) arrow.ArrayData {
	return c.inner.build(mem, n, func(i int) *E { return c.get(at(i)) })
}

func (c lifted[T, E]) read(d arrow.ArrayData, start, n int, at func(int) *T) {
	c.inner.read(d, start, n, func(i int) *E { return c.get(at(i)) })
}

// liftCols returns cols as columns of T, reaching E through get.
func liftCols[T, E any](get func(*T) *E, cols []column[E]) []column[T] {
	out := make([]column[T], len(cols))
	for i, c := range cols {
		out[i] = lifted[T, E]{c, get}
	}
	return out
}

func fieldsOf[T any](cols []column[T]) []arrow.Field {
	fs := make([]arrow.Field, len(cols))
	for i, c := range cols {
		fs[i] = c.field()
	}
	return fs
}

func concatCols[T any](parts ...[]column[T]) []column[T] {
	var out []column[T]
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// ---- structural validation ----

// checkData verifies that d has the shape of type want and that every
// buffer, offset and child is in range, so that the readers above cannot
// index out of bounds. Null entries are allowed only where nullable. Names
// of list elements and nullability flags in the type are not compared:
// what matters is the data.
func checkData(d arrow.ArrayData, want arrow.DataType, nullable bool, path string) error {
	got := d.DataType()
	if got.ID() != want.ID() {
		return fmt.Errorf("column %s: type %s, want %s", path, got, want)
	}
	off, n := d.Offset(), d.Len()
	if off < 0 || n < 0 || off > 1<<40 || n > 1<<40 {
		return fmt.Errorf("column %s: offset %d length %d out of range", path, off, n)
	}
	bufs := d.Buffers()
	nbufs := map[arrow.Type]int{arrow.STRING: 3, arrow.STRUCT: 1}[want.ID()]
	if nbufs == 0 {
		nbufs = 2
	}
	if len(bufs) < nbufs {
		return fmt.Errorf("column %s: %d buffers, want %d", path, len(bufs), nbufs)
	}
	bufLen := func(i int) int {
		if bufs[i] == nil {
			return 0
		}
		return bufs[i].Len()
	}
	if nulls := d.NullN(); nulls != 0 {
		if !nullable {
			return fmt.Errorf("column %s: %d nulls in a non-nullable column", path, nulls)
		}
		if nulls < 0 || nulls > n || bufLen(0) < int(bitutil.BytesForBits(int64(off+n))) {
			return fmt.Errorf("column %s: bad validity bitmap", path)
		}
	}
	switch want.ID() {
	case arrow.INT32, arrow.INT64, arrow.FLOAT32, arrow.FLOAT64, arrow.UINT8:
		w := want.(arrow.FixedWidthDataType).BitWidth() / 8
		if bufLen(1) < (off+n)*w {
			return fmt.Errorf("column %s: values buffer of %d bytes for %d values", path, bufLen(1), off+n)
		}
	case arrow.BOOL:
		if bufLen(1) < int(bitutil.BytesForBits(int64(off+n))) {
			return fmt.Errorf("column %s: bitmap too short", path)
		}
	case arrow.STRING:
		return checkOffsets(d, bufLen(2), path)
	case arrow.LIST:
		children := d.Children()
		if len(children) != 1 {
			return fmt.Errorf("column %s: list without values", path)
		}
		if err := checkOffsets(d, children[0].Len(), path); err != nil {
			return err
		}
		return checkData(children[0], want.(*arrow.ListType).Elem(), false, path+".item")
	case arrow.STRUCT:
		st := want.(*arrow.StructType)
		gst, ok := got.(*arrow.StructType)
		children := d.Children()
		if !ok || len(children) != st.NumFields() || gst.NumFields() != st.NumFields() {
			return fmt.Errorf("column %s: struct has %d fields, want %d", path, len(children), st.NumFields())
		}
		for i, f := range st.Fields() {
			if gst.Field(i).Name != f.Name {
				return fmt.Errorf("column %s: field %d is %q, want %q", path, i, gst.Field(i).Name, f.Name)
			}
			if children[i].Len() < off+n {
				return fmt.Errorf("column %s.%s: %d values, want %d", path, f.Name, children[i].Len(), off+n)
			}
			if err := checkData(children[i], f.Type, f.Nullable, path+"."+f.Name); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("column %s: unsupported type %s", path, want)
	}
	return nil
}

// checkOffsets verifies the int32 offsets of a list or string array:
// present, non-decreasing, and within [0, limit].
func checkOffsets(d arrow.ArrayData, limit int, path string) error {
	off, n := d.Offset(), d.Len()
	b := bufBytes(d, 1)
	if n == 0 && len(b) == 0 {
		return nil
	}
	if len(b) < (off+n+1)*4 {
		return fmt.Errorf("column %s: offsets buffer too short", path)
	}
	prev := offsetAt(d, 0)
	if prev < 0 || prev > limit {
		return fmt.Errorf("column %s: offset %d out of range [0,%d]", path, prev, limit)
	}
	for i := 1; i <= n; i++ {
		cur := offsetAt(d, i)
		if cur < prev || cur > limit {
			return fmt.Errorf("column %s: offset %d at %d out of range [%d,%d]", path, cur, i, prev, limit)
		}
		prev = cur
	}
	return nil
}
