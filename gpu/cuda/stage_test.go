package cuda

import (
	"bytes"
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

func alignedBuf(n int) []byte {
	w := make([]uint64, (n+7)/8)
	return bytesOf(w)[:n]
}

func TestPlanLayout(t *testing.T) {
	for _, T := range []int{0, 1, 3, 63, 64, 65, 1000, 4096} {
		l := PlanLayout(T)
		prevEnd := 0
		for c := Column(0); c < numColumns; c++ {
			s, e := l.Span(c)
			if s%Align != 0 {
				t.Fatalf("T=%d %s at %d not aligned", T, c, s)
			}
			if s < prevEnd {
				t.Fatalf("T=%d %s at %d overlaps previous column ending %d", T, c, s, prevEnd)
			}
			if e-s != T*c.elemSize() {
				t.Fatalf("T=%d %s spans %d bytes", T, c, e-s)
			}
			prevEnd = e
		}
		if l.Bytes < prevEnd || l.Bytes%Align != 0 || l.Bytes > prevEnd+int(numColumns)*Align {
			t.Fatalf("T=%d: %d bytes for columns ending at %d", T, l.Bytes, prevEnd)
		}
	}
}

func TestCapacityGrow(t *testing.T) {
	c := Capacity{Quantum: 1024, Factor: 1.5}
	for _, tc := range []struct {
		have, need, want int
		grow             bool
	}{
		{0, 1, 1024, true},
		{1024, 1024, 1024, false},
		{1024, 1025, 2048, true},   // 1.5x = 1536 -> rounded to 2048
		{4096, 4097, 6144, true},   // 1.5x wins
		{4096, 20000, 20480, true}, // need wins
		{8192, 100, 8192, false},
	} {
		got, grow := c.Grow(tc.have, tc.need)
		if got != tc.want || grow != tc.grow {
			t.Errorf("Grow(%d, %d) = %d, %v; want %d, %v", tc.have, tc.need, got, grow, tc.want, tc.grow)
		}
		if got < tc.need {
			t.Errorf("Grow(%d, %d) = %d < need", tc.have, tc.need, got)
		}
	}
	// A bounded stream settles: at most a few growths, none after.
	have, grows := 0, 0
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 1000; i++ {
		n, g := DefaultCapacity().Grow(have, 1+rng.IntN(50<<20))
		if g {
			grows++
			have = n
		}
	}
	if grows > 4 {
		t.Fatalf("%d growths for a bounded stream", grows)
	}
}

func stageOK(t *testing.T, b schemas.PackedBatch, V int, opts objective.Options) ([]byte, *Staged) {
	t.Helper()
	st := &Staged{}
	err := StageBatch(b, V, opts, nil, st)
	if !errors.Is(err, ErrSmallBuffer) || !errors.Is(err, ErrBatch) {
		t.Fatalf("stage into nil buffer: %v, want ErrSmallBuffer", err)
	}
	buf := alignedBuf(st.Layout.Bytes)
	if err := StageBatch(b, V, opts, buf, st); err != nil {
		t.Fatal(err)
	}
	return buf, st
}

// TestStageBatchColumns checks every staged column against the rows and
// the reference definitions (objective.ShiftTargets, the normalization
// weights of objective.Compute), for the four normalizations.
func TestStageBatchColumns(t *testing.T) {
	const V = 50
	rng := rand.New(rand.NewPCG(7, 8))
	const normTokens = 1000
	for _, norm := range []string{objective.TokenMean, objective.SeqMeanTokenSum, objective.SeqMeanTokenMean, objective.TokenSum} {
		for _, withRef := range []bool{false, true} {
			b := randomBatch(rng, 4, 60, V, withRef, 3)
			opts := objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: norm, KLPlacement: objective.KLNone}
			if norm == objective.TokenSum {
				opts.NormTokens = normTokens
			}
			buf, st := stageOK(t, b, V, opts)
			den, err := objective.GlobalDenominators(b.Rows...)
			if err != nil {
				t.Fatal(err)
			}
			if st.Den != den || st.HasRef != withRef {
				t.Fatalf("den %+v ref %v, want %+v %v", st.Den, st.HasRef, den, withRef)
			}
			l := st.Layout
			tok, pos, tgt := l.Int32s(buf, ColTokens), l.Int32s(buf, ColPositions), l.Int32s(buf, ColTargets)
			w, old, ref, adv := l.Float32s(buf, ColWeights), l.Float32s(buf, ColOld), l.Float32s(buf, ColRef), l.Float32s(buf, ColAdv)
			mask := l.ColumnBytes(buf, ColMask)
			var wsum float64
			for r, row := range b.Rows {
				o := st.RowStart[r]
				want, _ := objective.ShiftTargets(row.InputIDs, row.SegmentIDs)
				perSeg := map[int32]int{}
				for i, m := range row.ActionMask {
					if m == 1 {
						perSeg[row.SegmentIDs[i]]++
					}
				}
				for i := range row.InputIDs {
					j := o + i
					if tok[j] != row.InputIDs[i] || pos[j] != row.PositionIDs[i] || tgt[j] != want[i] ||
						mask[j] != row.ActionMask[i] || old[j] != row.OldLogprobs[i] || adv[j] != row.Advantages[i] ||
						st.Versions[j] != row.PolicyVersions[i] {
						t.Fatalf("%s row %d pos %d: staged values differ from the row", norm, r, i)
					}
					if withRef && ref[j] != row.RefLogprobs[i] || !withRef && ref[j] != 0 {
						t.Fatalf("%s row %d pos %d: ref %v", norm, r, i, ref[j])
					}
					var ww float64
					if row.ActionMask[i] == 1 {
						switch norm {
						case objective.TokenMean:
							ww = 1 / float64(den.Tokens)
						case objective.SeqMeanTokenSum:
							ww = 1 / float64(den.Sequences)
						case objective.TokenSum:
							ww = 1.0 / normTokens
						default:
							ww = 1 / float64(perSeg[row.SegmentIDs[i]]*int(den.Sequences))
						}
					}
					if w[j] != float32(ww) {
						t.Fatalf("%s row %d pos %d: weight %v want %v", norm, r, i, w[j], ww)
					}
					wsum += float64(w[j])
				}
			}
			wantSum := 1.0
			switch norm {
			case objective.SeqMeanTokenSum:
				wantSum = float64(den.Tokens) / float64(den.Sequences)
			case objective.TokenSum:
				wantSum = float64(den.Tokens) / normTokens
			}
			if math.Abs(wsum-wantSum) > 1e-5*wantSum {
				t.Fatalf("%s: weights sum to %v, want %v", norm, wsum, wantSum)
			}
			if st.RowStart[len(b.Rows)] != l.T {
				t.Fatalf("row starts %v for T=%d", st.RowStart, l.T)
			}
		}
	}
}

