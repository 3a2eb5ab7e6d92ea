package pack

import (
	"math"
	"math/rand/v2"
	"reflect"
	"testing"
	"unsafe"

	"github.com/trajflow/trajflow/schemas"
)

// checkFirstFit verifies the first-fit-decreasing invariants: rows are
// opened by non-increasing segment lengths, a row's segments are in
// non-increasing length order, and when row j was opened by a segment of
// length s no earlier row had room for it (fills only grow, so every
// earlier row ends with more than budget-s tokens).
func checkFirstFit(t *testing.T, rows []schemas.PackedRow, budget int) {
	t.Helper()
	for j, row := range rows {
		for k := 1; k < len(row.SegLengths); k++ {
			if row.SegLengths[k] > row.SegLengths[k-1] {
				t.Fatalf("row %d: segment %d longer than segment %d", j, k, k-1)
			}
		}
		if j == 0 {
			continue
		}
		s := int(row.SegLengths[0])
		if int(rows[j-1].SegLengths[0]) < s {
			t.Fatalf("row %d opened by %d tokens after row %d opened by %d", j, s, j-1, rows[j-1].SegLengths[0])
		}
		for i := 0; i < j; i++ {
			if len(rows[i].InputIDs)+s <= budget {
				t.Fatalf("row %d (%d tokens) had room for the %d-token segment that opened row %d", i, len(rows[i].InputIDs), s, j)
			}
		}
	}
}

// TestPackProperties packs random trajectories drawn from several length
// distributions (fixed seeds) and checks every packing invariant against
// the naive per-token reference: no token lost or duplicated, positions
// restart, segment ids consistent, no cross-segment target, each row within
// the budget, first-fit order, and independence from input order.
func TestPackProperties(t *testing.T) {
	const budget = 4096
	dists := []struct {
		name string
		n    int
		draw func(r *rand.Rand) int
	}{
		{"uniform", 120, func(r *rand.Rand) int { return 1 + r.IntN(budget) }},
		{"small", 400, func(r *rand.Rand) int { return 1 + r.IntN(100) }},
		{"lognormal", 300, func(r *rand.Rand) int { return logNormalLength(r, 300, 1.2, 1, 3*budget) }},
		{"just over a third", 60, func(r *rand.Rand) int { return budget/3 + 1 }},
		{"near budget", 40, func(r *rand.Rand) int { return budget - r.IntN(64) }},
		{"bimodal", 200, func(r *rand.Rand) int {
			if r.IntN(4) == 0 {
				return budget/2 + r.IntN(budget/2)
			}
			return 1 + r.IntN(200)
		}},
		{"overlong", 50, func(r *rand.Rand) int { return budget + r.IntN(budget) }},
	}
	for _, stale := range []string{StaleDrop, StaleMaskTurns} {
		for di, d := range dists {
			t.Run(stale+"/"+d.name, func(t *testing.T) {
				r := rand.New(rand.NewPCG(uint64(di)+1, 7))
				o := Options{TokenBudget: budget, BatchTokens: 1, Overflow: OverflowTruncate, MaxLag: 1, StalePolicy: stale}
				const tv = 10
				var segs []Segment
				want := make(map[string]refColumns)
				for i := 0; i < d.n; i++ {
					s := randomScored(r, idOf(i), idOf(i/4), d.draw(r), tv)
					seg, f, err := Reconstruct(&s, tv, o)
					if err != nil {
						t.Fatal(err)
					}
					ref, rf := reference(&s, tv, o)
					if f != rf {
						t.Fatalf("%s: filter %q, reference %q", s.RecordID, f, rf)
					}
					if f == FilterNone {
						segs = append(segs, seg)
						want[s.RecordID] = ref
					}
				}
				if len(segs) == 0 {
					t.Fatal("every trajectory filtered: the distribution tests nothing")
				}
				rows, st := Pack(segs, budget)
				checkRows(t, rows, st, budget, want)
				checkFirstFit(t, rows, budget)
				if st.Rows < int(math.Ceil(float64(st.Tokens)/budget)) {
					t.Fatalf("%d rows cannot hold %d tokens", st.Rows, st.Tokens)
				}

				shuffled := append([]Segment(nil), segs...)
				r.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
				rows2, st2 := Pack(shuffled, budget)
				if st2 != st || !reflect.DeepEqual(rows2, rows) {
					t.Fatal("packing depends on the input order")
				}
				t.Logf("%d segments, %d rows, %d tokens, efficiency %.4f", st.Segments, st.Rows, st.Tokens, st.Efficiency)
			})
		}
	}
}

