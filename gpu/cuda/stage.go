package cuda

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

// Staged describes a batch written into a staging buffer by StageBatch or
// StageRecord. Its slices are reused by the next call that receives the
// same *Staged (no allocation once they are large enough).
type Staged struct {
	Layout Layout
	// Den are the global denominators of the batch (objective.GlobalDenominators).
	Den objective.Denominators
	// HasRef reports whether the rows carry reference log-probs (all or
	// none of them must).
	HasRef bool
	// RowStart[r] is the first position of row r; RowStart[len] == T.
	RowStart []int
	// Versions are the rows' policy versions (aligned to targets), kept on
	// the host for lag statistics; not copied to the device.
	Versions []int32
	// views, rowDen and perSeg are reused scratch space.
	views  []rowView
	rowDen []objective.Denominators
	perSeg [][]int32
	// Segments is the number of packed segments (sum of SegLengths
	// entries, or of distinct segment ids when a record has none).
	Segments int
}

// rowView is one packed row as slices (of a Go PackedRow or of an Arrow
// record's column buffers).
type rowView struct {
	ids, pos, seg []int32
	mask          []uint8
	old, ref, adv []float32
	ver           []int32
	segs          int
}

// recordColumns are the list columns StageRecord reads.
var recordColumns = [...]string{"input_ids", "position_ids", "segment_ids", "action_mask",
	"old_logprobs", "ref_logprobs", "advantages", "policy_versions", "segment_lengths"}

const (
	cIDs = iota
	cPos
	cSeg
	cMask
	cOld
	cRef
	cAdv
	cVer
	cSegLen
)

func (st *Staged) rowViews(n int) []rowView {
	if cap(st.views) < n {
		st.views = make([]rowView, n)
	}
	st.views = st.views[:n]
	clear(st.views)
	return st.views
}

// StageBatch writes batch into dst in the Layout of its total position
// count (see Column for the columns), for a model of vocabulary V and the
// loss options opts (which fix the normalization weights). It validates
// what gpu.Trainer.Step validates: per-row lengths, position ids, mask
// values, segment ids, a target at every masked position, token ids in
// [0, V), at least one trained token. dst must hold st.Layout.Bytes bytes
// (PlanLayout of the total positions): when it is too small, the error
// wraps ErrBatch and st.Layout is still set, so the caller can grow dst
// (Capacity) and retry. On error the contents of dst are unspecified.
func StageBatch(batch schemas.PackedBatch, V int, opts objective.Options, dst []byte, st *Staged) error {
	views := st.rowViews(len(batch.Rows))
	for i := range batch.Rows {
		r := &batch.Rows[i]
		views[i] = rowView{ids: r.InputIDs, pos: r.PositionIDs, seg: r.SegmentIDs, mask: r.ActionMask,
			old: r.OldLogprobs, ref: r.RefLogprobs, adv: r.Advantages, ver: r.PolicyVersions, segs: len(r.SegLengths)}
	}
	return stage(batch.BatchID, views, V, opts, dst, st)
}

