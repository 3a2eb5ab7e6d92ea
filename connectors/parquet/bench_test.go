package parquet

import (
	"math/rand/v2"
	"os"
	"testing"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/schemas"
)

// benchTrajectories returns n groups of the synthetic heavy-tailed
// distribution (mean ~1000 tokens per episode) as trajectories-topic
// messages, and their token count.
func benchTrajectories(b *testing.B, n int) ([]Message, int64) {
	s := synth.Default()
	var msgs []Message
	var tokens int64
	for g := range int64(n) {
		rows := s.Group(g)
		for _, r := range rows {
			for _, t := range r.Turns {
				tokens += int64(len(t.PromptIDs) + len(t.ActionIDs) + len(t.ObservationIDs))
			}
		}
		v, err := schemas.Trajectories.Encode(nil, rows)
		if err != nil {
			b.Fatal(err)
		}
		msgs = append(msgs, Message{Offset: g, Key: []byte(rows[0].GroupID), Value: v})
	}
	return msgs, tokens
}

// benchBatches returns n packed batches of rows x budget tokens.
func benchBatches(b *testing.B, n, rows, budget int) ([]Message, int64) {
	r := rand.New(rand.NewPCG(1, 2))
	var msgs []Message
	for i := range n {
		pb := schemas.PackedBatch{BatchID: schemas.BatchID("bench", int64(i)), BatchIndex: int64(i), RunID: "bench", TokenBudget: int32(budget)}
		for range rows {
			row := schemas.PackedRow{}
			segs := 8
			for k := range budget {
				row.InputIDs = append(row.InputIDs, r.Int32N(32000))
				row.PositionIDs = append(row.PositionIDs, int32(k%(budget/segs)))
				row.SegmentIDs = append(row.SegmentIDs, int32(k/(budget/segs)))
				row.ActionMask = append(row.ActionMask, uint8(r.IntN(2)))
				row.OldLogprobs = append(row.OldLogprobs, -r.Float32()*4)
				row.Advantages = append(row.Advantages, r.Float32()-0.5)
				row.ValueTargets = append(row.ValueTargets, 0)
				row.TurnIDs = append(row.TurnIDs, int32(k%7))
				row.PolicyVersions = append(row.PolicyVersions, 3)
			}
			for k := range segs {
				row.SegTrajectoryIDs = append(row.SegTrajectoryIDs, schemas.DerivedID("t", string(rune('a'+k))))
				row.SegGroupIDs = append(row.SegGroupIDs, "g")
				row.SegPolicyVersions = append(row.SegPolicyVersions, 3)
				row.SegLengths = append(row.SegLengths, int32(budget/segs))
				row.SegWeights = append(row.SegWeights, 1)
				row.SegTruncated = append(row.SegTruncated, false)
			}
			pb.Rows = append(pb.Rows, row)
		}
		v, err := schemas.PackedBatches.Encode(nil, pb)
		if err != nil {
			b.Fatal(err)
		}
		msgs = append(msgs, Message{Offset: int64(i), Key: []byte(pb.BatchID), Value: v})
	}
	return msgs, int64(n * rows * budget)
}

func benchWrite(b *testing.B, topic string, msgs []Message, tokens int64) {
	var size int64
	for _, m := range msgs {
		size += int64(len(m.Value))
	}
	dir := b.TempDir()
	t := Target{Dir: dir, Run: "bench", Topic: "bench." + topic}
	b.SetBytes(size)
	b.ReportAllocs()
	b.ResetTimer()
	var onDisk int64
	for range b.N {
		path, _, err := WriteFile(t, 0, msgs, WriteOptions{})
		if err != nil {
			b.Fatal(err)
		}
		st, err := os.Stat(path)
		if err != nil {
			b.Fatal(err)
		}
		onDisk = st.Size()
	}
	b.ReportMetric(float64(tokens)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
	b.ReportMetric(float64(onDisk)/float64(size), "disk/raw")
}

func benchRead(b *testing.B, topic string, msgs []Message, tokens int64) {
	var size int64
	for _, m := range msgs {
		size += int64(len(m.Value))
	}
	t := Target{Dir: b.TempDir(), Run: "bench", Topic: "bench." + topic}
	path, _, err := WriteFile(t, 0, msgs, WriteOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(size)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		_, got, err := ReadFile(path, ReadOptions{})
		if err != nil {
			b.Fatal(err)
		}
		if len(got) != len(msgs) {
			b.Fatalf("%d messages read, %d written", len(got), len(msgs))
		}
	}
	b.ReportMetric(float64(tokens)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
}

// BenchmarkSnapshotWrite measures writing one snapshot file (pqarrow,
// zstd, lineage, sha256 sidecar, fsync) from Kafka message values; MB/s
// counts the message bytes.
func BenchmarkSnapshotWrite(b *testing.B) {
	b.Run("trajectories", func(b *testing.B) {
		msgs, tokens := benchTrajectories(b, 256)
		benchWrite(b, "trajectories", msgs, tokens)
	})
	b.Run("batches", func(b *testing.B) {
		msgs, tokens := benchBatches(b, 8, 8, 8192)
		benchWrite(b, "batches", msgs, tokens)
	})
}

// BenchmarkReplayRead measures reading one snapshot file back as replay
// does: sidecar checksum, Parquet decode, and every message re-encoded and
// checked against its sha256.
func BenchmarkReplayRead(b *testing.B) {
	b.Run("trajectories", func(b *testing.B) {
		msgs, tokens := benchTrajectories(b, 256)
		benchRead(b, "trajectories", msgs, tokens)
	})
	b.Run("batches", func(b *testing.B) {
		msgs, tokens := benchBatches(b, 8, 8, 8192)
		benchRead(b, "batches", msgs, tokens)
	})
}
