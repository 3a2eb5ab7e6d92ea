package schemas

import (
	"fmt"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/trajflow/trajflow/schemas/internal/rowipc"
)

// A message on a data-plane topic is one IPC stream of one record batch,
// and Decode reads exactly that: a stream with a second batch is refused,
// because a Kafka record holds one message. A file of many messages of one
// kind — what `trajflow stage NAME --out F` writes, one record batch per
// output message — is one IPC stream of many record batches: Arrow's own
// readers (pyarrow.ipc.open_stream, arrow-go's ipc.NewReader) read it as
// is, and SplitStream cuts it back into the messages it holds, each
// readable by Decode (DecodeAll does both).

// SplitStream splits an Arrow IPC stream of one schema and any number of
// record batches into one stream per batch: the schema message, that
// batch and the end-of-stream marker, each a message Codec.Decode reads.
// b must end with the end-of-stream marker: a stream cut between two
// record batches is an error, never a shorter stream. The parts are new
// slices; b is not retained.
// Framing errors wrap ErrDecode and name the byte where they were found;
// the batches themselves are checked by the decoder of their kind.
func SplitStream(b []byte) ([][]byte, error) {
	parts, err := rowipc.SplitBatches(b)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDecode, err)
	}
	return parts, nil
}

// SplitStreams is SplitStream for one or more streams written one after
// the other (several Kafka messages saved to one file).
func SplitStreams(b []byte) ([][]byte, error) {
	parts, err := rowipc.SplitStreams(b)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDecode, err)
	}
	return parts, nil
}

// DecodeAll reads every record batch of an IPC stream of many batches
// (SplitStream), each one message of rows.
func (c *Codec[T]) DecodeAll(mem memory.Allocator, b []byte) ([][]T, error) {
	parts, err := SplitStream(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", c.kind, err)
	}
	out := make([][]T, len(parts))
	for i, p := range parts {
		if out[i], err = c.Decode(mem, p); err != nil {
			return nil, fmt.Errorf("record batch %d: %w", i, err)
		}
	}
	return out, nil
}

// DecodeAll reads every packed batch of an IPC stream of many record
// batches (one PackedBatch each), such as the output file of `trajflow
// stage pack`; Decode reads a stream of exactly one.
func (p *PackedBatchCodec) DecodeAll(mem memory.Allocator, b []byte) ([]PackedBatch, error) {
	parts, err := SplitStream(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", KindPackedBatch, err)
	}
	out := make([]PackedBatch, len(parts))
	for i, part := range parts {
		if out[i], err = p.Decode(mem, part); err != nil {
			return nil, fmt.Errorf("record batch %d: %w", i, err)
		}
	}
	return out, nil
}