// StageRecord is StageBatch reading a packed-batch Arrow record
// (schemas.PackedBatches.ToRecord, or a decoded IPC stream) directly: the
// per-token values are copied from the record's column buffers into dst
// without building Go rows. rec is not retained.
func StageRecord(rec arrow.RecordBatch, V int, opts objective.Options, dst []byte, st *Staged) error {
	var cols [len(recordColumns)]*array.List
	for ci, name := range recordColumns {
		idx := rec.Schema().FieldIndices(name)
		if len(idx) != 1 {
			return fmt.Errorf("%w: record has %d columns named %q", ErrBatch, len(idx), name)
		}
		l, ok := rec.Column(idx[0]).(*array.List)
		if !ok {
			return fmt.Errorf("%w: column %q is %s, want a list", ErrBatch, name, rec.Column(idx[0]).DataType())
		}
		cols[ci] = l
	}
	var bid string
	if idx := rec.Schema().FieldIndices("batch_id"); len(idx) == 1 && rec.NumRows() > 0 {
		if s, ok := rec.Column(idx[0]).(*array.String); ok {
			bid = s.Value(0)
		}
	}
	n := int(rec.NumRows())
	views := st.rowViews(n)
	for r := 0; r < n; r++ {
		v := &views[r]
		var err error
		if v.ids, err = listInt32(cols[cIDs], r); err == nil {
			if v.pos, err = listInt32(cols[cPos], r); err == nil {
				if v.seg, err = listInt32(cols[cSeg], r); err == nil {
					if v.mask, err = listUint8(cols[cMask], r); err == nil {
						if v.old, err = listFloat32(cols[cOld], r); err == nil {
							if v.adv, err = listFloat32(cols[cAdv], r); err == nil {
								v.ver, err = listInt32(cols[cVer], r)
							}
						}
					}
				}
			}
		}
		if err != nil {
			return fmt.Errorf("batch %s row %d: %w", bid, r, err)
		}
		if cols[cRef].IsValid(r) {
			if v.ref, err = listFloat32(cols[cRef], r); err != nil {
				return fmt.Errorf("batch %s row %d: %w", bid, r, err)
			}
			if v.ref == nil {
				v.ref = []float32{}
			}
		}
		sl := cols[cSegLen]
		if sl.IsValid(r) {
			s, e := sl.ValueOffsets(r)
			v.segs = int(e - s)
		}
	}
	return stage(bid, views, V, opts, dst, st)
}

// listRange returns the value range of row r of a list column; ok is
// false for a null list.
func listRange(l *array.List, r int, nvals int) (s, e int, err error) {
	if l.IsNull(r) {
		return 0, 0, nil
	}
	s64, e64 := l.ValueOffsets(r)
	if s64 < 0 || s64 > e64 || int(e64) > nvals {
		return 0, 0, fmt.Errorf("%w: list offsets [%d, %d) outside %d values", ErrBatch, s64, e64, nvals)
	}
	return int(s64), int(e64), nil
}

// listValues returns row r of a list column of primitive values as a
// sub-slice of the column's value buffer (no copy); nil for an empty or
// null list.
func listInt32(l *array.List, r int) ([]int32, error) {
	a, ok := l.ListValues().(*array.Int32)
	if !ok {
		return nil, fmt.Errorf("%w: list values of type %s, want int32", ErrBatch, l.ListValues().DataType())
	}
	v := a.Int32Values()
	s, e, err := listRange(l, r, len(v))
	if err != nil || s == e {
		return nil, err
	}
	return v[s:e:e], nil
}

func listUint8(l *array.List, r int) ([]uint8, error) {
	a, ok := l.ListValues().(*array.Uint8)
	if !ok {
		return nil, fmt.Errorf("%w: list values of type %s, want uint8", ErrBatch, l.ListValues().DataType())
	}
	v := a.Uint8Values()
	s, e, err := listRange(l, r, len(v))
	if err != nil || s == e {
		return nil, err
	}
	return v[s:e:e], nil
}

func listFloat32(l *array.List, r int) ([]float32, error) {
	a, ok := l.ListValues().(*array.Float32)
	if !ok {
		return nil, fmt.Errorf("%w: list values of type %s, want float32", ErrBatch, l.ListValues().DataType())
	}
	v := a.Float32Values()
	s, e, err := listRange(l, r, len(v))
	if err != nil || s == e {
		return nil, err
	}
	return v[s:e:e], nil
}

