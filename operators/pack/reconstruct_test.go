package pack

import (
	"errors"
	"math"
	"reflect"
	"testing"

	"github.com/trajflow/trajflow/schemas"
)

// TestShiftAlignmentByHand is the hand-built shift test of docs/PIPELINE.md §11:
// logits at position i predict input_ids[i+1], so every target-aligned
// column is written out here, entry by entry, for two trajectories packed
// into one row.
func TestShiftAlignmentByHand(t *testing.T) {
	// Trajectory A, two turns.
	//   turn 0: prompt 101 102 103 | action 201 202 (v7, adv 0.5, vt 1.5) | obs 301 302
	//   turn 1: prompt 104 | action 203 204 205 (v8, invalid, adv -0.25, vt 0.75) | no obs
	a := scored("A", "g1",
		turnSpec{prompt: []int32{101, 102, 103}, action: []int32{201, 202}, logprobs: []float32{-0.1, -0.2},
			obs: []int32{301, 302}, version: 7, adv: 0.5, vt: 1.5},
		turnSpec{prompt: []int32{104}, action: []int32{203, 204, 205}, logprobs: []float32{-0.3, -0.4, -0.5},
			version: 8, decision: schemas.DecisionInvalid, adv: -0.25, vt: 0.75},
	)
	// Trajectory B starts with an action token (nobody predicts it), no
	// critic: action 210 211 212 (v8, adv 2) | obs 310.
	b := scored("B", "g2",
		turnSpec{action: []int32{210, 211, 212}, logprobs: []float32{-1, -2, -3}, obs: []int32{310}, version: 8, adv: 2},
	)
	o := Options{TokenBudget: 16, BatchTokens: 16, Overflow: OverflowReject, MaxLag: 1, StalePolicy: StaleDrop}
	var segs []Segment
	for _, s := range []schemas.Scored{b, a} {
		seg, f, err := Reconstruct(&s, 8, o)
		if err != nil || f != FilterNone {
			t.Fatalf("%s: filter %q err %v", s.RecordID, f, err)
		}
		segs = append(segs, seg)
	}
	rows, st := Pack(segs, 16)
	if len(rows) != 1 {
		t.Fatalf("%d rows, want 1", len(rows))
	}
	row := rows[0]
	want := schemas.PackedRow{
		//                 A: p   p    p    a    a    o    o    p    a    a    a  | B: a    a    a    o
		InputIDs:    []int32{101, 102, 103, 201, 202, 301, 302, 104, 203, 204, 205, 210, 211, 212, 310},
		PositionIDs: []int32{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2, 3},
		SegmentIDs:  []int32{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1},
		// entry i predicts InputIDs[i+1]: 2->201 3->202 7->203 8->204 9->205;
		// 10 is A's last (predicts B's first: masked); 11->211 12->212;
		// 13 predicts the observation 310; 14 is the row's last.
		ActionMask:     []uint8{0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 0},
		OldLogprobs:    []float32{0, 0, -0.1, -0.2, 0, 0, 0, -0.3, -0.4, -0.5, 0, -2, -3, 0, 0},
		Advantages:     []float32{0, 0, 0.5, 0.5, 0, 0, 0, -0.25, -0.25, -0.25, 0, 2, 2, 0, 0},
		ValueTargets:   []float32{0, 0, 1.5, 1.5, 0, 0, 0, 0.75, 0.75, 0.75, 0, 0, 0, 0, 0},
		TurnIDs:        []int32{-1, -1, 0, 0, -1, -1, -1, 1, 1, 1, -1, 0, 0, -1, -1},
		PolicyVersions: []int32{-1, -1, 7, 7, -1, -1, -1, 8, 8, 8, -1, 8, 8, -1, -1},

		SegTrajectoryIDs:  []string{"A", "B"},
		SegGroupIDs:       []string{"g1", "g2"},
		SegPolicyVersions: []int64{7, 8},
		SegLengths:        []int32{11, 4},
		SegWeights:        []float32{1, 1},
		SegTruncated:      []bool{false, false},
	}
	if !reflect.DeepEqual(row, want) {
		t.Errorf("packed row\n got %+v\nwant %+v", row, want)
	}
	// Trained versions: A 7 and 8, B 8; the newest 8, the segments' oldest
	// 7 and 8, the newest of those 8.
	wantStats := Stats{Budget: 16, Rows: 1, Segments: 2, Tokens: 15, TrainedTokens: 7, Efficiency: 15.0 / 16,
		NewestTrained: 8, NewestOldest: 8}
	if st != wantStats {
		t.Errorf("stats %+v, want %+v", st, wantStats)
	}
	// Roles are indexed by input position (not shifted).
	gotRoles := segs[1].Roles() // A
	wantRoles := []Role{0, 0, 0, RoleAction, RoleAction, 0, 0, 0, RoleAction, RoleAction, RoleAction}
	if !reflect.DeepEqual(gotRoles, wantRoles) {
		t.Errorf("roles of A %v, want %v", gotRoles, wantRoles)
	}
	if r := segs[0].Roles(); r[0] != RoleContext || r[1] != RoleAction {
		t.Errorf("roles of B %v: the first token is predicted by nobody", r)
	}
}

