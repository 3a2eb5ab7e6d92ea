package pack

import (
	"errors"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"

	"github.com/trajflow/trajflow/internal/idset"
	"github.com/trajflow/trajflow/schemas"
)

func small(id, group string, version int64, n int) schemas.Scored {
	action := make([]int32, n)
	lps := make([]float32, n)
	for i := range action {
		action[i] = int32(100 + i)
		lps[i] = -float32(i+1) / 10
	}
	return scored(id, group, turnSpec{prompt: []int32{1, 2}, action: action, logprobs: lps, obs: []int32{3}, version: version, adv: 1})
}

func TestWindowDedup(t *testing.T) {
	o := testOptions()
	w, err := NewWindow(o, 5)
	if err != nil {
		t.Fatal(err)
	}
	s := small("a", "g", 5, 4) // 7 tokens
	res, err := w.Add(s)
	if err != nil || res.Outcome != Admitted || res.Tokens != 7 || res.Trained != 4 || res.Ready {
		t.Fatalf("first add: %+v %v", res, err)
	}
	res, err = w.Add(s)
	if err != nil || res.Outcome != Duplicate || w.Tokens() != 7 {
		t.Fatalf("second add: %+v %v (tokens %d)", res, err, w.Tokens())
	}
	batch, closed := w.Close(0, "run", "hash", 5)
	if len(closed.Admitted) != 1 || len(batch.Rows) != 1 || len(batch.Rows[0].InputIDs) != 7 {
		t.Fatalf("batch %+v closed %+v", batch, closed)
	}
	// Redelivery after the close is still a duplicate.
	if res, err := w.Add(s); err != nil || res.Outcome != Duplicate {
		t.Fatalf("add after close: %+v %v", res, err)
	}
	// A filtered id is decided too.
	f := small("f", "g", 1, 2)
	if res, _ := w.Add(f); res.Outcome != Filtered || res.Filter != FilterStale {
		t.Fatalf("stale add: %+v", res)
	}
	if res, _ := w.Add(f); res.Outcome != Duplicate {
		t.Fatalf("stale redelivery: %+v", res)
	}
	// So is a malformed one: quarantined once.
	bad := small("bad", "g", 5, 2)
	bad.TurnAdvantages = nil
	if _, err := w.Add(bad); !errors.Is(err, ErrMalformed) {
		t.Fatalf("malformed: %v", err)
	}
	if res, err := w.Add(bad); err != nil || res.Outcome != Duplicate {
		t.Fatalf("malformed redelivery: %+v %v", res, err)
	}
	if _, err := w.Add(small("", "g", 5, 2)); !errors.Is(err, ErrMalformed) {
		t.Fatalf("record without id: %v", err)
	}
	// Forgotten ids can be admitted again; an id of the open batch cannot.
	w.Forget(idset.KeyOf("a"))
	if w.Seen("a") {
		t.Fatal("Forget kept the id")
	}
	if res, _ := w.Add(small("p", "g", 5, 2)); res.Outcome != Admitted {
		t.Fatalf("add p: %+v", res)
	}
	w.Forget(idset.KeyOf("p"))
	if res, _ := w.Add(small("p", "g", 5, 2)); res.Outcome != Duplicate {
		t.Fatalf("forgot an id of the open batch: %+v", res)
	}
	// Once its batch is closed, the id can be forgotten.
	w.Close(0, "run", "hash", 5)
	w.Forget(idset.KeyOf("p"))
	if w.Seen("p") {
		t.Fatal("Forget kept an id of a closed batch")
	}
	// Restored memory.
	w2, _ := NewWindow(o, 5)
	w2.MarkSeen("a")
	if !w2.Seen("a") || w2.Seen("b") {
		t.Fatal("MarkSeen/Seen disagree")
	}
	if res, _ := w2.Add(s); res.Outcome != Duplicate {
		t.Fatalf("restored window admitted a seen id: %+v", res)
	}
}

