package schemas

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
	"testing"
	"unsafe"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// nanBits is a NaN with a payload; a codec must keep it bit for bit.
var nanBits = math.Float32frombits(0x7fc01234)

func sampleTaskAttempts() []TaskAttempt {
	return []TaskAttempt{
		{AttemptID: AttemptID("run", "task-1", GroupID("run", "task-1", 0), 0, 0), RunID: "run", TaskID: "task-1",
			TaskVersion: "v3", Domain: "math", Split: SplitTrain, EnvVersion: "env-2", GroupID: GroupID("run", "task-1", 0),
			GroupSize: 8, Member: 0, Attempt: 0, Seed: -42, PolicyVersion: 7, ContractHash: "c0ffee", DispatchedAt: 1700000000000000},
		{AttemptID: "ünïcødé — 日本語 🚀", RunID: "", TaskID: "t\x00nul", Member: -1, Attempt: math.MaxInt32, Seed: math.MinInt64},
	}
}

func sampleTurns() []Turn {
	return []Turn{
		{Index: 0, PromptIDs: []int32{1, 2, 3, math.MaxInt32}, ActionIDs: []int32{10, 11}, ActionLogprobs: []float32{-0.5, -1.25},
			PolicyVersion: 3, Decision: DecisionOK, ObservationIDs: []int32{20, 21, 22}, Value: 0.5, GenLatencyUS: 1200, EnvLatencyUS: 30},
		// Semantically invalid but structurally valid: the decoder must not judge it.
		{Index: 1, PromptIDs: nil, ActionIDs: []int32{-7}, ActionLogprobs: []float32{nanBits, float32(math.Inf(-1)), 0},
			PolicyVersion: 4, Decision: DecisionDenied, DecisionReason: "écrire /etc/passwd", ObservationIDs: nil, Value: nanBits},
	}
}

func sampleTrajectories() []Trajectory {
	return []Trajectory{
		{RecordID: "a1", RunID: "run", TaskID: "task-1", TaskVersion: "v3", Domain: "code", Split: SplitEval, EnvVersion: "e",
			GroupID: "g", GroupSize: 4, Member: 2, Attempt: 1, Seed: 99, ContractHash: "h", SamplerID: "s", ParserVersion: "p1",
			TokenizerHash: "tok", Status: StatusCompleted, End: EndTruncated, EndReason: "max_turns", BootstrapValue: nanBits,
			Artifacts: `{"files":["a.go"],"note":"ß"}`, StartedAt: 1, FinishedAt: 2, Turns: sampleTurns()},
		{RecordID: "a2", Status: StatusInfra, Turns: nil},
		{RecordID: "a3", Turns: sampleTurns()[:1]},
	}
}

func sampleRewardComponents() []RewardComponent {
	return []RewardComponent{
		{TrajectoryID: "a1", Name: "pass@tests", Version: "2", Raw: 1, Weight: 0.5, Transform: "identity", Value: 0.5,
			Scope: ScopeTrajectory, Turn: -1, EvaluatorVersion: "ev1", Evidence: "3/3 ✓", Uncertainty: math.Float64frombits(0x7ff8000000000abc)},
		{TrajectoryID: "a1", Name: "format", Scope: ScopeSpan, Turn: 1, SpanStart: 0, SpanEnd: 5, Error: "judge timeout", Raw: math.Inf(1)},
	}
}

func sampleRewarded() []Rewarded {
	ts := sampleTrajectories()
	return []Rewarded{
		{Trajectory: ts[0], Rewards: sampleRewardComponents(), RewardTotal: 0.5},
		{Trajectory: ts[1], Rewards: nil, RewardTotal: math.NaN()},
		{Trajectory: ts[2], Rewards: sampleRewardComponents()[1:]},
	}
}

