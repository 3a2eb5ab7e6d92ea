package rowipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"unsafe"

	"github.com/apache/arrow-go/v18/arrow/ipc"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// This file checks the framing of an Arrow IPC stream before the Arrow
// reader sees it. The Arrow reader trusts counts and lengths in the message
// metadata: a garbage message can make it allocate by a claimed length, or
// follow flatbuffer offsets that wrap around into a cycle. The checks here
// bound every length by the bytes actually present, accept only the
// messages our encoder writes (one schema, one uncompressed record batch,
// the end-of-stream marker) and hand the reader messages that point into
// the input without copying it.

const (
	ipcContinuation = 0xFFFFFFFF
	msgSchema       = 1 // flatbuf.MessageHeaderSchema
	msgRecordBatch  = 3 // flatbuf.MessageHeaderRecordBatch
	maxSchemaDepth  = 32
)

// ipcMessage is one framed message: flatbuffer metadata and body, each
// with its capacity capped at its length. Arrow's reader slices a buffer
// of the body by the offset and length in the metadata, and Go slicing
// reaches up to the capacity: an uncapped body would let a buffer that
// lies past the body read the bytes after it (the next message, or
// whatever follows the stream in the caller's memory).
type ipcMessage struct {
	typ  byte
	meta []byte
	body []byte
}

// readFrame reads the message starting at b[pos:]. It returns eos=true for
// the end-of-stream marker: the continuation marker and a zero length (what
// the encoder and Arrow's writer write), or the legacy 4-byte zero length
// of streams written before Arrow 0.15, which Arrow's readers still accept.
// Bytes that end at a message boundary without either marker are a
// truncated stream, not an end: a writer cut off between two record
// batches leaves exactly that.
func readFrame(b []byte, pos int) (m ipcMessage, next int, eos bool, err error) {
	if len(b)-pos >= 4 && binary.LittleEndian.Uint32(b[pos:]) == 0 {
		return m, pos + 4, true, nil
	}
	if len(b)-pos < 8 {
		if len(b) == pos {
			return m, 0, false, fmt.Errorf("stream truncated at byte %d: no end-of-stream marker", pos)
		}
		return m, 0, false, fmt.Errorf("stream truncated at byte %d (message header)", pos)
	}
	if binary.LittleEndian.Uint32(b[pos:]) != ipcContinuation {
		return m, 0, false, fmt.Errorf("no IPC continuation marker at byte %d", pos)
	}
	metaLen := int64(int32(binary.LittleEndian.Uint32(b[pos+4:])))
	pos += 8
	if metaLen == 0 {
		return m, pos, true, nil
	}
	if metaLen < 8 || metaLen > int64(len(b)-pos) {
		return m, 0, false, fmt.Errorf("message metadata of %d bytes at byte %d, %d left", metaLen, pos, len(b)-pos)
	}
	m.meta = b[pos : pos+int(metaLen) : pos+int(metaLen)]
	pos += int(metaLen)
	root, err := fbRoot(m.meta)
	if err != nil {
		return m, 0, false, fmt.Errorf("message metadata: %w", err)
	}
	typ, err1 := root.u8(1)
	bodyLen, err2 := root.i64(3)
	if err := errors.Join(err1, err2); err != nil {
		return m, 0, false, fmt.Errorf("message metadata: %w", err)
	}
	m.typ = typ
	if bodyLen < 0 || bodyLen > int64(len(b)-pos) {
		return m, 0, false, fmt.Errorf("message body of %d bytes at byte %d, %d left", bodyLen, pos, len(b)-pos)
	}
	m.body = b[pos : pos+int(bodyLen) : pos+int(bodyLen)]
	pos += int(bodyLen)
	header, ok, err := root.table(2)
	if err == nil && !ok {
		err = fmt.Errorf("no header")
	}
	if err == nil {
		err = checkTables(root, 4, checkKeyValueFB) // message custom_metadata
	}
	if err == nil {
		switch m.typ {
		case msgSchema:
			err = checkSchemaFB(header)
		case msgRecordBatch:
			err = checkRecordBatchFB(header)
		default:
			err = fmt.Errorf("message type %d not supported (want schema or record batch)", m.typ)
		}
	}
	if err != nil {
		return m, 0, false, fmt.Errorf("message at byte %d: %w", pos-int(bodyLen)-int(metaLen)-8, err)
	}
	return m, pos, false, nil
}