// TestPackTies checks that equal lengths are broken by trajectory id.
func TestPackTies(t *testing.T) {
	seg := func(id string, n int) Segment {
		return Segment{TrajectoryID: id, Tokens: make([]int32, n), Weight: 1, OldestVersion: -1}
	}
	// Budget 10: three 6-token segments each need their own row; the 4s
	// fill them in id order.
	in := []Segment{seg("c", 6), seg("a", 4), seg("b", 6), seg("d", 4), seg("a6", 6)}
	rows, st := Pack(in, 10)
	var got [][]string
	for _, r := range rows {
		got = append(got, r.SegTrajectoryIDs)
	}
	want := [][]string{{"a6", "a"}, {"b", "d"}, {"c"}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("placement %v, want %v", got, want)
	}
	if st.Rows != 3 || st.Tokens != 26 || st.Efficiency != 26.0/30 {
		t.Fatalf("stats %+v", st)
	}
}

// TestPackColumnsBackToBack checks that each token column of consecutive
// rows is one run of memory, which lets the batch encoder share it
// instead of copying 17 MB per batch.
func TestPackColumnsBackToBack(t *testing.T) {
	seg := func(id string, n int) Segment {
		return Segment{TrajectoryID: id, Tokens: make([]int32, n), Logprobs: make([]float32, n), Weight: 1, OldestVersion: -1}
	}
	rows, _ := Pack([]Segment{seg("a", 6), seg("b", 6), seg("c", 5), seg("d", 3)}, 10)
	if len(rows) < 2 {
		t.Fatalf("%d rows, want several", len(rows))
	}
	end := func(p unsafe.Pointer, n int, size uintptr) uintptr { return uintptr(p) + uintptr(n)*size }
	for r := 1; r < len(rows); r++ {
		prev, cur := &rows[r-1], &rows[r]
		n := len(prev.InputIDs)
		if end(unsafe.Pointer(&prev.InputIDs[0]), n, 4) != uintptr(unsafe.Pointer(&cur.InputIDs[0])) ||
			end(unsafe.Pointer(&prev.Advantages[0]), n, 4) != uintptr(unsafe.Pointer(&cur.Advantages[0])) ||
			end(unsafe.Pointer(&prev.ActionMask[0]), n, 1) != uintptr(unsafe.Pointer(&cur.ActionMask[0])) {
			t.Fatalf("row %d does not continue row %d in memory", r, r-1)
		}
	}
}

func TestPackEmpty(t *testing.T) {
	rows, st := Pack(nil, 8)
	if rows != nil || st != (Stats{Budget: 8, NewestTrained: -1, NewestOldest: -1}) {
		t.Fatalf("rows %v stats %+v", rows, st)
	}
}

func TestPackPreconditions(t *testing.T) {
	tests := []struct {
		name   string
		segs   []Segment
		budget int
	}{
		{"zero budget", []Segment{{Tokens: []int32{1}}}, 0},
		{"empty segment", []Segment{{TrajectoryID: "e"}}, 8},
		{"segment over budget", []Segment{{TrajectoryID: "o", Tokens: make([]int32, 9)}}, 8},
		{"span reaches the last position", []Segment{{TrajectoryID: "s", Tokens: make([]int32, 4),
			Spans: []Span{{At: 1, Len: 3}}, Logprobs: make([]float32, 3)}}, 8},
		{"span without log-probs", []Segment{{TrajectoryID: "s", Tokens: make([]int32, 4),
			Spans: []Span{{At: 0, Len: 2}}, Logprobs: make([]float32, 1)}}, 8},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Fatal("no panic")
				}
			}()
			Pack(tc.segs, tc.budget)
		})
	}
}

// TestPackRowsIndependent checks that appending to one row's slice never
// writes into the next row (rows share backing arrays).
func TestPackRowsIndependent(t *testing.T) {
	segs := []Segment{
		{TrajectoryID: "a", Tokens: []int32{1, 2, 3}, Weight: 1},
		{TrajectoryID: "b", Tokens: []int32{4, 5, 6}, Weight: 1},
	}
	rows, _ := Pack(segs, 4)
	if len(rows) != 2 {
		t.Fatalf("%d rows", len(rows))
	}
	_ = append(rows[0].InputIDs, 99)
	_ = append(rows[0].ActionMask, 1)
	_ = append(rows[0].SegTrajectoryIDs, "x")
	if rows[1].InputIDs[0] != 4 || rows[1].ActionMask[0] != 0 || rows[1].SegTrajectoryIDs[0] != "b" {
		t.Fatalf("appending to row 0 changed row 1: %+v", rows[1])
	}
}

// TestPackFFDEfficiency packs 4096 heavy-tailed (log-normal, mean ~1000,
// tail to 32768) segments into 32768-token rows. First fit guarantees that
// when the last row was opened by a segment of s tokens, every earlier row
// held more than budget-s tokens; that instance floor is asserted, the
// efficiency itself is reported.
func TestPackFFDEfficiency(t *testing.T) {
	const budget = 32768
	r := rand.New(rand.NewPCG(2026, 11))
	segs := make([]Segment, 4096)
	for i := range segs {
		segs[i] = Segment{TrajectoryID: idOf(i), Tokens: make([]int32, logNormalLength(r, 1000, 1.2, 16, budget)), Weight: 1}
	}
	rows, st := Pack(segs, budget)
	checkFirstFit(t, rows, budget)
	last := int(rows[len(rows)-1].SegLengths[0])
	floor := float64(len(rows)-1) / float64(len(rows)) * float64(budget-last) / budget
	lower := int(math.Ceil(float64(st.Tokens) / budget))
	t.Logf("lognormal: %d segments, %d tokens, %d rows (lower bound %d), efficiency %.4f, first-fit floor %.4f",
		st.Segments, st.Tokens, st.Rows, lower, st.Efficiency, floor)
	if st.Efficiency < floor {
		t.Fatalf("efficiency %.4f below the first-fit floor %.4f", st.Efficiency, floor)
	}
}