func sampleScored() []Scored {
	rs := sampleRewarded()
	return []Scored{
		{Rewarded: rs[0], TurnRewards: []float32{0, 1}, TurnReturns: []float32{1, 1}, TurnAdvantages: []float32{0.7, nanBits},
			TurnValueTargets: []float32{0.9, 1}, Group: GroupStats{Size: 3, Expected: 4, Mean: 0.25, Std: 0.5, Min: 0, Max: 1,
				Incomplete: true}, Estimator: "grpo", EstimatorVersion: "1"},
		{Rewarded: rs[1], Group: GroupStats{ZeroVar: true, Filtered: "zero_variance", Std: math.NaN()}, Estimator: "rloo"},
		{Rewarded: rs[2], TurnRewards: []float32{-1}},
	}
}

// samplePackedRow returns a row of n tokens whose values depend on seed.
func samplePackedRow(n int, seed int32, ref []float32) PackedRow {
	r := PackedRow{
		InputIDs: make([]int32, n), PositionIDs: make([]int32, n), SegmentIDs: make([]int32, n),
		ActionMask: make([]uint8, n), OldLogprobs: make([]float32, n), RefLogprobs: ref,
		Advantages: make([]float32, n), ValueTargets: make([]float32, n), TurnIDs: make([]int32, n), PolicyVersions: make([]int32, n),
		SegTrajectoryIDs: []string{fmt.Sprint("traj-", seed), "trajé-2"}, SegGroupIDs: []string{"g1", ""},
		SegPolicyVersions: []int64{int64(seed), math.MaxInt64}, SegLengths: []int32{int32(n / 2), int32(n - n/2)},
		SegWeights: []float32{1, nanBits}, SegTruncated: []bool{false, true},
	}
	for i := range n {
		v := int32(i) * (seed + 1)
		r.InputIDs[i], r.PositionIDs[i], r.SegmentIDs[i] = v, int32(i%(n/2+1)), int32(i*2/n)
		r.ActionMask[i] = uint8(i % 2)
		r.OldLogprobs[i], r.Advantages[i], r.ValueTargets[i] = -float32(i)/7, float32(seed)-float32(i), float32(i)
		r.TurnIDs[i], r.PolicyVersions[i] = int32(i%3)-1, v%5-1
	}
	return r
}

func samplePackedBatch() PackedBatch {
	return PackedBatch{
		BatchID: BatchID("run", 3), BatchIndex: 3, RunID: "run", ContractHash: "h", TrainerVersion: 12, TokenBudget: 64,
		Rows: []PackedRow{
			samplePackedRow(16, 1, []float32{}),
			samplePackedRow(9, 2, nil),
			samplePackedRow(5, 3, []float32{-1, nanBits, 0, 2, 3}),
		},
	}
}

// same reports whether a and b are equal with floats compared bit for bit
// and nil slices distinct from empty ones.
func same(a, b reflect.Value) bool {
	switch a.Kind() {
	case reflect.Struct:
		for i := range a.NumField() {
			if !same(a.Field(i), b.Field(i)) {
				return false
			}
		}
		return true
	case reflect.Slice:
		if a.IsNil() != b.IsNil() || a.Len() != b.Len() {
			return false
		}
		for i := range a.Len() {
			if !same(a.Index(i), b.Index(i)) {
				return false
			}
		}
		return true
	case reflect.Float32:
		return math.Float32bits(float32(a.Float())) == math.Float32bits(float32(b.Float()))
	case reflect.Float64:
		return math.Float64bits(a.Float()) == math.Float64bits(b.Float())
	default:
		return a.Interface() == b.Interface()
	}
}

func assertSame[T any](t *testing.T, what string, got, want T) {
	t.Helper()
	if !same(reflect.ValueOf(got), reflect.ValueOf(want)) {
		t.Fatalf("%s: round trip differs\n got %+v\nwant %+v", what, got, want)
	}
}

func newMem(t testing.TB) *memory.CheckedAllocator {
	mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
	t.Cleanup(func() { mem.AssertSize(t, 0) })
	return mem
}