// TestWindowOrderIndependence feeds the same records in several arrival
// orders (with redeliveries) and expects byte-identical batches.
func TestWindowOrderIndependence(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 3))
	var recs []schemas.Scored
	for i := 0; i < 120; i++ {
		recs = append(recs, randomScored(r, idOf(i), idOf(i/8), logNormalLength(r, 600, 1, 8, 8000), 10))
	}
	o := Options{TokenBudget: 4096, BatchTokens: 1 << 40, Overflow: OverflowTruncate, MaxLag: 1, StalePolicy: StaleMaskTurns}
	run := func(seed uint64) (schemas.PackedBatch, Closed, []Result) {
		order := slices.Clone(recs)
		rr := rand.New(rand.NewPCG(seed, seed))
		for i := 0; i < 20; i++ { // redeliveries
			order = append(order, recs[rr.IntN(len(recs))])
		}
		rr.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		w, err := NewWindow(o, 10)
		if err != nil {
			t.Fatal(err)
		}
		results := make(map[string]Result)
		for _, s := range order {
			res, err := w.Add(s)
			if err != nil {
				t.Fatal(err)
			}
			if res.Outcome != Duplicate {
				res.Ready = false
				results[s.RecordID] = res
			}
		}
		var rs []Result
		for _, s := range recs {
			rs = append(rs, results[s.RecordID])
		}
		b, c := w.Close(7, "run-1", "contract", 10)
		return b, c, rs
	}
	b0, c0, r0 := run(1)
	if len(c0.Admitted) < 100 || len(b0.Rows) < 2 {
		t.Fatalf("too little admitted to test anything: %d records, %d rows", len(c0.Admitted), len(b0.Rows))
	}
	for seed := uint64(2); seed < 5; seed++ {
		b, c, rs := run(seed)
		if !reflect.DeepEqual(b, b0) || !reflect.DeepEqual(c, c0) || !reflect.DeepEqual(rs, r0) {
			t.Fatalf("arrival order %d changed the batch", seed)
		}
	}
	if b0.BatchID != schemas.BatchID("run-1", 7) || b0.BatchIndex != 7 || b0.RunID != "run-1" ||
		b0.ContractHash != "contract" || b0.TrainerVersion != 10 || b0.TokenBudget != 4096 {
		t.Fatalf("batch header %+v", b0)
	}
	// Admissions are sorted by id and locate their segments.
	if !slices.IsSortedFunc(c0.Admitted, func(a, b Admission) int { return cmpString(a.RecordID, b.RecordID) }) {
		t.Fatal("admissions not sorted by record id")
	}
	for _, a := range c0.Admitted {
		row := b0.Rows[a.Row]
		if row.SegTrajectoryIDs[a.Segment] != a.RecordID || int(row.SegLengths[a.Segment]) != a.Tokens ||
			row.SegPolicyVersions[a.Segment] != a.PolicyVersion || row.SegTruncated[a.Segment] != a.Truncated {
			t.Fatalf("admission %+v does not locate its segment", a)
		}
	}
	if c0.Stats.Segments != len(c0.Admitted) {
		t.Fatalf("stats %+v for %d admissions", c0.Stats, len(c0.Admitted))
	}
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func TestWindowClosesOnTokens(t *testing.T) {
	o := testOptions()
	o.BatchTokens = 20
	w, _ := NewWindow(o, 5)
	for i, want := range []bool{false, false, true} { // 7 tokens each
		res, err := w.Add(small(idOf(i), "g", 5, 4))
		if err != nil || res.Ready != want || w.Ready() != want {
			t.Fatalf("add %d: %+v %v", i, res, err)
		}
	}
	if _, err := w.Add(small("late", "g", 5, 4)); !errors.Is(err, ErrWindowFull) {
		t.Fatalf("add to a full window: %v", err)
	}
	if w.Seen("late") {
		t.Fatal("a refused record was consumed")
	}
	if got := w.Pending(); !reflect.DeepEqual(got, []string{idOf(0), idOf(1), idOf(2)}) {
		t.Fatalf("pending %v", got)
	}
	_, closed := w.Close(0, "r", "h", 5)
	if closed.Stats.Tokens != 21 || w.Ready() || w.Tokens() != 0 || len(w.Pending()) != 0 {
		t.Fatalf("after close: %+v tokens %d", closed.Stats, w.Tokens())
	}
	if res, err := w.Add(small("late", "g", 5, 4)); err != nil || res.Outcome != Admitted {
		t.Fatalf("add after close: %+v %v", res, err)
	}
}

