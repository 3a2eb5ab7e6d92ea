package schemas

import (
	"fmt"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// PackedBatches is the codec of KindPackedBatch: one Arrow row per
// PackedRow; the batch-level fields (batch_id, batch_index, run_id,
// contract_hash, trainer_version, token_budget) are columns repeated on
// every row, and decoding checks that they are constant. A batch has at
// least one row: an empty batch could not carry its batch-level fields.
//
// Per-token columns (docs/PIPELINE.md §11, §12) are list<int32> for ids,
// list<float32> for log-probs, advantages and value targets, and
// list<uint8> for action_mask; ref_logprobs is nullable (null when the
// row's RefLogprobs is nil). Encoding copies each column's values once
// into one Arrow buffer; decoding copies each column once into one Go
// slice shared by the rows of the batch.
var PackedBatches = &PackedBatchCodec{codec: newCodec[packedEntry](KindPackedBatch)}

// PackedBatchCodec encodes a whole PackedBatch. It is safe for concurrent
// use.
type PackedBatchCodec struct {
	codec *Codec[packedEntry]
}

// batchHeader holds the batch-level fields of a PackedBatch, as columns.
type batchHeader struct {
	BatchID        string `json:"batch_id"`
	BatchIndex     int64  `json:"batch_index"`
	RunID          string `json:"run_id"`
	ContractHash   string `json:"contract_hash"`
	TrainerVersion int64  `json:"trainer_version"`
	TokenBudget    int32  `json:"token_budget"`
}

// packedEntry is one Arrow row: the batch-level columns, then the columns
// of one PackedRow.
type packedEntry struct {
	batchHeader
	PackedRow
}

func headerOf(b *PackedBatch) batchHeader {
	return batchHeader{b.BatchID, b.BatchIndex, b.RunID, b.ContractHash, b.TrainerVersion, b.TokenBudget}
}

// Kind is KindPackedBatch.
func (p *PackedBatchCodec) Kind() Kind { return p.codec.Kind() }

// Version is the schema version written and read.
func (p *PackedBatchCodec) Version() int { return p.codec.Version() }

// Schema is the Arrow schema of a packed batch.
func (p *PackedBatchCodec) Schema() *arrow.Schema { return p.codec.Schema() }

func (p *PackedBatchCodec) entries(b PackedBatch) ([]packedEntry, error) {
	if len(b.Rows) == 0 {
		return nil, fmt.Errorf("schemas: encode %s %q: batch has no rows", KindPackedBatch, b.BatchID)
	}
	hdr := headerOf(&b)
	es := make([]packedEntry, len(b.Rows))
	for i := range b.Rows {
		es[i] = packedEntry{hdr, b.Rows[i]}
	}
	return es, nil
}

// ToRecord builds the record batch of b (one row per PackedRow). The
// caller releases it; b must not be modified while it is alive.
func (p *PackedBatchCodec) ToRecord(mem memory.Allocator, b PackedBatch) (arrow.RecordBatch, error) {
	es, err := p.entries(b)
	if err != nil {
		return nil, err
	}
	return p.codec.ToRecord(mem, es)
}

// Encode returns b as one Arrow IPC stream.
func (p *PackedBatchCodec) Encode(mem memory.Allocator, b PackedBatch) ([]byte, error) {
	es, err := p.entries(b)
	if err != nil {
		return nil, err
	}
	return p.codec.Encode(mem, es)
}

// EncodePooled is Encode into a pooled buffer (see Codec.EncodePooled).
func (p *PackedBatchCodec) EncodePooled(b PackedBatch) ([]byte, func(), error) {
	es, err := p.entries(b)
	if err != nil {
		return nil, nil, err
	}
	return p.codec.EncodePooled(es)
}

// FromRecord reads a packed batch from rec (see Codec.FromRecord).
func (p *PackedBatchCodec) FromRecord(rec arrow.RecordBatch) (PackedBatch, error) {
	es, err := p.codec.FromRecord(rec)
	if err != nil {
		return PackedBatch{}, err
	}
	return assemble(es)
}

// Decode reads a packed batch from one IPC stream written by Encode.
func (p *PackedBatchCodec) Decode(mem memory.Allocator, data []byte) (PackedBatch, error) {
	es, err := p.codec.Decode(mem, data)
	if err != nil {
		return PackedBatch{}, err
	}
	return assemble(es)
}

// DecodeShared is Decode with the rows' token columns pointing into data
// (see Codec.DecodeShared): data must not be modified while the batch is
// in use, and the batch's values must not be modified in place.
func (p *PackedBatchCodec) DecodeShared(mem memory.Allocator, data []byte) (PackedBatch, error) {
	es, err := p.codec.DecodeShared(mem, data)
	if err != nil {
		return PackedBatch{}, err
	}
	return assemble(es)
}

// assemble checks that the batch-level columns are constant and builds the
// batch.
func assemble(es []packedEntry) (PackedBatch, error) {
	if len(es) == 0 {
		return PackedBatch{}, fmt.Errorf("%w: %s: no rows", ErrDecode, KindPackedBatch)
	}
	hdr := es[0].batchHeader
	b := PackedBatch{
		BatchID: hdr.BatchID, BatchIndex: hdr.BatchIndex, RunID: hdr.RunID,
		ContractHash: hdr.ContractHash, TrainerVersion: hdr.TrainerVersion, TokenBudget: hdr.TokenBudget,
		Rows: make([]PackedRow, len(es)),
	}
	for i := range es {
		if es[i].batchHeader != hdr {
			return PackedBatch{}, fmt.Errorf("%w: %s: row %d has batch-level fields %+v, row 0 has %+v",
				ErrDecode, KindPackedBatch, i, es[i].batchHeader, hdr)
		}
		b.Rows[i] = es[i].PackedRow
	}
	return b, nil
}