// TestStageRecordMatchesBatch: staging the Arrow record of a batch gives
// the same bytes as staging the Go rows.
func TestStageRecordMatchesBatch(t *testing.T) {
	mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
	defer mem.AssertSize(t, 0)
	const V = 40
	rng := rand.New(rand.NewPCG(3, 4))
	opts := objective.Options{ClipLow: 0.2, ClipHigh: 0.28, Normalization: objective.SeqMeanTokenMean,
		KLPlacement: objective.KLLoss, KLEstimator: objective.K3, KLCoef: 0.1}
	for _, withRef := range []bool{true, false} {
		if !withRef {
			opts.KLPlacement, opts.KLEstimator, opts.KLCoef = objective.KLNone, "", 0
		}
		b := randomBatch(rng, 5, 80, V, withRef, 2)
		want, wst := stageOK(t, b, V, opts)
		rec, err := schemas.PackedBatches.ToRecord(mem, b)
		if err != nil {
			t.Fatal(err)
		}
		got := alignedBuf(len(want))
		var st Staged
		err = StageRecord(rec, V, opts, got, &st)
		rec.Release()
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatal("record staging differs from row staging")
		}
		if st.Den != wst.Den || st.HasRef != wst.HasRef || st.Segments != wst.Segments || len(st.RowStart) != len(wst.RowStart) {
			t.Fatalf("staged %+v, want %+v", st, wst)
		}
	}
}