func TestWindowClosesOnGroups(t *testing.T) {
	o := testOptions()
	o.BatchTokens, o.BatchGroups = 0, 2
	w, _ := NewWindow(o, 5)
	steps := []struct {
		id, group string
		ready     bool
	}{{"a", "g1", false}, {"b", "g1", false}, {"c", "g2", true}}
	for _, s := range steps {
		if res, err := w.Add(small(s.id, s.group, 5, 3)); err != nil || res.Ready != s.ready {
			t.Fatalf("%s: %+v %v", s.id, res, err)
		}
	}
	if w.Groups() != 2 {
		t.Fatalf("groups %d", w.Groups())
	}
	w.Close(0, "r", "h", 5)
	if w.Groups() != 0 {
		t.Fatalf("groups after close %d", w.Groups())
	}
}

// TestWindowLagAtClose: the trainer moved on while the window was open;
// the lag rule is applied again at close with the closing version.
func TestWindowLagAtClose(t *testing.T) {
	for _, tc := range []struct {
		stale    string
		admitted []string
		filtered []string
	}{
		// At version 6 with max lag 1, version 4 is stale: "old" entirely,
		// "mixed" in its first turn.
		{StaleDrop, []string{"new"}, []string{"mixed", "old"}},
		{StaleMaskTurns, []string{"mixed", "new"}, []string{"old"}},
	} {
		t.Run(tc.stale, func(t *testing.T) {
			o := testOptions()
			o.StalePolicy = tc.stale
			w, _ := NewWindow(o, 5)
			mixed := scored("mixed", "g",
				turnSpec{prompt: []int32{1}, action: []int32{10, 11}, logprobs: []float32{-1, -1}, version: 4, adv: 1},
				turnSpec{prompt: []int32{2}, action: []int32{12}, logprobs: []float32{-1}, version: 5, adv: 1},
			)
			for _, s := range []schemas.Scored{small("old", "g", 4, 3), small("new", "g", 5, 3), mixed} {
				if res, err := w.Add(s); err != nil || res.Outcome != Admitted {
					t.Fatalf("%s: %+v %v", s.RecordID, res, err)
				}
			}
			w.SetTrainerVersion(6)
			if w.TrainerVersion() != 6 {
				t.Fatal("SetTrainerVersion")
			}
			batch, closed := w.Close(1, "r", "h", 6)
			var adm, fil []string
			for _, a := range closed.Admitted {
				adm = append(adm, a.RecordID)
			}
			for _, f := range closed.Filtered {
				if f.Filter != FilterStale {
					t.Fatalf("filter %q", f.Filter)
				}
				fil = append(fil, f.RecordID)
			}
			if !reflect.DeepEqual(adm, tc.admitted) || !reflect.DeepEqual(fil, tc.filtered) {
				t.Fatalf("admitted %v filtered %v, want %v %v", adm, fil, tc.admitted, tc.filtered)
			}
			for _, a := range closed.Admitted {
				if a.RecordID == "mixed" && (a.Trained != 1 || a.PolicyVersion != 5) {
					t.Fatalf("mixed after the close: %+v", a)
				}
			}
			var trained int64
			for _, row := range batch.Rows {
				for _, m := range row.ActionMask {
					trained += int64(m)
				}
			}
			if trained != closed.Stats.TrainedTokens {
				t.Fatalf("mask sums to %d, stats say %d", trained, closed.Stats.TrainedTokens)
			}
		})
	}
}

func TestWindowEmptyClose(t *testing.T) {
	w, _ := NewWindow(testOptions(), 0)
	b, c := w.Close(3, "r", "h", 0)
	if len(b.Rows) != 0 || len(c.Admitted) != 0 || b.BatchID != schemas.BatchID("r", 3) {
		t.Fatalf("empty close: %+v %+v", b, c)
	}
}