// checkView validates the shapes of one row as gpu.Trainer.Step does.
func checkView(v *rowView, V int) error {
	n := len(v.ids)
	if n == 0 {
		return fmt.Errorf("%w: empty row", ErrBatch)
	}
	for _, c := range []struct {
		name string
		l    int
	}{{"position_ids", len(v.pos)}, {"segment_ids", len(v.seg)}, {"action_mask", len(v.mask)},
		{"old_logprobs", len(v.old)}, {"advantages", len(v.adv)}, {"policy_versions", len(v.ver)}} {
		if c.l != n {
			return fmt.Errorf("%w: %d %s for %d input ids", ErrBatch, c.l, c.name, n)
		}
	}
	if v.ref != nil && len(v.ref) != n {
		return fmt.Errorf("%w: %d ref_logprobs for %d input ids", ErrBatch, len(v.ref), n)
	}
	if err := model.CheckPositions(v.pos, v.seg); err != nil {
		return fmt.Errorf("%w: %w", ErrBatch, err)
	}
	for i, t := range v.ids {
		if t < 0 || int(t) >= V {
			return fmt.Errorf("%w: token %d at position %d, vocab %d", ErrBatch, t, i, V)
		}
	}
	return nil
}

// typed views of a staging buffer column.
func i32(b []byte) []int32 {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Slice((*int32)(unsafe.Pointer(&b[0])), len(b)/4)
}

func f32(b []byte) []float32 {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4)
}

// ColumnBytes returns the bytes of column c of a buffer laid out by l.
func (l Layout) ColumnBytes(buf []byte, c Column) []byte {
	s, e := l.Span(c)
	return buf[s:e:e]
}

// Int32s returns column c (ColTokens, ColPositions, ColTargets) of buf as
// int32 values.
func (l Layout) Int32s(buf []byte, c Column) []int32 { return i32(l.ColumnBytes(buf, c)) }

// Float32s returns column c (ColWeights, ColOld, ColRef, ColAdv) of buf as
// float32 values.
func (l Layout) Float32s(buf []byte, c Column) []float32 { return f32(l.ColumnBytes(buf, c)) }

