package rowipc

import (
	"encoding/binary"
	"fmt"
	"math"
	"reflect"
	"strings"
	"unsafe"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/bitutil"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// This file derives the Arrow columns of a row type from its Go struct
// definition, once per codec (New), and moves values
// between rows and Arrow buffers. The derivation is the only place that
// maps Go to Arrow, so every row type shares it:
//
//   - a field's column name is its json tag; an embedded struct
//     contributes its columns in place (Rewarded = Trajectory's columns,
//     then its own), as encoding/json does;
//   - int32, int64, float32, float64, uint8 map to the Arrow primitive of
//     the same width, bool to boolean, string to utf8;
//   - a nested struct maps to struct<...> of its own columns;
//   - []E maps to list<E> with non-nullable elements. Lists are not
//     nullable except the fixed-width lists whose names the codec's
//     nullable set holds, where a nil slice is stored as null.
//
// Rows are reached through unsafe pointers at the field offsets reflect
// reports, so building and reading a column costs no reflection per value.

type colKind uint8

const (
	kindFixed     colKind = iota // fixed-width scalar
	kindBool                     // bool
	kindString                   // string
	kindFixedList                // []V of a fixed-width V
	kindList                     // []E of any other E (string, bool, struct)
	kindStruct                   // nested struct
)

// col is one Arrow column (or list element, or struct child) of a Go type.
type col struct {
	name     string
	kind     colKind
	dt       arrow.DataType
	nullable bool
	off      uintptr      // offset of the Go field in its struct
	width    int          // byte width of a fixed value or list element
	elemSize uintptr      // kindList: size of a Go element
	elemType reflect.Type // kindList: Go element type
	elem     *col         // kindList: the element column (off 0)
	fields   []col        // kindStruct: the struct's columns
}

// at returns a pointer to the i-th row (or element) a column works on.
type at func(i int) unsafe.Pointer

func (c *col) field() arrow.Field { return arrow.Field{Name: c.name, Type: c.dt, Nullable: c.nullable} }

func fieldsOf(cols []col) []arrow.Field {
	fs := make([]arrow.Field, len(cols))
	for i := range cols {
		fs[i] = cols[i].field()
	}
	return fs
}

// colsOf derives the columns of struct type t; nullable holds the names
// of the nullable list columns.
func colsOf(t reflect.Type, nullable map[string]bool) []col {
	var cols []col
	for i := range t.NumField() {
		f := t.Field(i)
		if f.Anonymous && f.Type.Kind() == reflect.Struct {
			for _, c := range colsOf(f.Type, nullable) {
				c.off += f.Offset
				cols = append(cols, c)
			}
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			panic(fmt.Sprintf("rowipc: field %s.%s has no json name", t, f.Name))
		}
		c := colOf(name, f.Type, nullable)
		c.off = f.Offset
		cols = append(cols, c)
	}
	return cols
}

func fixedType(t reflect.Type) (arrow.DataType, bool) {
	switch t.Kind() {
	case reflect.Int32:
		return arrow.PrimitiveTypes.Int32, true
	case reflect.Int64:
		return arrow.PrimitiveTypes.Int64, true
	case reflect.Float32:
		return arrow.PrimitiveTypes.Float32, true
	case reflect.Float64:
		return arrow.PrimitiveTypes.Float64, true
	case reflect.Uint8:
		return arrow.PrimitiveTypes.Uint8, true
	}
	return nil, false
}

func colOf(name string, t reflect.Type, nullable map[string]bool) col {
	if dt, ok := fixedType(t); ok {
		return col{name: name, kind: kindFixed, dt: dt, width: int(t.Size())}
	}
	switch t.Kind() {
	case reflect.Bool:
		return col{name: name, kind: kindBool, dt: arrow.FixedWidthTypes.Boolean}
	case reflect.String:
		return col{name: name, kind: kindString, dt: arrow.BinaryTypes.String}
	case reflect.Struct:
		fields := colsOf(t, nullable)
		return col{name: name, kind: kindStruct, dt: arrow.StructOf(fieldsOf(fields)...), fields: fields}
	case reflect.Slice:
		if dt, ok := fixedType(t.Elem()); ok {
			return col{name: name, kind: kindFixedList, dt: arrow.ListOfNonNullable(dt),
				nullable: nullable[name], width: int(t.Elem().Size())}
		}
		e := colOf("item", t.Elem(), nullable)
		return col{name: name, kind: kindList, dt: arrow.ListOfField(e.field()),
			elem: &e, elemType: t.Elem(), elemSize: t.Elem().Size()}
	}
	panic(fmt.Sprintf("rowipc: no Arrow column for %s of Go type %s", name, t))
}

// sliceHeader is the runtime layout of a Go slice.
type sliceHeader struct {
	data     unsafe.Pointer
	len, cap int
}

// emptyArray backs decoded empty, non-nil slices.
var emptyArray [0]uint64

func rawBytes(p unsafe.Pointer, n int) []byte { return unsafe.Slice((*byte)(p), n) }

func unsafeBytes(words []uint64) []byte {
	return rawBytes(unsafe.Pointer(unsafe.SliceData(words)), len(words)*8)
}

// newBuf allocates a buffer of size bytes from mem; the caller writes
// every byte. Buffers from memory allocators are 64-byte aligned.
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

// newData builds ArrayData and drops the caller's references to bufs and
// children, which the data now holds.
func newData(dt arrow.DataType, n int, bufs []*memory.Buffer, children []arrow.ArrayData, nulls int) arrow.ArrayData {
	d := array.NewData(dt, n, bufs, children, nulls, 0)
	for _, b := range bufs {
		if b != nil {
			b.Release()
		}
	}
	for _, c := range children {
		c.Release()
	}
	return d
}

// builder carries the allocator and the first error of one ToRecord.
type builder struct {
	mem memory.Allocator
	err error
}

// offsetsBuf builds list or string offsets from the length of each row.
func offsetsBuf(b *builder, n int, size func(i int) int) (*memory.Buffer, int) {
	buf := newBuf(b.mem, (n+1)*4)
	offs := unsafe.Slice((*int32)(unsafe.Pointer(unsafe.SliceData(buf.Bytes()))), n+1)
	offs[0] = 0
	total := 0
	for i := range n {
		total += size(i)
		if total > math.MaxInt32 && b.err == nil {
			b.err = fmt.Errorf("schemas: more than %d values in one column", math.MaxInt32)
		}
		offs[i+1] = int32(total)
	}
	if b.err != nil {
		total = 0 // the record is discarded; keep the buffers small
		clear(offs)
	}
	return buf, total
}

// build returns the Arrow data of column c over n rows.
func (c *col) build(b *builder, n int, row at) arrow.ArrayData {
	ptr := func(i int) unsafe.Pointer { return unsafe.Add(row(i), c.off) }
	switch c.kind {
	case kindFixed:
		buf := newBuf(b.mem, n*c.width)
		dst := buf.Bytes()
		for i := range n {
			copy(dst[i*c.width:], rawBytes(ptr(i), c.width))
		}
		return newData(c.dt, n, []*memory.Buffer{nil, buf}, nil, 0)
	case kindBool:
		buf := newBitmap(b.mem, n)
		for i := range n {
			if *(*bool)(ptr(i)) {
				bitutil.SetBit(buf.Bytes(), i)
			}
		}
		return newData(c.dt, n, []*memory.Buffer{nil, buf}, nil, 0)
	case kindString:
		offs, total := offsetsBuf(b, n, func(i int) int { return len(*(*string)(ptr(i))) })
		data := newBuf(b.mem, total)
		pos := 0
		for i := 0; i < n && total > 0; i++ {
			pos += copy(data.Bytes()[pos:], *(*string)(ptr(i)))
		}
		return newData(c.dt, n, []*memory.Buffer{nil, offs, data}, nil, 0)
	case kindFixedList:
		return c.buildFixedList(b, n, ptr)
	case kindList:
		offs, total := offsetsBuf(b, n, func(i int) int { return (*sliceHeader)(ptr(i)).len })
		elems := make([]unsafe.Pointer, 0, total)
		for i := 0; i < n && total > 0; i++ {
			s := (*sliceHeader)(ptr(i))
			for k := range s.len {
				elems = append(elems, unsafe.Add(s.data, uintptr(k)*c.elemSize))
			}
		}
		child := c.elem.build(b, total, func(k int) unsafe.Pointer { return elems[k] })
		return newData(c.dt, n, []*memory.Buffer{nil, offs}, []arrow.ArrayData{child}, 0)
	case kindStruct:
		children := make([]arrow.ArrayData, len(c.fields))
		for j := range c.fields {
			children[j] = c.fields[j].build(b, n, ptr)
		}
		return newData(c.dt, n, []*memory.Buffer{nil}, children, 0)
	}
	panic("rowipc: unknown column kind")
}

// buildFixedList copies every row's values once into one contiguous
// buffer; when the non-empty rows already lie back to back in memory, in
// row order, the buffer is that memory instead (no copy).
func (c *col) buildFixedList(b *builder, n int, ptr at) arrow.ArrayData {
	offs, total := offsetsBuf(b, n, func(i int) int { return (*sliceHeader)(ptr(i)).len })
	var valid *memory.Buffer
	nulls, first, contiguous := 0, -1, true
	var next uintptr // address where the next non-empty row must start (compared only)
	for i := range n {
		s := (*sliceHeader)(ptr(i))
		if s.len > 0 {
			if first < 0 {
				first = i
			} else if uintptr(s.data) != next {
				contiguous = false
			}
			next = uintptr(s.data) + uintptr(s.len*c.width)
		}
		if c.nullable && s.data == nil {
			if valid == nil {
				valid = newBitmap(b.mem, n)
				bitutil.SetBitsTo(valid.Bytes(), 0, int64(n), true)
			}
			bitutil.ClearBit(valid.Bytes(), i)
			nulls++
		}
	}
	var values *memory.Buffer
	if b.err != nil {
		values, total = memory.NewBufferBytes(nil), 0
	} else if first >= 0 && contiguous {
		s := (*sliceHeader)(ptr(first))
		values = memory.NewBufferBytes(rawBytes(s.data, total*c.width))
	} else {
		values = newBuf(b.mem, total*c.width)
		pos := 0
		for i := range n {
			s := (*sliceHeader)(ptr(i))
			if s.len > 0 {
				pos += copy(values.Bytes()[pos:], rawBytes(s.data, s.len*c.width))
			}
		}
	}
	elem := c.dt.(*arrow.ListType).Elem()
	child := newData(elem, total, []*memory.Buffer{nil, values}, nil, 0)
	return newData(c.dt, n, []*memory.Buffer{valid, offs}, []arrow.ArrayData{child}, nulls)
}

// Readers of validated data. Values are copied as bytes, so input of any
// alignment is safe.

// offsetsOf is the offsets buffer of list or string data d from its
// logical row 0, for offAt.
func offsetsOf(d *colData) []byte { return d.bufs[1][d.off*4:] }

func offAt(offs []byte, i int) int { return int(int32(binary.LittleEndian.Uint32(offs[i*4:]))) }

func isNull(d *colData, i int) bool {
	return d.nulls != 0 && !bitutil.BitIsSet(d.bufs[0], d.off+i)
}

// read stores logical elements [start, start+n) of d, which passed
// checkData against c, into rows 0..n-1.
// With share, fixed-width list values are not copied: rows point into
// d's buffers when they are aligned for the element type.
func (c *col) read(d *colData, start, n int, row at, share bool) {
	if n == 0 {
		return
	}
	ptr := func(i int) unsafe.Pointer { return unsafe.Add(row(i), c.off) }
	switch c.kind {
	case kindFixed:
		src := d.bufs[1][(d.off+start)*c.width:]
		for i := range n {
			copy(rawBytes(ptr(i), c.width), src[i*c.width:])
		}
	case kindBool:
		for i := range n {
			*(*bool)(ptr(i)) = bitutil.BitIsSet(d.bufs[1], d.off+start+i)
		}
	case kindString:
		// Consecutive equal values (a group's ids, run ids, statuses) share
		// one string.
		data, offs := d.bufs[2], offsetsOf(d)
		prev := ""
		for i := range n {
			if b := data[offAt(offs, start+i):offAt(offs, start+i+1)]; string(b) != prev {
				prev = string(b)
			}
			*(*string)(ptr(i)) = prev
		}
	case kindFixedList:
		c.readFixedList(d, start, n, ptr, share)
	case kindList:
		offs := offsetsOf(d)
		first, end := offAt(offs, start), offAt(offs, start+n)
		if end == first {
			return // every row keeps its nil slice
		}
		all := reflect.MakeSlice(reflect.SliceOf(c.elemType), end-first, end-first)
		base := all.UnsafePointer()
		c.elem.read(&d.children[0], first, end-first, func(k int) unsafe.Pointer {
			return unsafe.Add(base, uintptr(k)*c.elemSize)
		}, share)
		for i := range n {
			lo, hi := offAt(offs, start+i), offAt(offs, start+i+1)
			if hi > lo {
				*(*sliceHeader)(ptr(i)) = sliceHeader{unsafe.Add(base, uintptr(lo-first)*c.elemSize), hi - lo, hi - lo}
			}
		}
	case kindStruct:
		for j := range c.fields {
			c.fields[j].read(&d.children[j], d.off+start, n, ptr, share)
		}
	}
}

// readFixedList copies the column's values once into one Go allocation
// (or, with share, uses d's aligned values buffer in place) and points
// each row's slice into it, capacity capped at its length.
func (c *col) readFixedList(d *colData, start, n int, ptr at, share bool) {
	child := &d.children[0]
	offs := offsetsOf(d)
	first, end := offAt(offs, start), offAt(offs, start+n)
	size := (end - first) * c.width
	childOff := child.off + first
	src := child.bufs[1][childOff*c.width : childOff*c.width+size]
	var all []byte
	if share && size > 0 && uintptr(unsafe.Pointer(unsafe.SliceData(src)))%uintptr(c.width) == 0 {
		all = src
	} else {
		// Allocated as uint64 so the values are aligned for any element type.
		all = unsafeBytes(make([]uint64, (size+7)/8))[:size]
		copy(all, src)
	}
	nulls := d.nulls != 0
	for i := range n {
		lo, hi := offAt(offs, start+i), offAt(offs, start+i+1)
		switch {
		case nulls && isNull(d, start+i), hi == lo && !c.nullable:
			// nil: the zero value of the freshly made row
		case hi == lo:
			*(*sliceHeader)(ptr(i)) = sliceHeader{unsafe.Pointer(&emptyArray), 0, 0}
		default:
			*(*sliceHeader)(ptr(i)) = sliceHeader{unsafe.Pointer(&all[(lo-first)*c.width]), hi - lo, hi - lo}
		}
	}
}

// ---- structural validation ----

// checkData verifies that d has the shape of type want and that every
// buffer, offset and child is in range, so that the readers above cannot
// index out of bounds. Null entries are allowed only where nullable. Names
// of list elements and nullability flags in the type are not compared:
// what matters is the data.
func checkData(d *colData, want arrow.DataType, nullable bool) error {
	if d.dt.ID() != want.ID() {
		return columnErr("type %s, want %s", d.dt, want)
	}
	off, n := d.off, d.len
	if off < 0 || n < 0 || off > 1<<40 || n > 1<<40 {
		return columnErr("offset %d length %d out of range", off, n)
	}
	if need := bufferCount(want.ID()); d.nbufs < need {
		return columnErr("%d buffers, want %d", d.nbufs, need)
	}
	if nulls := d.nulls; nulls != 0 {
		if !nullable {
			return columnErr("%d nulls in a non-nullable column", nulls)
		}
		if nulls < 0 || nulls > n || len(d.bufs[0]) < int(bitutil.BytesForBits(int64(off+n))) {
			return columnErr("bad validity bitmap")
		}
	}
	switch want.ID() {
	case arrow.INT32, arrow.INT64, arrow.FLOAT32, arrow.FLOAT64, arrow.UINT8:
		w := want.(arrow.FixedWidthDataType).BitWidth() / 8
		if len(d.bufs[1]) < (off+n)*w {
			return columnErr("values buffer of %d bytes for %d values", len(d.bufs[1]), off+n)
		}
	case arrow.BOOL:
		if len(d.bufs[1]) < int(bitutil.BytesForBits(int64(off+n))) {
			return columnErr("bitmap too short")
		}
	case arrow.STRING:
		return checkOffsets(d, len(d.bufs[2]))
	case arrow.LIST:
		if len(d.children) != 1 {
			return columnErr("list without values")
		}
		if err := checkOffsets(d, d.children[0].len); err != nil {
			return err
		}
		return under("item", checkData(&d.children[0], want.(*arrow.ListType).Elem(), false))
	case arrow.STRUCT:
		st := want.(*arrow.StructType)
		gst, ok := d.dt.(*arrow.StructType)
		if !ok || len(d.children) != st.NumFields() || gst.NumFields() != st.NumFields() {
			return columnErr("struct has %d fields, want %d", len(d.children), st.NumFields())
		}
		for i := range st.NumFields() {
			f := st.Field(i)
			if gst.Field(i).Name != f.Name {
				return columnErr("field %d is %q, want %q", i, gst.Field(i).Name, f.Name)
			}
			if d.children[i].len < off+n {
				return under(f.Name, columnErr("%d values, want %d", d.children[i].len, off+n))
			}
			if err := checkData(&d.children[i], f.Type, f.Nullable); err != nil {
				return under(f.Name, err)
			}
		}
	default:
		return columnErr("unsupported type %s", want)
	}
	return nil
}

// checkOffsets verifies the int32 offsets of a list or string array:
// present, non-decreasing, and within [0, limit].
func checkOffsets(d *colData, limit int) error {
	off, n := d.off, d.len
	b := d.bufs[1]
	if n == 0 && len(b) == 0 {
		return nil
	}
	if len(b) < (off+n+1)*4 {
		return columnErr("offsets buffer too short")
	}
	offs := b[off*4:]
	prev := offAt(offs, 0)
	if prev < 0 || prev > limit {
		return columnErr("offset %d out of range [0,%d]", prev, limit)
	}
	for i := 1; i <= n; i++ {
		cur := offAt(offs, i)
		if cur < prev || cur > limit {
			return columnErr("offset %d at %d out of range [%d,%d]", cur, i, prev, limit)
		}
		prev = cur
	}
	return nil
}

// columnError is a structural error of the column at path (dotted from
// the top-level column; the names are joined as the error returns through
// the nesting, so a valid batch builds no path at all).
type columnError struct {
	path string
	msg  string
}

func (e *columnError) Error() string { return "column " + e.path + ": " + e.msg }

func columnErr(format string, args ...any) error {
	return &columnError{msg: fmt.Sprintf(format, args...)}
}

// under puts err, when it is a columnError, under the column or field name.
func under(name string, err error) error {
	if ce, ok := err.(*columnError); ok {
		if ce.path == "" {
			ce.path = name
		} else {
			ce.path = name + "." + ce.path
		}
	}
	return err
}