func TestStageErrors(t *testing.T) {
	const V = 30
	base := func() schemas.PackedBatch { return randomBatch(rand.New(rand.NewPCG(9, 9)), 2, 30, V, false, 1) }
	opts := objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.TokenMean, KLPlacement: objective.KLNone}
	for _, tc := range []struct {
		name  string
		edit  func(*schemas.PackedBatch)
		opts  func(*objective.Options)
		vocab int
	}{
		{"no rows", func(b *schemas.PackedBatch) { b.Rows = nil }, nil, V},
		{"short mask", func(b *schemas.PackedBatch) { b.Rows[0].ActionMask = b.Rows[0].ActionMask[1:] }, nil, V},
		{"token out of vocab", func(b *schemas.PackedBatch) { b.Rows[1].InputIDs[3] = V }, nil, V},
		{"negative token", func(b *schemas.PackedBatch) { b.Rows[1].InputIDs[3] = -2 }, nil, V},
		{"bad positions", func(b *schemas.PackedBatch) { b.Rows[0].PositionIDs[0] = 1 }, nil, V},
		{"mask value 2", func(b *schemas.PackedBatch) { b.Rows[0].ActionMask[0] = 2 }, nil, V},
		{"masked last position", func(b *schemas.PackedBatch) {
			r := &b.Rows[0]
			r.ActionMask[len(r.ActionMask)-1] = 1
		}, nil, V},
		{"no trained token", func(b *schemas.PackedBatch) {
			for r := range b.Rows {
				clear(b.Rows[r].ActionMask)
			}
		}, nil, V},
		{"ref in one row only", func(b *schemas.PackedBatch) { b.Rows[1].RefLogprobs = make([]float32, len(b.Rows[1].InputIDs)) }, nil, V},
		{"kl loss without ref", nil, func(o *objective.Options) {
			o.KLPlacement, o.KLEstimator, o.KLCoef = objective.KLLoss, objective.K1, 0.1
		}, V},
		{"bad options", nil, func(o *objective.Options) { o.Normalization = "nope" }, V},
		{"zero vocab", nil, nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, o := base(), opts
			if tc.edit != nil {
				tc.edit(&b)
			}
			if tc.opts != nil {
				tc.opts(&o)
			}
			buf := alignedBuf(1 << 16)
			err := StageBatch(b, tc.vocab, o, buf, &Staged{})
			if err == nil {
				t.Fatal("no error")
			}
			if tc.name != "bad options" && !errors.Is(err, ErrBatch) {
				t.Fatalf("%v does not wrap ErrBatch", err)
			}
			if errors.Is(err, ErrSmallBuffer) {
				t.Fatalf("%v: unexpected ErrSmallBuffer", err)
			}
		})
	}
}

// batchFromBytes derives a packed batch from fuzz input: row count, per
// column lengths, token ids, position ids, segment ids, mask values and
// the presence of reference log-probs all come from the bytes, so most
// batches are malformed in some way.
func batchFromBytes(data []byte) schemas.PackedBatch {
	next := func() int {
		if len(data) == 0 {
			return 0
		}
		v := int(data[0])
		data = data[1:]
		return v
	}
	b := schemas.PackedBatch{BatchID: "f"}
	rows := 1 + next()%3
	for r := 0; r < rows; r++ {
		n := next() % 24
		ln := func() int {
			if next()%8 == 0 {
				return next() % 24
			}
			return n
		}
		var row schemas.PackedRow
		row.InputIDs = make([]int32, ln())
		for i := range row.InputIDs {
			row.InputIDs[i] = int32(next()%24) - 2
		}
		row.PositionIDs = make([]int32, ln())
		row.SegmentIDs = make([]int32, ln())
		seg, pos := int32(0), int32(0)
		for i := range row.PositionIDs {
			if i > 0 && next()%4 == 0 {
				seg, pos = seg+1, 0
			}
			row.PositionIDs[i], pos = pos, pos+1
			if i < len(row.SegmentIDs) {
				row.SegmentIDs[i] = seg
			}
		}
		row.ActionMask = make([]uint8, ln())
		for i := range row.ActionMask {
			row.ActionMask[i] = uint8(next() % 3)
		}
		row.OldLogprobs = make([]float32, ln())
		row.Advantages = make([]float32, ln())
		row.PolicyVersions = make([]int32, ln())
		if next()%2 == 0 {
			row.RefLogprobs = make([]float32, ln())
		}
		b.Rows = append(b.Rows, row)
	}
	return b
}