// assertArrowBytes checks that b, the encoding of rows, is the stream
// Arrow's own writer produces for the record ToRecord builds of rows.
func assertArrowBytes[T any](t *testing.T, mem memory.Allocator, c *Codec[T], rows []T, b []byte) {
	t.Helper()
	rec, err := c.ToRecord(mem, rows)
	if err != nil {
		t.Fatalf("to record: %v", err)
	}
	defer rec.Release()
	want := writeRaw(t, mem, rec.Schema(), []arrow.RecordBatch{rec})
	if !bytes.Equal(b, want) {
		t.Fatalf("Encode wrote %d bytes that differ from the %d of Arrow's stream writer", len(b), len(want))
	}
}

// roundTrip checks Encode/Decode and ToRecord/FromRecord of rows, and
// that the decoded rows do not alias the encoded bytes.
func roundTrip[T any](t *testing.T, c *Codec[T], rows []T) {
	t.Helper()
	mem := newMem(t)
	b, err := c.Encode(mem, rows)
	if err != nil {
		t.Fatalf("encode: %v", err)
	}
	got, err := c.Decode(mem, b)
	if err != nil {
		t.Fatalf("decode: %v", err)
	}
	if len(rows) == 0 {
		if len(got) != 0 {
			t.Fatalf("decoded %d rows from an empty batch", len(got))
		}
	} else {
		assertSame(t, "Decode", got, rows)
	}
	// Encode reuses a cached schema message: its stream must be the one
	// Arrow's own stream writer produces.
	assertArrowBytes(t, mem, c, rows, b)
	shared, err := c.DecodeShared(mem, b)
	if err != nil {
		t.Fatalf("decode shared: %v", err)
	}
	if len(rows) > 0 {
		assertSame(t, "DecodeShared", shared, rows)
	}
	again, err := c.Encode(mem, shared)
	if err != nil {
		t.Fatalf("encode shared rows: %v", err)
	}
	if !bytes.Equal(again, b) {
		t.Fatalf("re-encoding shared rows gives %d bytes that differ from the %d decoded", len(again), len(b))
	}
	clear(b) // decoded rows must not alias the stream
	if len(rows) > 0 {
		assertSame(t, "Decode after clearing the input", got, rows)
	}

	rec, err := c.ToRecord(mem, rows)
	if err != nil {
		t.Fatalf("to record: %v", err)
	}
	defer rec.Release()
	if rec.NumRows() != int64(len(rows)) || !rec.Schema().Equal(c.Schema()) {
		t.Fatalf("record has %d rows, schema %v", rec.NumRows(), rec.Schema())
	}
	got, err = c.FromRecord(rec)
	if err != nil {
		t.Fatalf("from record: %v", err)
	}
	if len(rows) > 0 {
		assertSame(t, "FromRecord", got, rows)
	}
}

func TestRoundTrip(t *testing.T) {
	tests := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"task_attempt", func(t *testing.T) { roundTrip(t, TaskAttempts, sampleTaskAttempts()) }},
		{"task_attempt/empty", func(t *testing.T) { roundTrip(t, TaskAttempts, []TaskAttempt{}) }},
		{"task_attempt/nil", func(t *testing.T) { roundTrip(t, TaskAttempts, nil) }},
		{"trajectory", func(t *testing.T) { roundTrip(t, Trajectories, sampleTrajectories()) }},
		{"trajectory/one", func(t *testing.T) { roundTrip(t, Trajectories, sampleTrajectories()[:1]) }},
		{"trajectory/no-turns", func(t *testing.T) { roundTrip(t, Trajectories, sampleTrajectories()[1:2]) }},
		{"reward_component", func(t *testing.T) { roundTrip(t, RewardComponents, sampleRewardComponents()) }},
		{"rewarded", func(t *testing.T) { roundTrip(t, RewardedTrajectories, sampleRewarded()) }},
		{"scored", func(t *testing.T) { roundTrip(t, ScoredTrajectories, sampleScored()) }},
		{"scored/empty", func(t *testing.T) { roundTrip(t, ScoredTrajectories, []Scored{}) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, tt.run)
	}
}

