package rowipc

import (
	"encoding/binary"
	"fmt"

	"github.com/apache/arrow-go/v18/arrow"
)

// This file loads the record batch of a stream whose schema message is
// byte for byte the one a codec writes (Codec.Encode), so the schema is
// known and need not be parsed again: the field nodes and buffers of the
// batch are mapped onto the codec's schema in the order the IPC format
// lays them out (depth first; per node: validity, then offsets and/or
// values). Every node count, length and buffer range is checked against
// what is present; the column checks of readColumns (checkData) then
// bound every offset, as for batches from the Arrow reader.

// colData is one column of a record batch as the readers need it: its
// field node (length, null count, offset), its buffers in the IPC order
// (0: validity bitmap, nil without nulls; 1: values or offsets; 2: string
// bytes) and its children. It views the memory it was loaded from: the
// message body, or the buffers of Arrow array data (fromArrow).
type colData struct {
	dt              arrow.DataType
	len, nulls, off int
	nbufs           int // buffers present
	bufs            [3][]byte
	children        []colData
}

// bufferCount is the number of buffers of a node of type id.
func bufferCount(id arrow.Type) int {
	switch id {
	case arrow.STRING:
		return 3
	case arrow.STRUCT:
		return 1
	}
	return 2
}

// fromArrow views Arrow array data as colData, children to the depth a
// codec's schema can reach (checkData never looks deeper).
func fromArrow(d arrow.ArrayData, depth int) colData {
	c := colData{dt: d.DataType(), len: d.Len(), nulls: d.NullN(), off: d.Offset()}
	bufs := d.Buffers()
	c.nbufs = min(len(bufs), len(c.bufs))
	for i := range c.nbufs {
		if bufs[i] != nil {
			c.bufs[i] = bufs[i].Bytes()
		}
	}
	if kids := d.Children(); len(kids) > 0 && depth < maxSchemaDepth {
		c.children = make([]colData, len(kids))
		for i, k := range kids {
			c.children[i] = fromArrow(k, depth+1)
		}
	}
	return c
}

// batchLoader walks the nodes and buffers of one record batch message.
type batchLoader struct {
	meta         []byte
	body         []byte
	nodes, bufs  fbVector
	nextN, nextB int
	limit        int64
	cols         []colData // one per field node, handed out in order
}

// loadBatch returns the row count and one colData per field of schema,
// which has nodes field nodes (nodeCount). The data views the message body
// (an 8-byte aligned copy when the body is not aligned).
func loadBatch(schema *arrow.Schema, nodes int, m ipcMessage) (int64, []colData, error) {
	root, err := fbRoot(m.meta)
	if err != nil {
		return 0, nil, err
	}
	header, ok, err := root.table(2)
	if err != nil || !ok {
		return 0, nil, fmt.Errorf("record batch: no header")
	}
	n, err := header.i64(0)
	if err != nil {
		return 0, nil, err
	}
	l := &batchLoader{meta: m.meta, body: aligned8(m.body), limit: 1 << 40}
	if l.nodes, err = header.vector(1, 16); err != nil {
		return 0, nil, fmt.Errorf("field nodes: %w", err)
	}
	if l.bufs, err = header.vector(2, 16); err != nil {
		return 0, nil, fmt.Errorf("buffers: %w", err)
	}
	if n < 0 || n > l.limit {
		return 0, nil, fmt.Errorf("record batch of %d rows", n)
	}
	// Every node of the batch in one allocation, sized by the schema (a
	// batch with more nodes is refused below).
	l.cols = make([]colData, 0, min(l.nodes.n, nodes))
	fields, err := l.take(schema.NumFields())
	if err != nil {
		return 0, nil, err
	}
	for i := range fields {
		f := schema.Field(i)
		if err := l.load(f.Type, 0, &fields[i]); err != nil {
			return 0, nil, fmt.Errorf("column %s: %w", f.Name, err)
		}
	}
	if l.nextN != l.nodes.n || l.nextB != l.bufs.n {
		return 0, nil, fmt.Errorf("record batch has %d field nodes and %d buffers, the schema uses %d and %d",
			l.nodes.n, l.bufs.n, l.nextN, l.nextB)
	}
	return n, fields, nil
}

