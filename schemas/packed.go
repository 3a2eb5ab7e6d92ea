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
// Per-token columns (pipeline §11, §12) are list<int32> for ids,
// list<float32> for log-probs, advantages and value targets, and
// list<uint8> for action_mask; ref_logprobs is nullable (null when the
// row's RefLogprobs is nil). Encoding copies each column's values once
// into one Arrow buffer; decoding copies each column once into one Go
// slice shared by the rows of the batch.
var PackedBatches = &PackedBatchCodec{codec: newCodec(KindPackedBatch, packedCols)}

// PackedBatchCodec encodes a whole PackedBatch. It is safe for concurrent
// use.
type PackedBatchCodec struct {
	codec *Codec[packedEntry]
}

// batchHeader holds the batch-level fields of a PackedBatch.
type batchHeader struct {
	BatchID        string
	BatchIndex     int64
	RunID          string
	ContractHash   string
	TrainerVersion int64
	TokenBudget    int32
}

// packedEntry is one Arrow row: the batch-level fields and one PackedRow.
type packedEntry struct {
	hdr batchHeader
	row PackedRow
}

func headerOf(b *PackedBatch) batchHeader {
	return batchHeader{b.BatchID, b.BatchIndex, b.RunID, b.ContractHash, b.TrainerVersion, b.TokenBudget}
}

var batchHeaderCols = []column[batchHeader]{
	str("batch_id", func(h *batchHeader) *string { return &h.BatchID }),
	i64("batch_index", func(h *batchHeader) *int64 { return &h.BatchIndex }),
	str("run_id", func(h *batchHeader) *string { return &h.RunID }),
	str("contract_hash", func(h *batchHeader) *string { return &h.ContractHash }),
	i64("trainer_version", func(h *batchHeader) *int64 { return &h.TrainerVersion }),
	i32("token_budget", func(h *batchHeader) *int32 { return &h.TokenBudget }),
}

var packedRowCols = []column[PackedRow]{
	listI32("input_ids", func(r *PackedRow) *[]int32 { return &r.InputIDs }),
	listI32("position_ids", func(r *PackedRow) *[]int32 { return &r.PositionIDs }),
	listI32("segment_ids", func(r *PackedRow) *[]int32 { return &r.SegmentIDs }),
	listU8("action_mask", func(r *PackedRow) *[]uint8 { return &r.ActionMask }),
	listF32("old_logprobs", func(r *PackedRow) *[]float32 { return &r.OldLogprobs }),
	nullableListF32("ref_logprobs", func(r *PackedRow) *[]float32 { return &r.RefLogprobs }),
	listF32("advantages", func(r *PackedRow) *[]float32 { return &r.Advantages }),
	listF32("value_targets", func(r *PackedRow) *[]float32 { return &r.ValueTargets }),
	listI32("turn_ids", func(r *PackedRow) *[]int32 { return &r.TurnIDs }),
	listI32("policy_versions", func(r *PackedRow) *[]int32 { return &r.PolicyVersions }),
	listOf("segment_trajectory_ids", str("item", self[string]), func(r *PackedRow) *[]string { return &r.SegTrajectoryIDs }),
	listOf("segment_group_ids", str("item", self[string]), func(r *PackedRow) *[]string { return &r.SegGroupIDs }),
	listI64("segment_policy_versions", func(r *PackedRow) *[]int64 { return &r.SegPolicyVersions }),
	listI32("segment_lengths", func(r *PackedRow) *[]int32 { return &r.SegLengths }),
	listF32("segment_weights", func(r *PackedRow) *[]float32 { return &r.SegWeights }),
	listOf("segment_truncated", boolean("item", self[bool]), func(r *PackedRow) *[]bool { return &r.SegTruncated }),
}

var packedCols = concatCols(
	liftCols(func(e *packedEntry) *batchHeader { return &e.hdr }, batchHeaderCols),
	liftCols(func(e *packedEntry) *PackedRow { return &e.row }, packedRowCols),
)

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
		es[i] = packedEntry{hdr: hdr, row: b.Rows[i]}
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

// assemble checks that the batch-level columns are constant and builds the
// batch.
func assemble(es []packedEntry) (PackedBatch, error) {
	if len(es) == 0 {
		return PackedBatch{}, fmt.Errorf("%w: %s: no rows", ErrDecode, KindPackedBatch)
	}
	hdr := es[0].hdr
	b := PackedBatch{
		BatchID: hdr.BatchID, BatchIndex: hdr.BatchIndex, RunID: hdr.RunID,
		ContractHash: hdr.ContractHash, TrainerVersion: hdr.TrainerVersion, TokenBudget: hdr.TokenBudget,
		Rows: make([]PackedRow, len(es)),
	}
	for i := range es {
		if es[i].hdr != hdr {
			return PackedBatch{}, fmt.Errorf("%w: %s: row %d has batch-level fields %+v, row 0 has %+v",
				ErrDecode, KindPackedBatch, i, es[i].hdr, hdr)
		}
		b.Rows[i] = es[i].row
	}
	return b, nil
}
