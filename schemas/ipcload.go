package schemas

import (
	"encoding/binary"
	"fmt"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// This file loads the record batch of a stream whose schema message is
// byte for byte the one a codec writes (Codec.Encode), so the schema is
// known and need not be parsed again: the field nodes and buffers of the
// batch are mapped onto the codec's schema in the order the IPC format
// lays them out (depth first; per node: validity, then offsets and/or
// values). Every node count, length and buffer range is checked against
// what is present; the column checks of readColumns (checkData) then
// bound every offset, as for batches from the Arrow reader.

// batchLoader walks the nodes and buffers of one record batch message.
type batchLoader struct {
	meta         []byte
	body         []byte
	nodes, bufs  fbVector
	nextN, nextB int
	limit        int64
}

// loadBatch returns the row count and one ArrayData per field of schema.
// The data views the message body (an 8-byte aligned copy when the body
// is not aligned); the caller releases it.
func loadBatch(schema *arrow.Schema, m ipcMessage) (int64, []arrow.ArrayData, error) {
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
	datas := make([]arrow.ArrayData, 0, schema.NumFields())
	release := func() {
		for _, d := range datas {
			d.Release()
		}
	}
	for _, f := range schema.Fields() {
		d, err := l.load(f.Type, 0)
		if err != nil {
			release()
			return 0, nil, fmt.Errorf("column %s: %w", f.Name, err)
		}
		datas = append(datas, d)
	}
	if l.nextN != l.nodes.n || l.nextB != l.bufs.n {
		release()
		return 0, nil, fmt.Errorf("record batch has %d field nodes and %d buffers, the schema uses %d and %d",
			l.nodes.n, l.bufs.n, l.nextN, l.nextB)
	}
	return n, datas, nil
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
func (l *batchLoader) buffer() (*memory.Buffer, error) {
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
	return memory.NewBufferBytes(l.body[off : off+size : off+size]), nil
}

func (l *batchLoader) buffers(k int) ([]*memory.Buffer, error) {
	bufs := make([]*memory.Buffer, k)
	for i := range bufs {
		var err error
		if bufs[i], err = l.buffer(); err != nil {
			return nil, err
		}
	}
	return bufs, nil
}

// load reads the node, buffers and children of one field of type dt.
func (l *batchLoader) load(dt arrow.DataType, depth int) (arrow.ArrayData, error) {
	if depth > maxSchemaDepth {
		return nil, fmt.Errorf("nested deeper than %d", maxSchemaDepth)
	}
	n, nulls, err := l.node()
	if err != nil {
		return nil, err
	}
	nbufs := 2
	switch dt.ID() {
	case arrow.STRING:
		nbufs = 3
	case arrow.STRUCT:
		nbufs = 1
	}
	bufs, err := l.buffers(nbufs)
	if err != nil {
		return nil, err
	}
	if nulls == 0 {
		bufs[0] = nil // as the Arrow reader: no bitmap without nulls
	}
	var children []arrow.ArrayData
	releaseChildren := func() {
		for _, c := range children {
			c.Release()
		}
	}
	switch t := dt.(type) {
	case *arrow.ListType:
		c, err := l.load(t.Elem(), depth+1)
		if err != nil {
			return nil, err
		}
		children = append(children, c)
	case *arrow.StructType:
		for _, f := range t.Fields() {
			c, err := l.load(f.Type, depth+1)
			if err != nil {
				releaseChildren()
				return nil, err
			}
			children = append(children, c)
		}
	}
	d := array.NewData(dt, int(n), bufs, children, int(nulls), 0)
	releaseChildren()
	return d, nil
}