// An empty non-nullable list is stored like a nil one and decodes as nil.
func TestEmptyListDecodesNil(t *testing.T) {
	mem := newMem(t)
	in := []Trajectory{{RecordID: "x", Turns: []Turn{{PromptIDs: []int32{}, ActionIDs: []int32{1}}}}}
	b, err := Trajectories.Encode(mem, in)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Trajectories.Decode(mem, b)
	if err != nil {
		t.Fatal(err)
	}
	if turn := got[0].Turns[0]; turn.PromptIDs != nil || len(turn.ActionIDs) != 1 {
		t.Fatalf("got prompt %#v action %#v", turn.PromptIDs, turn.ActionIDs)
	}
}

func TestPackedBatchRoundTrip(t *testing.T) {
	tests := []struct {
		name  string
		batch func() PackedBatch
	}{
		{"three-rows", samplePackedBatch},
		{"one-row", func() PackedBatch { b := samplePackedBatch(); b.Rows = b.Rows[2:]; return b }},
		{"empty-lists", func() PackedBatch {
			b := samplePackedBatch()
			b.Rows = []PackedRow{{RefLogprobs: []float32{}}, {}}
			return b
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mem := newMem(t)
			in := tt.batch()
			b, err := PackedBatches.Encode(mem, in)
			if err != nil {
				t.Fatal(err)
			}
			// The direct encoder writes the stream Arrow's writer writes
			// for the same record (nulls in ref_logprobs included).
			es, err := PackedBatches.entries(in)
			if err != nil {
				t.Fatal(err)
			}
			assertArrowBytes(t, mem, PackedBatches.codec, es, b)
			got, err := PackedBatches.Decode(mem, b)
			if err != nil {
				t.Fatal(err)
			}
			assertSame(t, "Decode", got, in)
			shared, err := PackedBatches.DecodeShared(mem, b)
			if err != nil {
				t.Fatal(err)
			}
			assertSame(t, "DecodeShared", shared, in)
			clear(b)
			assertSame(t, "Decode after clearing the input", got, in)

			rec, err := PackedBatches.ToRecord(mem, in)
			if err != nil {
				t.Fatal(err)
			}
			defer rec.Release()
			got, err = PackedBatches.FromRecord(rec)
			if err != nil {
				t.Fatal(err)
			}
			assertSame(t, "FromRecord", got, in)
		})
	}
}