// splitStream checks that b is exactly: schema message, one record batch,
// end-of-stream marker.
func splitStream(b []byte) (schema, batch ipcMessage, err error) {
	schema, pos, eos, err := readFrame(b, 0)
	if err != nil {
		return schema, batch, err
	}
	if eos || schema.typ != msgSchema {
		return schema, batch, fmt.Errorf("stream does not start with a schema message")
	}
	batch, err = batchAndEnd(b, pos)
	return schema, batch, err
}

// splitBatches checks that b is exactly: schema message, any number of
// record batches, end-of-stream marker.
func splitBatches(b []byte) (schema ipcMessage, batches []ipcMessage, err error) {
	schema, pos, eos, err := readFrame(b, 0)
	if err != nil {
		return schema, nil, err
	}
	if eos || schema.typ != msgSchema {
		return schema, nil, fmt.Errorf("stream does not start with a schema message")
	}
	for {
		m, next, eos, err := readFrame(b, pos)
		if err != nil {
			return schema, nil, err
		}
		if eos {
			if next != len(b) {
				return schema, nil, fmt.Errorf("%d bytes after the end-of-stream marker", len(b)-next)
			}
			return schema, batches, nil
		}
		if m.typ != msgRecordBatch {
			return schema, nil, fmt.Errorf("message at byte %d is not a record batch", pos)
		}
		batches = append(batches, m)
		pos = next
	}
}

// batchAndEnd checks that b[pos:] is exactly one record batch and the
// end-of-stream marker.
func batchAndEnd(b []byte, pos int) (batch ipcMessage, err error) {
	batch, pos, eos, err := readFrame(b, pos)
	if err != nil {
		return batch, err
	}
	if eos {
		return batch, fmt.Errorf("stream has no record batch")
	}
	if batch.typ != msgRecordBatch {
		return batch, fmt.Errorf("second message is not a record batch")
	}
	_, pos, eos, err = readFrame(b, pos)
	if err != nil {
		return batch, err
	}
	if !eos {
		return batch, fmt.Errorf("stream has more than one record batch")
	}
	if pos != len(b) {
		return batch, fmt.Errorf("%d bytes after the end-of-stream marker", len(b)-pos)
	}
	return batch, nil
}

func checkSchemaFB(t fbTable) error {
	if err := checkTables(t, 1, func(f fbTable) error { return checkFieldFB(f, 0) }); err != nil {
		return fmt.Errorf("schema fields: %w", err)
	}
	return checkTables(t, 2, checkKeyValueFB)
}

func checkFieldFB(t fbTable, depth int) error {
	if depth > maxSchemaDepth {
		return fmt.Errorf("schema nested deeper than %d", maxSchemaDepth)
	}
	if _, err := t.vector(0, 1); err != nil {
		return fmt.Errorf("field name: %w", err)
	}
	if _, ok, err := t.table(4); err != nil || ok {
		return fmt.Errorf("dictionary-encoded fields are not supported")
	}
	if _, _, err := t.table(3); err != nil {
		return fmt.Errorf("field type: %w", err)
	}
	if err := checkTables(t, 5, func(c fbTable) error { return checkFieldFB(c, depth+1) }); err != nil {
		return err
	}
	return checkTables(t, 6, checkKeyValueFB)
}

func checkKeyValueFB(t fbTable) error {
	if _, err := t.vector(0, 1); err != nil {
		return fmt.Errorf("metadata key: %w", err)
	}
	if _, err := t.vector(1, 1); err != nil {
		return fmt.Errorf("metadata value: %w", err)
	}
	return nil
}

func checkRecordBatchFB(t fbTable) error {
	if _, err := t.vector(1, 16); err != nil { // FieldNode structs
		return fmt.Errorf("field nodes: %w", err)
	}
	if _, err := t.vector(2, 16); err != nil { // Buffer structs
		return fmt.Errorf("buffers: %w", err)
	}
	if _, ok, err := t.table(3); err != nil || ok {
		return fmt.Errorf("compressed record batches are not supported")
	}
	if _, err := t.vector(4, 8); err != nil {
		return fmt.Errorf("variadic buffer counts: %w", err)
	}
	return nil
}

// checkTables checks each table of the vector of tables in field i.
func checkTables(t fbTable, i int, check func(fbTable) error) error {
	v, err := t.vector(i, 4)
	if err != nil {
		return err
	}
	for k := range v.n {
		e, err := fbIndirect(t.b, v.start+4*k)
		if err != nil {
			return err
		}
		if err := check(e); err != nil {
			return err
		}
	}
	return nil
}