func TestReconstructErrors(t *testing.T) {
	good := func() schemas.Scored {
		return scored("r", "g", turnSpec{prompt: []int32{1, 2}, action: []int32{3, 4}, logprobs: []float32{-1, -1}, version: 5, adv: 1})
	}
	tests := []struct {
		name   string
		mutate func(*schemas.Scored, *Options)
		want   error
	}{
		{"logprob length", func(s *schemas.Scored, _ *Options) { s.Turns[0].ActionLogprobs = s.Turns[0].ActionLogprobs[:1] }, ErrMalformed},
		{"advantages per turn", func(s *schemas.Scored, _ *Options) { s.TurnAdvantages = append(s.TurnAdvantages, 1) }, ErrMalformed},
		{"missing advantages", func(s *schemas.Scored, _ *Options) { s.TurnAdvantages = nil }, ErrMalformed},
		{"value targets per turn", func(s *schemas.Scored, _ *Options) { s.TurnValueTargets = []float32{1, 2} }, ErrMalformed},
		{"version beyond int32", func(s *schemas.Scored, _ *Options) { s.Turns[0].PolicyVersion = 1 << 40 }, ErrMalformed},
		{"eval split", func(s *schemas.Scored, _ *Options) { s.Split = schemas.SplitEval }, ErrEvalSplit},
		{"budget", func(_ *schemas.Scored, o *Options) { o.TokenBudget = 0 }, ErrOptions},
		{"overflow rule", func(_ *schemas.Scored, o *Options) { o.Overflow = "split" }, ErrOptions},
		{"stale rule", func(_ *schemas.Scored, o *Options) { o.StalePolicy = "" }, ErrOptions},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, o := good(), testOptions()
			if _, f, err := Reconstruct(&s, 5, o); err != nil || f != FilterNone {
				t.Fatalf("unmodified: filter %q err %v", f, err)
			}
			tc.mutate(&s, &o)
			seg, f, err := Reconstruct(&s, 5, o)
			if !errors.Is(err, tc.want) {
				t.Fatalf("err %v, want %v", err, tc.want)
			}
			if f != FilterNone || seg.Tokens != nil {
				t.Fatalf("error came with filter %q / segment of %d tokens", f, seg.Len())
			}
		})
	}
}