func TestPackedBatchErrors(t *testing.T) {
	mem := newMem(t)
	if _, err := PackedBatches.Encode(mem, PackedBatch{BatchID: "b"}); err == nil {
		t.Fatal("encoding a batch without rows succeeded")
	}
	// A stream of zero rows is structurally valid Arrow but carries no batch.
	b, err := PackedBatches.codec.Encode(mem, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := PackedBatches.Decode(mem, b); !errors.Is(err, ErrDecode) {
		t.Fatalf("zero rows: got %v, want ErrDecode", err)
	}
	// Batch-level columns must be constant.
	batch := samplePackedBatch()
	es, err := PackedBatches.entries(batch)
	if err != nil {
		t.Fatal(err)
	}
	for _, mutate := range []func(h *batchHeader){
		func(h *batchHeader) { h.BatchID = "other" },
		func(h *batchHeader) { h.BatchIndex++ },
		func(h *batchHeader) { h.RunID = "other" },
		func(h *batchHeader) { h.ContractHash = "other" },
		func(h *batchHeader) { h.TrainerVersion++ },
		func(h *batchHeader) { h.TokenBudget++ },
	} {
		bad := append([]packedEntry(nil), es...)
		mutate(&bad[2].batchHeader)
		b, err := PackedBatches.codec.Encode(mem, bad)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := PackedBatches.Decode(mem, b); !errors.Is(err, ErrDecode) {
			t.Fatalf("inconsistent header %+v: got %v, want ErrDecode", bad[2].batchHeader, err)
		}
	}
}

// withMeta returns a copy of c whose schema carries the given metadata.
func withMeta[T any](c *Codec[T], keys, vals []string) *Codec[T] {
	return codecWith[T](c.kind, arrow.NewMetadata(keys, vals))
}

func TestKindAndVersionErrors(t *testing.T) {
	mem := newMem(t)
	traj, err := Trajectories.Encode(mem, sampleTrajectories())
	if err != nil {
		t.Fatal(err)
	}
	encodeAs := func(keys, vals []string) []byte {
		b, err := withMeta(TaskAttempts, keys, vals).Encode(mem, sampleTaskAttempts())
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	tests := []struct {
		name        string
		data        []byte
		decode      func([]byte) error
		gotKind     string
		gotVersion  string
		wantMessage string
	}{
		{"trajectory read as task attempt", traj, decodeWith(mem, TaskAttempts), "trajectory", "2",
			`schemas: message kind "trajectory", want "task_attempt"`},
		{"trajectory read as scored", traj, decodeWith(mem, ScoredTrajectories), "trajectory", "2",
			`schemas: message kind "trajectory", want "scored_trajectory"`},
		{"trajectory read as packed batch", traj, func(b []byte) error { _, err := PackedBatches.Decode(mem, b); return err },
			"trajectory", "2", `schemas: message kind "trajectory", want "packed_batch"`},
		{"version 2", encodeAs([]string{MetaKind, MetaVersion}, []string{"task_attempt", "2"}), decodeWith(mem, TaskAttempts),
			"task_attempt", "2", `schemas: task_attempt version "2" unknown (this build reads version 1)`},
		{"version not a number", encodeAs([]string{MetaKind, MetaVersion}, []string{"task_attempt", "one"}), decodeWith(mem, TaskAttempts),
			"task_attempt", "one", `schemas: task_attempt version "one" unknown (this build reads version 1)`},
		{"no version", encodeAs([]string{MetaKind}, []string{"task_attempt"}), decodeWith(mem, TaskAttempts),
			"task_attempt", "", `schemas: task_attempt version "" unknown (this build reads version 1)`},
		{"no metadata", encodeAs(nil, nil), decodeWith(mem, TaskAttempts), "", "",
			`schemas: message kind "", want "task_attempt"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.decode(tt.data)
			var ve *VersionError
			if !errors.As(err, &ve) {
				t.Fatalf("got %v, want *VersionError", err)
			}
			if errors.Is(err, ErrDecode) {
				t.Fatalf("version error %v wraps ErrDecode", err)
			}
			if ve.GotKind != tt.gotKind || ve.Got != tt.gotVersion || ve.Known != Versions[ve.WantKind] || err.Error() != tt.wantMessage {
				t.Fatalf("got %#v (%q)", ve, err)
			}
		})
	}
}

func decodeWith[T any](mem memory.Allocator, c *Codec[T]) func([]byte) error {
	return func(b []byte) error { _, err := c.Decode(mem, b); return err }
}

func TestFromRecordChecksKind(t *testing.T) {
	mem := newMem(t)
	rec, err := TaskAttempts.ToRecord(mem, sampleTaskAttempts())
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Release()
	var ve *VersionError
	if _, err := Trajectories.FromRecord(rec); !errors.As(err, &ve) {
		t.Fatalf("got %v, want *VersionError", err)
	}
}

func TestPeekKind(t *testing.T) {
	mem := newMem(t)
	encs := map[Kind]func() ([]byte, error){
		KindTaskAttempt:     func() ([]byte, error) { return TaskAttempts.Encode(mem, sampleTaskAttempts()) },
		KindTrajectory:      func() ([]byte, error) { return Trajectories.Encode(mem, sampleTrajectories()) },
		KindRewardComponent: func() ([]byte, error) { return RewardComponents.Encode(mem, sampleRewardComponents()) },
		KindRewarded:        func() ([]byte, error) { return RewardedTrajectories.Encode(mem, sampleRewarded()) },
		KindScored:          func() ([]byte, error) { return ScoredTrajectories.Encode(mem, sampleScored()) },
		KindPackedBatch:     func() ([]byte, error) { return PackedBatches.Encode(mem, samplePackedBatch()) },
	}
	for kind, enc := range encs {
		b, err := enc()
		if err != nil {
			t.Fatal(err)
		}
		got, v, err := PeekKind(b)
		if err != nil || got != kind || v != Versions[kind] {
			t.Fatalf("PeekKind = %q %d %v, want %q %d", got, v, err, kind, Versions[kind])
		}
		// Only the schema message is read: the rest may be cut off.
		head := b[:8+binary.LittleEndian.Uint32(b[4:])] // continuation, length, schema flatbuffer
		if got, _, err := PeekKind(head); err != nil || got != kind {
			t.Fatalf("PeekKind of the schema message alone = %q %v", got, err)
		}
	}
	for _, bad := range [][]byte{nil, []byte("garbage!"), {0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0}} {
		if _, _, err := PeekKind(bad); !errors.Is(err, ErrDecode) {
			t.Fatalf("PeekKind(%q) = %v, want ErrDecode", bad, err)
		}
	}
}

func TestNilAllocator(t *testing.T) {
	b, err := Trajectories.Encode(nil, sampleTrajectories())
	if err != nil {
		t.Fatal(err)
	}
	got, err := Trajectories.Decode(nil, b)
	if err != nil {
		t.Fatal(err)
	}
	assertSame(t, "nil allocator", got, sampleTrajectories())
	pb, err := PackedBatches.Encode(nil, samplePackedBatch())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := PackedBatches.Decode(nil, pb); err != nil {
		t.Fatal(err)
	}
}

// listRow is a row type with top-level fixed-width lists for the sharing
// tests below.
type listRow struct {
	ID  string    `json:"id"`
	IDs []int32   `json:"ids"`
	LP  []float32 `json:"lp"`
}

// valuesAddr is the address of the values buffer of list column i.
func valuesAddr(rec arrow.RecordBatch, i int) uintptr {
	b := rec.Column(i).Data().Children()[0].Buffers()[1].Bytes()
	return uintptr(unsafe.Pointer(unsafe.SliceData(b)))
}

func TestToRecordSharesContiguousLists(t *testing.T) {
	c := newCodec[listRow]("list_row")
	ids := []int32{1, 2, 3, 4, 5, 6}
	lps := []float32{0.5, 0.25, 0.125, 1, 2, 3}
	base := uintptr(unsafe.Pointer(&ids[0]))
	tests := []struct {
		name  string
		rows  []listRow
		share bool // the ids buffer is ids itself
	}{
		{"back to back", []listRow{{"a", ids[0:2], lps[0:2]}, {"b", nil, nil}, {"c", ids[2:6], lps[2:6]}}, true},
		{"gap", []listRow{{"a", ids[0:2], lps[0:2]}, {"c", ids[3:6], lps[3:6]}}, false},
		{"reordered", []listRow{{"c", ids[2:6], lps[2:6]}, {"a", ids[0:2], lps[0:2]}}, false},
		{"one row", []listRow{{"a", ids[1:4], lps[1:4]}}, false}, // shares ids[1:], not ids[0:]
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mem := newMem(t)
			rec, err := c.ToRecord(mem, tt.rows)
			if err != nil {
				t.Fatal(err)
			}
			defer rec.Release()
			if got := valuesAddr(rec, 1) == base; got != tt.share {
				t.Errorf("ids buffer shares the rows' memory: %v, want %v", got, tt.share)
			}
			got, err := c.FromRecord(rec)
			if err != nil {
				t.Fatal(err)
			}
			assertSame(t, "FromRecord", got, tt.rows)
		})
	}
}

func TestDecodeSharedAliasesInput(t *testing.T) {
	c := newCodec[listRow]("list_row")
	rows := []listRow{{"a", []int32{7, 8}, []float32{1, 2}}, {"b", []int32{9}, []float32{3}}}
	b, err := c.Encode(nil, rows)
	if err != nil {
		t.Fatal(err)
	}
	copied, err := c.Decode(nil, b)
	if err != nil {
		t.Fatal(err)
	}
	shared, err := c.DecodeShared(nil, b)
	if err != nil {
		t.Fatal(err)
	}
	assertSame(t, "DecodeShared", shared, rows)
	// The values of "ids" lie in b: clearing b clears them in the shared
	// rows only (strings are always copied).
	clear(b)
	assertSame(t, "Decode after clearing the input", copied, rows)
	if shared[0].ID != "a" || shared[0].IDs[0] != 0 || shared[1].IDs[0] != 0 || shared[1].LP[0] != 0 {
		t.Fatalf("shared rows do not alias the input: %+v", shared)
	}
	// Re-encoding shared rows in order shares their memory again.
	b2, err := c.Encode(nil, rows)
	if err != nil {
		t.Fatal(err)
	}
	shared, err = c.DecodeShared(nil, b2)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := c.ToRecord(nil, shared)
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Release()
	if valuesAddr(rec, 1) != uintptr(unsafe.Pointer(&shared[0].IDs[0])) {
		t.Fatal("encoding shared rows copied the ids values")
	}
}

// TestEncodePooledDirtyBuffers: pooled buffers are not zeroed; a pooled
// encode into buffers full of ones writes the bytes of a fresh encode
// (validity bitmaps, padding and all).
func TestEncodePooledDirtyBuffers(t *testing.T) {
	b := samplePackedBatch()
	for i := range b.Rows { // large enough for the pool, with null and empty lists
		big := samplePackedRow(40000, int32(i), nil)
		big.RefLogprobs = b.Rows[i].RefLogprobs
		b.Rows[i] = big
	}
	want, err := PackedBatches.Encode(nil, b)
	if err != nil {
		t.Fatal(err)
	}
	// A pooled buffer, dirtied over its whole capacity and handed back,
	// serves the next pooled encode of the same size.
	dirty, release, err := PackedBatches.EncodePooled(b)
	if err != nil {
		t.Fatal(err)
	}
	dirty = dirty[:cap(dirty)]
	for i := range dirty {
		dirty[i] = 0xFF
	}
	release()
	got, release, err := PackedBatches.EncodePooled(b)
	if err != nil {
		t.Fatal(err)
	}
	if unsafe.SliceData(got) != unsafe.SliceData(dirty) {
		t.Fatal("the pooled encode did not use the dirty buffer")
	}
	if !bytes.Equal(got, want) {
		t.Fatal("a pooled encode into a dirty buffer differs from a fresh encode")
	}
	release()
	release() // a second call is a no-op: the buffer is pooled once
	c1, r1, _ := PackedBatches.EncodePooled(b)
	c2, r2, _ := PackedBatches.EncodePooled(b)
	defer r1()
	defer r2()
	if unsafe.SliceData(c1) == unsafe.SliceData(c2) {
		t.Fatal("one released buffer served two encodes")
	}
}

// TestEncodePooled: a pooled encode writes the same bytes as Encode, and a
// released buffer serves a later encode without leaking the old message
// into it.
func TestEncodePooled(t *testing.T) {
	rows := sampleScored()
	want, err := ScoredTrajectories.Encode(nil, rows)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		got, release, err := ScoredTrajectories.EncodePooled(rows[:len(rows)-i%2])
		if err != nil {
			t.Fatal(err)
		}
		w := want
		if i%2 == 1 {
			if w, err = ScoredTrajectories.Encode(nil, rows[:len(rows)-1]); err != nil {
				t.Fatal(err)
			}
		}
		if !bytes.Equal(got, w) {
			t.Fatalf("round %d: pooled encode differs from Encode (%d vs %d bytes)", i, len(got), len(w))
		}
		release()
	}
	b := samplePackedBatch()
	wantB, err := PackedBatches.Encode(nil, b)
	if err != nil {
		t.Fatal(err)
	}
	gotB, release, err := PackedBatches.EncodePooled(b)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(gotB, wantB) {
		t.Fatal("pooled packed batch differs from Encode")
	}
	release()
}