// FuzzStageRecord: whatever the record — decoded from arbitrary bytes by
// the packed-batch codec, or built from a fuzz-derived (mostly malformed)
// batch — StageRecord stages it or returns an error wrapping ErrBatch,
// never panics, and agrees with StageBatch on the same rows.
func FuzzStageRecord(f *testing.F) {
	mem := memory.NewGoAllocator()
	good := randomBatch(rand.New(rand.NewPCG(1, 1)), 2, 20, 20, true, 1)
	data, err := schemas.PackedBatches.Encode(mem, good)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(data)
	f.Add(data[:len(data)/2])
	f.Add([]byte{})
	f.Add([]byte{2, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22})
	opts := objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.SeqMeanTokenMean, KLPlacement: objective.KLNone}
	const V = 20
	f.Fuzz(func(t *testing.T, data []byte) {
		var batches []schemas.PackedBatch
		if b, err := schemas.PackedBatches.Decode(mem, data); err == nil {
			batches = append(batches, b)
		}
		batches = append(batches, batchFromBytes(data))
		for _, b := range batches {
			rec, err := schemas.PackedBatches.ToRecord(mem, b)
			if err != nil {
				continue
			}
			got, want := alignedBuf(1<<16), alignedBuf(1<<16)
			var gs, ws Staged
			errRec := StageRecord(rec, V, opts, got, &gs)
			rec.Release()
			errRows := StageBatch(b, V, opts, want, &ws)
			if (errRec == nil) != (errRows == nil) {
				t.Fatalf("record staging error %v, row staging error %v", errRec, errRows)
			}
			if errRec != nil {
				if !errors.Is(errRec, ErrBatch) {
					t.Fatalf("error %v does not wrap ErrBatch", errRec)
				}
				continue
			}
			for c := Column(0); c < numColumns; c++ {
				if !bytes.Equal(gs.Layout.ColumnBytes(got, c), ws.Layout.ColumnBytes(want, c)) {
					t.Fatalf("column %s differs between record and row staging", c)
				}
			}
		}
	})
}

func BenchmarkStageRecord(b *testing.B) {
	mem := memory.NewGoAllocator()
	batch := randomBatch(rand.New(rand.NewPCG(5, 6)), 64, 2048, 32000, false, 1)
	rec, err := schemas.PackedBatches.ToRecord(mem, batch)
	if err != nil {
		b.Fatal(err)
	}
	defer rec.Release()
	opts := objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.TokenMean, KLPlacement: objective.KLNone}
	var st Staged
	_ = StageRecord(rec, 32000, opts, nil, &st)
	buf := alignedBuf(st.Layout.Bytes)
	b.SetBytes(int64(st.Layout.Bytes))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := StageRecord(rec, 32000, opts, buf, &st); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(st.Layout.T), "tokens/batch")
}

// TestStageParallel: spreading rows over goroutines gives the same bytes
// as staging them one by one, and the error of the first bad row.
func TestStageParallel(t *testing.T) {
	defer func(m int) { parallelMin = m }(parallelMin)
	const V = 64
	b := randomBatch(rand.New(rand.NewPCG(12, 13)), 40, 200, V, true, 2)
	opts := objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.SeqMeanTokenMean, KLPlacement: objective.KLNone}
	parallelMin = 1 << 62
	seq, sst := stageOK(t, b, V, opts)
	parallelMin = 1
	if stageWorkers(len(b.Rows), sst.Layout.T) < 2 {
		t.Logf("GOMAXPROCS=1: the parallel path runs with one worker")
	}
	par, pst := stageOK(t, b, V, opts)
	for c := Column(0); c < numColumns; c++ {
		if !bytes.Equal(sst.Layout.ColumnBytes(seq, c), pst.Layout.ColumnBytes(par, c)) {
			t.Fatalf("column %s differs", c)
		}
	}
	if pst.Den != sst.Den || pst.Segments != sst.Segments {
		t.Fatalf("parallel %+v, sequential %+v", pst.Den, sst.Den)
	}
	// Two bad rows: the error names the first, whatever the scheduling.
	r5, r9 := &b.Rows[5], &b.Rows[9]
	r5.ActionMask[len(r5.ActionMask)-1] = 1
	r9.InputIDs[0] = V
	for i := 0; i < 20; i++ {
		err := StageBatch(b, V, opts, par, &Staged{})
		if err == nil || !strings.Contains(err.Error(), "row 9") {
			t.Fatalf("error %v, want the token error of row 9 (pass 1)", err)
		}
	}
	r9.InputIDs[0] = 1
	for i := 0; i < 20; i++ {
		err := StageBatch(b, V, opts, par, &Staged{})
		if err == nil || !strings.Contains(err.Error(), "row 5") {
			t.Fatalf("error %v, want the missing target of row 5 (pass 2)", err)
		}
	}
}