// Pack is the last step before training: a non-finite advantage or value
// target, or a behavior log-prob that is not finite and <= 0, is malformed
// input named by its field and index, whichever turn it is in (kept or
// cut by truncation).
func TestReconstructRefusesBadValues(t *testing.T) {
	good := func() schemas.Scored {
		return scored("r", "g",
			turnSpec{prompt: []int32{1, 2}, action: []int32{3, 4}, logprobs: []float32{-1, 0}, version: 5, adv: 1, vt: 0.5},
			turnSpec{prompt: []int32{5}, action: []int32{6, 7, 8}, logprobs: []float32{-1, -2, -3}, version: 5, adv: -1, vt: 0.25})
	}
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	tests := []struct {
		name   string
		mutate func(*schemas.Scored)
		want   string
	}{
		{"nan advantage", func(s *schemas.Scored) { s.TurnAdvantages[1] = nan },
			"pack: malformed scored trajectory: record r: turn_advantages[1] is NaN"},
		{"inf advantage", func(s *schemas.Scored) { s.TurnAdvantages[0] = -inf },
			"pack: malformed scored trajectory: record r: turn_advantages[0] is -Inf"},
		{"nan value target", func(s *schemas.Scored) { s.TurnValueTargets[1] = nan },
			"pack: malformed scored trajectory: record r: turn_value_targets[1] is NaN"},
		{"inf value target", func(s *schemas.Scored) { s.TurnValueTargets[0] = inf },
			"pack: malformed scored trajectory: record r: turn_value_targets[0] is +Inf"},
		{"positive log-prob", func(s *schemas.Scored) { s.Turns[1].ActionLogprobs[2] = 0.7 },
			"pack: malformed scored trajectory: record r: turns[1].action_logprobs[2] is 0.7 > 0"},
		{"nan log-prob", func(s *schemas.Scored) { s.Turns[1].ActionLogprobs[0] = nan },
			"pack: malformed scored trajectory: record r: turns[1].action_logprobs[0] is NaN"},
		{"-inf log-prob", func(s *schemas.Scored) { s.Turns[0].ActionLogprobs[1] = -inf },
			"pack: malformed scored trajectory: record r: turns[0].action_logprobs[1] is -Inf"},
		// The first token of the stream is no target; its log-prob is still
		// data of the record.
		{"+inf log-prob of the first token", func(s *schemas.Scored) {
			s.Turns[0].PromptIDs = nil
			s.Turns[0].ActionLogprobs[0] = inf
		}, "pack: malformed scored trajectory: record r: turns[0].action_logprobs[0] is +Inf"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, o := range []Options{testOptions(), {TokenBudget: 4, BatchTokens: 16, Overflow: OverflowTruncate, MaxLag: 1, StalePolicy: StaleDrop}} {
				s := good()
				if _, f, err := Reconstruct(&s, 5, o); err != nil || f != FilterNone {
					t.Fatalf("unmodified: filter %q err %v", f, err)
				}
				tc.mutate(&s)
				seg, f, err := Reconstruct(&s, 5, o)
				if !errors.Is(err, ErrMalformed) || err.Error() != tc.want {
					t.Fatalf("budget %d: err %v, want %q", o.TokenBudget, err, tc.want)
				}
				if f != FilterNone || seg.Tokens != nil {
					t.Fatalf("error came with filter %q / segment of %d tokens", f, seg.Len())
				}
			}
		})
	}
}

