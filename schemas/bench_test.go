package schemas

import (
	"testing"

	"github.com/apache/arrow-go/v18/arrow/memory"
)

// The packed-batch benchmarks use one global batch of 16 rows of 32768
// tokens with every per-token column present. b.SetBytes is the size of
// the per-token data (37 bytes a token), so the reported MB/s compare
// directly with BenchmarkMemcpy over the same byte count.

const benchRows, benchTokens = 16, 32768

func benchBatch() (PackedBatch, int64) {
	batch := PackedBatch{BatchID: "b", RunID: "run", TokenBudget: benchTokens}
	for i := range benchRows {
		row := samplePackedRow(benchTokens, int32(i), make([]float32, benchTokens))
		batch.Rows = append(batch.Rows, row)
	}
	const perToken = 9*4 + 1 // nine 4-byte columns and action_mask
	return batch, int64(benchRows * benchTokens * perToken)
}

func BenchmarkPackedBatchEncode(b *testing.B) {
	batch, size := benchBatch()
	mem := memory.NewGoAllocator()
	b.SetBytes(size)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := PackedBatches.Encode(mem, batch); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkPackedBatchDecode(b *testing.B) {
	batch, size := benchBatch()
	mem := memory.NewGoAllocator()
	enc, err := PackedBatches.Encode(mem, batch)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(size)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := PackedBatches.Decode(mem, enc); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMemcpy is the baseline: one copy of the same number of bytes,
// into a reused buffer (prealloc) or a fresh one (alloc, as a decoder
// must).
func BenchmarkMemcpy(b *testing.B) {
	_, size := benchBatch()
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(i)
	}
	b.Run("prealloc", func(b *testing.B) {
		dst := make([]byte, size)
		b.SetBytes(size)
		for b.Loop() {
			copy(dst, src)
		}
	})
	b.Run("alloc", func(b *testing.B) {
		b.SetBytes(size)
		b.ReportAllocs()
		for b.Loop() {
			dst := make([]byte, size)
			copy(dst, src)
		}
	})
}

func BenchmarkTrajectoryRoundTrip(b *testing.B) {
	rows := sampleScored()
	mem := memory.NewGoAllocator()
	b.ReportAllocs()
	for b.Loop() {
		enc, err := ScoredTrajectories.Encode(mem, rows)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := ScoredTrajectories.Decode(mem, enc); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkScoredDecode decodes one message of scored trajectories two
// ways in the same run: the codec's loader (the batch mapped straight onto
// the known schema) and Arrow's IPC reader followed by the same column
// readers (the path of streams written by other tools).
func BenchmarkScoredDecode(b *testing.B) {
	rows := sampleScored()
	mem := memory.NewGoAllocator()
	enc, err := ScoredTrajectories.Encode(mem, rows)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("loader", func(b *testing.B) {
		b.SetBytes(int64(len(enc)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := ScoredTrajectories.DecodeShared(mem, enc); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("arrow-reader", func(b *testing.B) {
		b.SetBytes(int64(len(enc)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := ScoredTrajectories.rows.DecodeArrow(mem, enc, true); err != nil {
				b.Fatal(err)
			}
		}
	})
}