// TestPackIntoReusedColumns: packing into the arrays of earlier batches
// (a large one first, then smaller ones, with masked-stale context and
// multi-segment rows) gives the same rows as packing into fresh arrays:
// nothing of the earlier batch shows through.
func TestPackIntoReusedColumns(t *testing.T) {
	const budget, tv = 2048, 10
	r := rand.New(rand.NewPCG(3, 9))
	o := Options{TokenBudget: budget, BatchTokens: 1, Overflow: OverflowTruncate, MaxLag: 1, StalePolicy: StaleMaskTurns}
	var cols Columns
	for round, n := range []int{200, 60, 120, 5} {
		var segs []Segment
		for i := 0; i < n; i++ {
			s := randomScored(r, idOf(round*1000+i), idOf(i/4), logNormalLength(r, 200, 1.2, 1, budget), tv)
			seg, f, err := Reconstruct(&s, tv, o)
			if err != nil {
				t.Fatal(err)
			}
			if f == FilterNone {
				segs = append(segs, seg)
			}
		}
		want, wantSt := Pack(segs, budget)
		got, gotSt := PackInto(&cols, segs, budget)
		if !reflect.DeepEqual(got, want) || gotSt != wantSt {
			t.Fatalf("round %d (%d segments): rows packed into reused columns differ from fresh ones", round, len(segs))
		}
	}
}

// TestStatsNewestKept checks the version the lag rule judges a batch by,
// as PackInto records it from the spans, against NewestKept's scan of the
// packed columns: by hand where the two stale policies differ, then over
// random windows with stale and older turns.
func TestStatsNewestKept(t *testing.T) {
	// A: turns at versions 7 and 9; B: one turn at 8. Trainer 9, lag 2:
	// nothing stale. Newest trained 9; oldest per segment 7 (A) and 8 (B),
	// the newest of those 8.
	a := scored("A", "g1",
		turnSpec{prompt: []int32{1, 2}, action: []int32{3, 4}, logprobs: []float32{-1, -1}, version: 7, adv: 1},
		turnSpec{prompt: []int32{5}, action: []int32{6, 7}, logprobs: []float32{-1, -1}, version: 9, adv: 1},
	)
	b := scored("B", "g2", turnSpec{prompt: []int32{8}, action: []int32{9, 10}, logprobs: []float32{-1, -1}, version: 8, adv: 1})
	for _, tc := range []struct {
		policy string
		want   int64
	}{{StaleMaskTurns, 9}, {StaleDrop, 8}} {
		o := Options{TokenBudget: 16, BatchTokens: 16, Overflow: OverflowReject, MaxLag: 2, StalePolicy: tc.policy}
		var segs []Segment
		for _, s := range []schemas.Scored{a, b} {
			seg, f, err := Reconstruct(&s, 9, o)
			if err != nil || f != FilterNone {
				t.Fatalf("%s: filter %q err %v", s.RecordID, f, err)
			}
			segs = append(segs, seg)
		}
		rows, st := Pack(segs, 16)
		batch := schemas.PackedBatch{Rows: rows}
		if got, scan := st.NewestKept(tc.policy), NewestKept(&batch, tc.policy); got != tc.want || scan != tc.want {
			t.Errorf("%s: Stats.NewestKept %d, NewestKept %d, want %d", tc.policy, got, scan, tc.want)
		}
	}

	r := rand.New(rand.NewPCG(7, 11))
	for i := range 200 {
		policy := []string{StaleMaskTurns, StaleDrop}[i%2]
		o := Options{TokenBudget: 2048, BatchTokens: 2048, Overflow: OverflowTruncate, MaxLag: int64(r.IntN(2)), StalePolicy: policy}
		const tv = 20
		var segs []Segment
		for k := range 1 + r.IntN(12) {
			s := randomScored(r, idOf(k), idOf(k/4), 16+r.IntN(1500), tv)
			seg, f, err := Reconstruct(&s, tv, o)
			if err != nil {
				t.Fatal(err)
			}
			if f == FilterNone {
				segs = append(segs, seg)
			}
		}
		rows, st := Pack(segs, o.TokenBudget)
		batch := schemas.PackedBatch{Rows: rows}
		if got, want := st.NewestKept(policy), NewestKept(&batch, policy); got != want {
			t.Fatalf("window %d (%s, lag %d, %d segments): Stats.NewestKept %d, NewestKept %d", i, policy, o.MaxLag, len(segs), got, want)
		}
	}
}