func TestOptionsValidate(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Options)
		ok     bool
	}{
		{"defaults of the tests", func(*Options) {}, true},
		{"groups only", func(o *Options) { o.BatchTokens, o.BatchGroups = 0, 8 }, true},
		{"mask stale, truncate", func(o *Options) { o.StalePolicy, o.Overflow = StaleMaskTurns, OverflowTruncate }, true},
		{"on-policy only", func(o *Options) { o.MaxLag = 0 }, true},
		{"no close condition", func(o *Options) { o.BatchTokens = 0 }, false},
		{"negative groups", func(o *Options) { o.BatchGroups = -1 }, false},
		{"negative lag", func(o *Options) { o.MaxLag = -1 }, false},
		{"zero budget", func(o *Options) { o.TokenBudget = 0 }, false},
		{"unknown overflow", func(o *Options) { o.Overflow = "" }, false},
		{"unknown stale", func(o *Options) { o.StalePolicy = "keep" }, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := testOptions()
			tc.mutate(&o)
			err := o.Validate()
			if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrOptions)) {
				t.Fatalf("Validate() = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

// TestReconstructFilters covers the admission rules: upstream filters,
// lag (drop / mask), overflow (reject / truncate) and empty targets. Every
// admitted case is checked entry by entry against the naive reference.
func TestReconstructFilters(t *testing.T) {
	// Three turns sampled by versions 3, 5, 6; the trainer is at 6.
	// Stream (12 tokens): 1 2 [10 11] 20 | 3 [12 13] 21 22 | 4 [14].
	three := scored("r", "g",
		turnSpec{prompt: []int32{1, 2}, action: []int32{10, 11}, logprobs: []float32{-1, -2}, obs: []int32{20}, version: 3, adv: 1},
		turnSpec{prompt: []int32{3}, action: []int32{12, 13}, logprobs: []float32{-3, -4}, obs: []int32{21, 22}, version: 5, adv: 2},
		turnSpec{prompt: []int32{4}, action: []int32{14}, logprobs: []float32{-5}, version: 6, decision: schemas.DecisionDenied, adv: 3},
	)
	allStale := scored("r", "g",
		turnSpec{prompt: []int32{1}, action: []int32{10}, logprobs: []float32{-1}, version: 4, adv: 1},
		turnSpec{prompt: []int32{2}, action: []int32{11}, logprobs: []float32{-1}, version: 5, adv: 1},
	)
	// A stale turn at the end (v2) behind a fresh one (v6):
	// 1 [10 11] 20 | 2 [12].
	late := scored("r", "g",
		turnSpec{prompt: []int32{1}, action: []int32{10, 11}, logprobs: []float32{-1, -2}, obs: []int32{20}, version: 6, adv: 1, vt: 4},
		turnSpec{prompt: []int32{2}, action: []int32{12}, logprobs: []float32{-3}, version: 2, adv: 1, vt: 5},
	)
	upstream := three
	upstream.Group.Filtered = "zero_variance"
	tests := []struct {
		name      string
		s         schemas.Scored
		mutate    func(*Options)
		want      Filter
		trained   int32
		oldest    int64
		truncated bool
		len       int
	}{
		{"in window", three, func(o *Options) { o.MaxLag = 3 }, FilterNone, 5, 3, false, 12},
		{"drop stale", three, func(o *Options) { o.MaxLag = 2 }, FilterStale, 0, 0, false, 0},
		{"mask stale turn", three, func(o *Options) { o.MaxLag, o.StalePolicy = 2, StaleMaskTurns }, FilterNone, 3, 5, false, 12},
		{"mask all but the last", three, func(o *Options) { o.MaxLag, o.StalePolicy = 0, StaleMaskTurns }, FilterNone, 1, 6, false, 12},
		{"all stale", allStale, func(o *Options) { o.MaxLag, o.StalePolicy = 0, StaleMaskTurns }, FilterStale, 0, 0, false, 0},
		{"overlong rejected", three, func(o *Options) { o.MaxLag, o.TokenBudget = 3, 11 }, FilterOverlong, 0, 0, false, 0},
		{"exactly the budget", three, func(o *Options) { o.MaxLag, o.TokenBudget = 3, 12 }, FilterNone, 5, 3, false, 12},
		// Cut inside turn 1's action: 1 2 10 11 20 3 12 | 13 ...; the last
		// kept token 12 is the target of entry 5; entry 6 is masked.
		{"truncated mid-action", three, func(o *Options) { o.MaxLag, o.TokenBudget, o.Overflow = 3, 7, OverflowTruncate }, FilterNone, 3, 3, true, 7},
		// Only the prompt survives the cut, so nothing is trained.
		{"truncated to context", three, func(o *Options) { o.MaxLag, o.TokenBudget, o.Overflow = 3, 2, OverflowTruncate }, FilterNoTargets, 0, 0, false, 0},
		// Lag is judged on the kept turns: turn 0 (v3) is kept and stale.
		{"truncated, stale kept", three, func(o *Options) { o.MaxLag, o.TokenBudget, o.Overflow = 2, 7, OverflowTruncate }, FilterStale, 0, 0, false, 0},
		// ... and a stale turn cut away does not filter the trajectory.
		{"stale turn cut away", late, func(o *Options) { o.TokenBudget, o.Overflow = 5, OverflowTruncate }, FilterNone, 2, 6, true, 5},
		{"stale last turn dropped", late, func(o *Options) {}, FilterStale, 0, 0, false, 0},
		{"stale last turn masked", late, func(o *Options) { o.StalePolicy = StaleMaskTurns }, FilterNone, 2, 6, false, 6},
		{"upstream filter", upstream, func(*Options) {}, "zero_variance", 0, 0, false, 0},
		{"no actions", scored("r", "g", turnSpec{prompt: []int32{1, 2, 3}, obs: []int32{4}}), func(*Options) {}, FilterNoTargets, 0, 0, false, 0},
		{"only the first token", scored("r", "g", turnSpec{action: []int32{1}, logprobs: []float32{-1}, obs: []int32{2}, version: 6}), func(*Options) {}, FilterNoTargets, 0, 0, false, 0},
		{"no turns", scored("r", "g"), func(*Options) {}, FilterNoTargets, 0, 0, false, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := testOptions()
			tc.mutate(&o)
			seg, f, err := Reconstruct(&tc.s, 6, o)
			if err != nil {
				t.Fatal(err)
			}
			ref, rf := reference(&tc.s, 6, o)
			if f != tc.want || rf != tc.want {
				t.Fatalf("filter %q (reference %q), want %q", f, rf, tc.want)
			}
			if f != FilterNone {
				return
			}
			if seg.Trained != tc.trained || seg.OldestVersion != tc.oldest || seg.Truncated != tc.truncated || seg.Len() != tc.len {
				t.Fatalf("trained %d oldest %d truncated %v len %d, want %d %d %v %d",
					seg.Trained, seg.OldestVersion, seg.Truncated, seg.Len(), tc.trained, tc.oldest, tc.truncated, tc.len)
			}
			rows, st := Pack([]Segment{seg}, o.TokenBudget)
			checkRows(t, rows, st, o.TokenBudget, map[string]refColumns{"r": ref})
		})
	}
}

// TestTruncatedPrefix checks that truncation keeps the prefix and its old
// log-probs unchanged (docs/PIPELINE.md §11) and masks the last kept position.
func TestTruncatedPrefix(t *testing.T) {
	s := scored("r", "g",
		turnSpec{prompt: []int32{1, 2}, action: []int32{10, 11, 12, 13}, logprobs: []float32{-1, -2, -3, -4}, obs: []int32{20}, version: 1, adv: 1},
	)
	o := testOptions()
	o.TokenBudget, o.Overflow = 5, OverflowTruncate
	seg, f, err := Reconstruct(&s, 1, o)
	if err != nil || f != FilterNone {
		t.Fatalf("filter %q err %v", f, err)
	}
	rows, _ := Pack([]Segment{seg}, 5)
	row := rows[0]
	if !reflect.DeepEqual(row.InputIDs, []int32{1, 2, 10, 11, 12}) ||
		!reflect.DeepEqual(row.ActionMask, []uint8{0, 1, 1, 1, 0}) ||
		!reflect.DeepEqual(row.OldLogprobs, []float32{0, -1, -2, -3, 0}) ||
		!row.SegTruncated[0] {
		t.Fatalf("truncated row %+v", row)
	}
}

// TestReconstructCopies checks that the segment does not alias the input.
func TestReconstructCopies(t *testing.T) {
	s := scored("r", "g", turnSpec{prompt: []int32{1}, action: []int32{2, 3}, logprobs: []float32{-1, -2}, version: 1, adv: 1})
	o := testOptions()
	seg, _, err := Reconstruct(&s, 1, o)
	if err != nil {
		t.Fatal(err)
	}
	s.Turns[0].ActionIDs[0] = 99
	s.Turns[0].ActionLogprobs[0] = 99
	if seg.Tokens[1] != 2 || seg.Logprobs[0] != -1 {
		t.Fatalf("segment aliases the input: %v %v", seg.Tokens, seg.Logprobs)
	}
}