// ---- a bounds-checked flatbuffer table reader ----

type fbTable struct {
	b      []byte
	pos    int
	vt     int
	vtSize int
}

type fbVector struct{ start, n int }

func le32(b []byte, p int) (uint32, bool) {
	if p < 0 || p+4 > len(b) {
		return 0, false
	}
	return binary.LittleEndian.Uint32(b[p:]), true
}

func fbRoot(b []byte) (fbTable, error) { return fbIndirect(b, 0) }

// fbIndirect follows the unsigned offset stored at p to a table. Offsets
// are added without wrap-around, so tables always lie after their parent.
func fbIndirect(b []byte, p int) (fbTable, error) {
	off, ok := le32(b, p)
	if !ok {
		return fbTable{}, fmt.Errorf("offset at %d out of range", p)
	}
	return fbTableAt(b, int64(p)+int64(off))
}

func fbTableAt(b []byte, pos int64) (fbTable, error) {
	if pos < 0 || pos+4 > int64(len(b)) {
		return fbTable{}, fmt.Errorf("table at %d out of range", pos)
	}
	soff, _ := le32(b, int(pos))
	vt := pos - int64(int32(soff))
	if vt < 0 || vt+4 > int64(len(b)) {
		return fbTable{}, fmt.Errorf("vtable at %d out of range", vt)
	}
	vtSize := int64(binary.LittleEndian.Uint16(b[vt:]))
	tblSize := int64(binary.LittleEndian.Uint16(b[vt+2:]))
	if vtSize < 4 || vt+vtSize > int64(len(b)) || pos+tblSize > int64(len(b)) {
		return fbTable{}, fmt.Errorf("table at %d larger than the buffer", pos)
	}
	return fbTable{b: b, pos: int(pos), vt: int(vt), vtSize: int(vtSize)}, nil
}

// fieldPos is the position of field i (size bytes), or -1 when absent.
// Presence follows the flatbuffers rule the Arrow reader applies (the
// field's vtable slot starts inside the vtable and is not zero); a present
// field that does not fit in the buffer is an error.
func (t fbTable) fieldPos(i int, size int) (int, error) {
	o := 4 + 2*i
	if o >= t.vtSize {
		return -1, nil
	}
	if t.vt+o+2 > len(t.b) {
		return -1, fmt.Errorf("vtable slot %d out of range", i)
	}
	rel := int(binary.LittleEndian.Uint16(t.b[t.vt+o:]))
	if rel == 0 {
		return -1, nil
	}
	if t.pos+rel+size > len(t.b) {
		return -1, fmt.Errorf("field %d out of range", i)
	}
	return t.pos + rel, nil
}

func (t fbTable) u8(i int) (byte, error) {
	p, err := t.fieldPos(i, 1)
	if p < 0 {
		return 0, err
	}
	return t.b[p], nil
}

func (t fbTable) i64(i int) (int64, error) {
	p, err := t.fieldPos(i, 8)
	if p < 0 {
		return 0, err
	}
	return int64(binary.LittleEndian.Uint64(t.b[p:])), nil
}

// table returns the table in field i; ok is false when the field is absent.
func (t fbTable) table(i int) (fbTable, bool, error) {
	p, err := t.fieldPos(i, 4)
	if p < 0 {
		return fbTable{}, false, err
	}
	sub, err := fbIndirect(t.b, p)
	return sub, err == nil, err
}

// vector returns the vector in field i (empty when absent) after checking
// that its n elements of elemSize bytes lie inside the buffer.
func (t fbTable) vector(i int, elemSize int) (fbVector, error) {
	p, err := t.fieldPos(i, 4)
	if p < 0 {
		return fbVector{}, err
	}
	off, _ := le32(t.b, p)
	at := int64(p) + int64(off)
	n, ok := le32(t.b, int(min(at, int64(len(t.b)))))
	if !ok {
		return fbVector{}, fmt.Errorf("vector at %d out of range", at)
	}
	if int64(n)*int64(elemSize) > int64(len(t.b))-at-4 {
		return fbVector{}, fmt.Errorf("vector of %d elements at %d exceeds the buffer", n, at)
	}
	return fbVector{start: int(at) + 4, n: int(n)}, nil
}

// ---- handing checked messages to the Arrow reader ----