// nodeCount is the number of field nodes of a record batch of schema.
func nodeCount(schema *arrow.Schema) int {
	n := 0
	for i := range schema.NumFields() {
		n += typeNodes(schema.Field(i).Type)
	}
	return n
}

func typeNodes(dt arrow.DataType) int {
	switch t := dt.(type) {
	case *arrow.ListType:
		return 1 + typeNodes(t.Elem())
	case *arrow.StructType:
		n := 1
		for i := range t.NumFields() {
			n += typeNodes(t.Field(i).Type)
		}
		return n
	}
	return 1
}

// take hands out the next k nodes' places.
func (l *batchLoader) take(k int) ([]colData, error) {
	if k > cap(l.cols)-len(l.cols) {
		return nil, fmt.Errorf("fewer field nodes than fields")
	}
	at := len(l.cols)
	l.cols = l.cols[:at+k]
	return l.cols[at : at+k : at+k], nil
}

func (l *batchLoader) node() (length, nulls int64, err error) {
	if l.nextN >= l.nodes.n {
		return 0, 0, fmt.Errorf("fewer field nodes than fields")
	}
	p := l.nodes.start + 16*l.nextN
	l.nextN++
	length = int64(binary.LittleEndian.Uint64(l.meta[p:]))
	nulls = int64(binary.LittleEndian.Uint64(l.meta[p+8:]))
	if length < 0 || length > l.limit || nulls < 0 || nulls > length {
		return 0, 0, fmt.Errorf("field node of %d values with %d nulls", length, nulls)
	}
	return length, nulls, nil
}

// buffer returns the next buffer, nil when it is empty.
func (l *batchLoader) buffer() ([]byte, error) {
	if l.nextB >= l.bufs.n {
		return nil, fmt.Errorf("fewer buffers than the schema needs")
	}
	p := l.bufs.start + 16*l.nextB
	l.nextB++
	off := int64(binary.LittleEndian.Uint64(l.meta[p:]))
	size := int64(binary.LittleEndian.Uint64(l.meta[p+8:]))
	if off < 0 || size < 0 || off > int64(len(l.body)) || size > int64(len(l.body))-off {
		return nil, fmt.Errorf("buffer [%d, +%d) outside the %d-byte body", off, size, len(l.body))
	}
	if size == 0 {
		return nil, nil
	}
	return l.body[off : off+size : off+size], nil
}

// load reads the node, buffers and children of one field of type dt into d.
func (l *batchLoader) load(dt arrow.DataType, depth int, d *colData) error {
	if depth > maxSchemaDepth {
		return fmt.Errorf("nested deeper than %d", maxSchemaDepth)
	}
	n, nulls, err := l.node()
	if err != nil {
		return err
	}
	*d = colData{dt: dt, len: int(n), nulls: int(nulls), nbufs: bufferCount(dt.ID())}
	for i := range d.nbufs {
		if d.bufs[i], err = l.buffer(); err != nil {
			return err
		}
	}
	if nulls == 0 {
		d.bufs[0] = nil // as the Arrow reader: no bitmap without nulls
	}
	switch t := dt.(type) {
	case *arrow.ListType:
		if d.children, err = l.take(1); err != nil {
			return err
		}
		return l.load(t.Elem(), depth+1, &d.children[0])
	case *arrow.StructType:
		if d.children, err = l.take(t.NumFields()); err != nil {
			return err
		}
		for i := range d.children {
			if err := l.load(t.Field(i).Type, depth+1, &d.children[i]); err != nil {
				return err
			}
		}
	}
	return nil
}