func TestNewWindowValidates(t *testing.T) {
	o := testOptions()
	o.StalePolicy = "sometimes"
	if _, err := NewWindow(o, 0); !errors.Is(err, ErrOptions) {
		t.Fatalf("err %v", err)
	}
}

// TestWindowCountsDecidedGroups: in stop-and-synchronize mode a group
// counts towards BatchGroups whether admitted or filtered, so a round whose
// groups are all filtered still makes the window Ready (with an empty
// batch); members of a group already in a Ready window are still accepted,
// and a new group is refused.
func TestWindowCountsDecidedGroups(t *testing.T) {
	zeroVar := func(id, group string) schemas.Scored {
		s := small(id, group, 5, 3)
		s.Group.Filtered = "zero_variance"
		return s
	}
	for _, tc := range []struct {
		name        string
		decided     bool
		wantReady   bool
		wantGroups  []string
		wantPending int
	}{
		{"admitted groups only", false, false, []string{"g1", "g2"}, 1},
		{"decided groups", true, true, []string{"g1", "g2"}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := testOptions()
			o.BatchTokens, o.BatchGroups = 0, 2
			w, _ := NewWindow(o, 5)
			w.CountDecidedGroups(tc.decided)
			if res, err := w.Add(zeroVar("a", "g1")); err != nil || res.Outcome != Filtered {
				t.Fatalf("a: %+v %v", res, err)
			}
			if res, err := w.Add(small("b", "g2", 5, 3)); err != nil || res.Outcome != Admitted || res.Ready != tc.wantReady {
				t.Fatalf("b: %+v %v", res, err)
			}
			if got := w.DecidedGroups(); !reflect.DeepEqual(got, tc.wantGroups) {
				t.Fatalf("decided groups %v", got)
			}
			// Another member of a group in the window is accepted even when
			// the window is Ready.
			if res, err := w.Add(zeroVar("c", "g2")); err != nil || res.Outcome != Filtered {
				t.Fatalf("c: %+v %v", res, err)
			}
			_, err := w.Add(small("d", "g3", 5, 3))
			if tc.decided != errors.Is(err, ErrWindowFull) {
				t.Fatalf("d: %v", err)
			}
			if len(w.Pending()) != tc.wantPending+btoi(!tc.decided) {
				t.Fatalf("pending %v", w.Pending())
			}
			w.Close(0, "r", "h", 5)
			if len(w.DecidedGroups()) != 0 || w.HasGroup("g1") {
				t.Fatal("decided groups survive close")
			}
		})
	}
	// Every group filtered: the window is Ready with nothing pending and
	// closes to an empty batch.
	o := testOptions()
	o.BatchTokens, o.BatchGroups = 0, 1
	w, _ := NewWindow(o, 5)
	w.CountDecidedGroups(true)
	if res, err := w.Add(zeroVar("z", "g")); err != nil || !res.Ready {
		t.Fatalf("z: %+v %v", res, err)
	}
	if b, closed := w.Close(3, "r", "h", 5); len(b.Rows) != 0 || len(closed.Admitted) != 0 {
		t.Fatalf("batch %+v", b)
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// The window passes Reconstruct's error on as it is: it names the package
// and the record once ("pack window: pack: ..." before).
func TestWindowErrorMessage(t *testing.T) {
	w, err := NewWindow(testOptions(), 5)
	if err != nil {
		t.Fatal(err)
	}
	s := scored("r", "g", turnSpec{prompt: []int32{1, 2}, action: []int32{3, 4}, logprobs: []float32{-1, -1}, version: 5, adv: 1})
	s.TurnAdvantages[0] = float32(math.NaN())
	_, err = w.Add(s)
	if want := "pack: malformed scored trajectory: record r: turn_advantages[0] is NaN"; err == nil || err.Error() != want {
		t.Fatalf("err %v, want %q", err, want)
	}
}