// messageList is an ipc.MessageReader over messages already in memory.
type messageList struct {
	msgs []*ipc.Message
	next int
}

func (l *messageList) Message() (*ipc.Message, error) {
	if l.next >= len(l.msgs) {
		return nil, io.EOF
	}
	l.next++
	return l.msgs[l.next-1], nil
}

func (l *messageList) Retain()  {}
func (l *messageList) Release() {}

func (l *messageList) release() {
	for _, m := range l.msgs {
		m.Release()
	}
}

// aligned8 returns b, or an 8-byte aligned copy of b when b is not aligned,
// so Arrow buffers in it may be viewed as typed slices.
func aligned8(b []byte) []byte {
	if len(b) == 0 || uintptr(unsafe.Pointer(unsafe.SliceData(b)))%8 == 0 {
		return b
	}
	c := unsafeBytes(make([]uint64, (len(b)+7)/8))[:len(b):len(b)]
	copy(c, b)
	return c
}

// newMessageList wraps framed messages without copying their bytes, except
// a body that is not 8-byte aligned, which is copied so Arrow may view its
// buffers as typed slices.
func newMessageList(ms ...ipcMessage) *messageList {
	l := &messageList{}
	for _, m := range ms {
		body := aligned8(m.body)
		meta := m.meta
		if uintptr(unsafe.Pointer(unsafe.SliceData(meta)))%8 != 0 {
			meta = append(make([]byte, 0, len(meta)), meta...)
		}
		l.msgs = append(l.msgs, ipc.NewMessage(memory.NewBufferBytes(meta), memory.NewBufferBytes(body)))
	}
	return l
}

// SplitBatches cuts a stream of one schema message, any number of record
// batches and the end-of-stream marker into one stream per record batch
// (the schema message, that batch, the end-of-stream marker), each one that
// Decode reads. The marker is required: a stream cut between two record
// batches is an error, never a shorter stream. The parts are new slices.
func SplitBatches(b []byte) ([][]byte, error) {
	schema, pos, eos, err := readFrame(b, 0)
	if err != nil {
		return nil, err
	}
	if eos || schema.typ != msgSchema {
		return nil, fmt.Errorf("stream does not start with a schema message")
	}
	head := b[:pos]
	var parts [][]byte
	for {
		start := pos
		m, next, eos, err := readFrame(b, pos)
		if err != nil {
			return nil, fmt.Errorf("record batch %d: %w", len(parts), err)
		}
		if eos {
			if next != len(b) {
				return nil, fmt.Errorf("%d bytes after the end-of-stream marker", len(b)-next)
			}
			return parts, nil
		}
		if m.typ != msgRecordBatch {
			return nil, fmt.Errorf("message %d at byte %d is not a record batch", len(parts)+1, start)
		}
		part := make([]byte, 0, len(head)+(next-start)+len(ipcEOS))
		part = append(append(append(part, head...), b[start:next]...), ipcEOS...)
		parts = append(parts, part)
		pos = next
	}
}

// SplitStreams splits b, one or more streams written one after the other
// (each ending with its end-of-stream marker, as a tool that saves
// several Kafka messages to one file writes them), into one stream per
// record batch, as SplitBatches does for each stream. Errors name the
// stream and the byte where it begins.
func SplitStreams(b []byte) ([][]byte, error) {
	var parts [][]byte
	for k, pos := 0, 0; pos < len(b); k++ {
		end := pos
		for {
			_, next, eos, err := readFrame(b, end)
			if err != nil {
				return nil, fmt.Errorf("stream %d (at byte %d): %w", k, pos, err)
			}
			end = next
			if eos {
				break
			}
		}
		p, err := SplitBatches(b[pos:end])
		if err != nil {
			return nil, fmt.Errorf("stream %d (at byte %d): %w", k, pos, err)
		}
		parts = append(parts, p...)
		pos = end
	}
	return parts, nil
}

// MessageEnds returns the byte offset after each message of the stream b
// (the schema message, then every record batch), up to its end-of-stream
// marker or its last byte: where a stream of several messages may be cut.
func MessageEnds(b []byte) ([]int, error) {
	var ends []int
	for pos := 0; pos < len(b); {
		_, next, eos, err := readFrame(b, pos)
		if err != nil {
			return nil, err
		}
		if eos {
			break
		}
		ends = append(ends, next)
		pos = next
	}
	return ends, nil
}