func stage(batchID string, views []rowView, V int, opts objective.Options, dst []byte, st *Staged) error {
	if V <= 0 {
		return fmt.Errorf("%w: vocab %d", ErrBatch, V)
	}
	if err := opts.Validate(); err != nil {
		return fmt.Errorf("cuda: stage batch %s: %w", batchID, err)
	}
	if len(views) == 0 {
		return fmt.Errorf("%w: batch %s has no rows", ErrBatch, batchID)
	}
	// Pass 1 (per row, in parallel for large batches): shapes and the
	// row's denominators.
	if cap(st.rowDen) < len(views) {
		st.rowDen = make([]objective.Denominators, len(views))
	}
	st.rowDen = st.rowDen[:len(views)]
	T := 0
	for r := range views {
		T += len(views[r].ids)
	}
	err := parallelRows(len(views), T, func(_, r int) error {
		v := &views[r]
		if err := checkView(v, V); err != nil {
			return fmt.Errorf("cuda: batch %s row %d: %w", batchID, r, err)
		}
		if (v.ref != nil) != (views[0].ref != nil) {
			return fmt.Errorf("%w: batch %s: reference log-probs in some rows only", ErrBatch, batchID)
		}
		d, err := objective.CountDenominators(v.mask, v.seg)
		if err != nil {
			return fmt.Errorf("%w: batch %s row %d: %w", ErrBatch, batchID, r, err)
		}
		st.rowDen[r] = d
		return nil
	})
	if err != nil {
		return err
	}
	st.RowStart = append(st.RowStart[:0], 0)
	st.Den = objective.Denominators{}
	st.Segments = 0
	for r := range views {
		st.Den = st.Den.Add(st.rowDen[r])
		st.Segments += views[r].segs
		st.RowStart = append(st.RowStart, st.RowStart[r]+len(views[r].ids))
	}
	if st.Den.Tokens == 0 {
		return fmt.Errorf("%w: batch %s has no trained token", ErrBatch, batchID)
	}
	st.HasRef = views[0].ref != nil
	if opts.KLPlacement == objective.KLLoss && !st.HasRef {
		return fmt.Errorf("%w: batch %s: kl_placement %q without reference log-probs", ErrBatch, batchID, objective.KLLoss)
	}
	st.Layout = PlanLayout(T)
	if len(dst) < st.Layout.Bytes {
		return fmt.Errorf("%w: %w: batch %s needs %d staging bytes, buffer has %d", ErrBatch, ErrSmallBuffer, batchID, st.Layout.Bytes, len(dst))
	}
	if uintptr(unsafe.Pointer(unsafe.SliceData(dst)))%4 != 0 {
		return fmt.Errorf("%w: staging buffer not 4-byte aligned", ErrBatch)
	}
	l := st.Layout
	tok, pos, tgt := l.Int32s(dst, ColTokens), l.Int32s(dst, ColPositions), l.Int32s(dst, ColTargets)
	w, old, ref, adv := l.Float32s(dst, ColWeights), l.Float32s(dst, ColOld), l.Float32s(dst, ColRef), l.Float32s(dst, ColAdv)
	mask := l.ColumnBytes(dst, ColMask)
	if cap(st.Versions) < T {
		st.Versions = make([]int32, T)
	}
	st.Versions = st.Versions[:T]
	// Pass 2 (per row, in parallel for large batches): the columns.
	workers := stageWorkers(len(views), T)
	if len(st.perSeg) < workers {
		st.perSeg = make([][]int32, workers)
	}
	return parallelRows(len(views), T, func(wk, r int) error {
		v := &views[r]
		o, n := st.RowStart[r], len(v.ids)
		copy(tok[o:o+n], v.ids)
		copy(pos[o:o+n], v.pos)
		copy(mask[o:o+n], v.mask)
		copy(old[o:o+n], v.old)
		copy(adv[o:o+n], v.adv)
		copy(st.Versions[o:o+n], v.ver)
		if st.HasRef {
			copy(ref[o:o+n], v.ref)
		} else {
			clear(ref[o : o+n])
		}
		// Targets (objective.ShiftTargets) and weights (objective.Compute).
		perSeg := st.perSeg[wk][:0]
		for i := 0; i < n; i++ {
			s := int(v.seg[i])
			for len(perSeg) <= s {
				perSeg = append(perSeg, 0)
			}
			if v.mask[i] == 1 {
				perSeg[s]++
			}
		}
		st.perSeg[wk] = perSeg
		for i := 0; i < n; i++ {
			y := objective.NoTarget
			if i+1 < n && v.seg[i] == v.seg[i+1] {
				y = v.ids[i+1]
			}
			tgt[o+i] = y
			if v.mask[i] != 1 {
				w[o+i] = 0
				continue
			}
			if y < 0 {
				return fmt.Errorf("%w: batch %s row %d: masked position %d has no target", ErrBatch, batchID, r, i)
			}
			w[o+i] = float32(opts.Weight(st.Den, perSeg[v.seg[i]]))
		}
		return nil
	})
}

// parallelMin is the batch size (positions) from which staging spreads
// rows over goroutines.
var parallelMin = 1 << 16

// stageWorkers is the number of goroutines parallelRows uses.
func stageWorkers(rows, T int) int {
	if T < parallelMin {
		return 1
	}
	return max(1, min(rows, runtime.GOMAXPROCS(0)))
}

// parallelRows calls fn(worker, r) for every row r, on stageWorkers
// goroutines (worker in [0, workers)), and returns the error of the
// lowest-numbered failing row, so the result does not depend on
// scheduling.
func parallelRows(rows, T int, fn func(worker, r int) error) error {
	workers := stageWorkers(rows, T)
	if workers == 1 {
		for r := 0; r < rows; r++ {
			if err := fn(0, r); err != nil {
				return err
			}
		}
		return nil
	}
	errs := make([]error, rows)
	var next atomic.Int64
	var wg sync.WaitGroup
	for wk := 0; wk < workers; wk++ {
		wg.Add(1)
		go func(wk int) {
			defer wg.Done()
			for {
				r := int(next.Add(1) - 1)
				if r >= rows {
					return
				}
				errs[r] = fn(wk, r)
			}
		}(wk)
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// bytesOf views words as bytes (an 8-byte aligned byte slice).
func bytesOf(words []uint64) []byte {
	if len(words) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), len(words)*8)
}
