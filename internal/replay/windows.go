package replay

import (
	"crypto/sha256"
	"fmt"
	"math"
	"reflect"
	"slices"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// rebuildWindows rebuilds each recorded window's batch from its admitted
// and filtered ids and the trainer version it recorded, and compares it
// with the recorded batch.
func rebuildWindows(c *contract.Contract, snap *parquet.Run, scored map[string]schemas.Scored, rep *Report) error {
	recorded, order, err := recordedBatches(snap.Topics["batches"])
	if err != nil {
		return err
	}
	rep.Batches = len(recorded)
	opts := c.Packing
	opts.BatchTokens, opts.BatchGroups = math.MaxInt, 0
	seen := map[string]bool{}
	for _, m := range snap.Topics["windows"] {
		rec, err := schemas.DecodeWindow(m.Value)
		if err != nil {
			return fmt.Errorf("replay: window record at offset %d: %w", m.Offset, err)
		}
		if rec.BatchID == "" || seen[rec.BatchID] {
			continue // a window closed without rows, or redelivered
		}
		seen[rec.BatchID] = true
		want, ok := recorded[rec.BatchID]
		if !ok {
			rep.fail(fmt.Sprintf("batch %s (index %d): in the window lineage but not in the batches topic", rec.BatchID, rec.BatchIndex))
			continue
		}
		got, err := rebuildBatch(opts, c.RunID, rec, scored)
		if err != nil {
			rep.fail(fmt.Sprintf("batch %s (index %d): %v", rec.BatchID, rec.BatchIndex, err))
			continue
		}
		if sha256.Sum256(got) == sha256.Sum256(want) {
			rep.Identical++
			continue
		}
		rep.fail(fmt.Sprintf("batch %s (index %d): %s", rec.BatchID, rec.BatchIndex, BatchDiff(want, got)))
	}
	for _, id := range order {
		if !seen[id] {
			rep.fail(fmt.Sprintf("batch %s: in the batches topic but no window record names it", id))
		}
	}
	return nil
}

// recordedBatches maps every recorded batch id to its bytes (the last copy
// of a redelivered batch), with the ids in order.
func recordedBatches(msgs []parquet.Message) (map[string][]byte, []string, error) {
	recorded := map[string][]byte{}
	var order []string
	for _, m := range msgs {
		id := string(m.Key)
		if id == "" {
			b, err := schemas.PackedBatches.Decode(nil, m.Value)
			if err != nil {
				return nil, nil, fmt.Errorf("replay: recorded batch at offset %d: %w", m.Offset, err)
			}
			id = b.BatchID
		}
		if _, dup := recorded[id]; !dup {
			order = append(order, id)
		}
		recorded[id] = m.Value
	}
	return recorded, order, nil
}

// rebuildBatch packs the records of one window as the live window did: the
// lag rule judged against the closing trainer version, the batch a pure
// function of the admitted set (pack.Window.Close).
func rebuildBatch(opts pack.Options, runID string, rec schemas.WindowRecord, scored map[string]schemas.Scored) ([]byte, error) {
	w, err := pack.NewWindow(opts, -1<<40) // no record is stale when added; Close judges
	if err != nil {
		return nil, err
	}
	ids := slices.Clone(rec.Admitted)
	for _, d := range rec.Filtered {
		ids = append(ids, d.RecordID)
	}
	slices.Sort(ids)
	for _, id := range ids {
		s, ok := scored[id]
		if !ok {
			return nil, fmt.Errorf("record %s of the window was not produced by the replayed stages", id)
		}
		res, err := w.Add(s)
		if err != nil {
			return nil, fmt.Errorf("record %s: %w", id, err)
		}
		if res.Outcome != pack.Admitted {
			return nil, fmt.Errorf("record %s: %s (%s) at replay, admitted to the recorded window", id, res.Outcome, res.Filter)
		}
	}
	batch, closed := w.Close(rec.BatchIndex, runID, rec.ContractHash, rec.TrainerVersion)
	var got []string
	for _, a := range closed.Admitted {
		got = append(got, a.RecordID)
	}
	want := slices.Clone(rec.Admitted)
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		return nil, fmt.Errorf("replay admitted %d records, the recorded window %d", len(got), len(want))
	}
	return schemas.PackedBatches.Encode(nil, batch)
}

// BatchDiff names the first field where two encoded batches differ.
func BatchDiff(want, got []byte) string {
	a, err := schemas.PackedBatches.Decode(nil, want)
	if err != nil {
		return fmt.Sprintf("recorded batch does not decode: %v", err)
	}
	b, err := schemas.PackedBatches.Decode(nil, got)
	if err != nil {
		return fmt.Sprintf("replayed batch does not decode: %v", err)
	}
	if d := firstDiff("", reflect.ValueOf(a), reflect.ValueOf(b)); d != "" {
		return d
	}
	return fmt.Sprintf("encodings differ (%d and %d bytes) with equal fields", len(want), len(got))
}

// firstDiff walks two values of one type and describes the first
// difference by its field path.
func firstDiff(path string, a, b reflect.Value) string {
	switch a.Kind() {
	case reflect.Struct:
		for i := range a.NumField() {
			f := a.Type().Field(i)
			name := f.Name
			if tag, ok := f.Tag.Lookup("json"); ok {
				name = tag
			}
			p := name
			if path != "" {
				p = path + "." + name
			}
			if d := firstDiff(p, a.Field(i), b.Field(i)); d != "" {
				return d
			}
		}
		return ""
	case reflect.Slice:
		if a.Len() != b.Len() {
			return fmt.Sprintf("field %s: recorded length %d, replayed %d", path, a.Len(), b.Len())
		}
		for i := range a.Len() {
			if d := firstDiff(fmt.Sprintf("%s[%d]", path, i), a.Index(i), b.Index(i)); d != "" {
				return d
			}
		}
		return ""
	case reflect.Float32, reflect.Float64:
		x, y := a.Float(), b.Float()
		if math.Float64bits(x) != math.Float64bits(y) && !(math.IsNaN(x) && math.IsNaN(y)) {
			return fmt.Sprintf("field %s: recorded %v, replayed %v", path, x, y)
		}
		return ""
	}
	if !reflect.DeepEqual(a.Interface(), b.Interface()) {
		return fmt.Sprintf("field %s: recorded %v, replayed %v", path, a.Interface(), b.Interface())
	}
	return ""
}
