package pack

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/trajflow/trajflow/schemas"
)

// turnSpec is a compact way to write a turn in tests.
type turnSpec struct {
	prompt, action, obs []int32
	logprobs            []float32
	version             int64
	decision            string
	adv, vt             float32
}

func scored(id, group string, turns ...turnSpec) schemas.Scored {
	var s schemas.Scored
	s.RecordID = id
	s.GroupID = group
	s.Split = schemas.SplitTrain
	withVT := false
	for i, t := range turns {
		dec := t.decision
		if dec == "" {
			dec = schemas.DecisionOK
		}
		s.Turns = append(s.Turns, schemas.Turn{
			Index:          int32(i),
			PromptIDs:      t.prompt,
			ActionIDs:      t.action,
			ActionLogprobs: t.logprobs,
			PolicyVersion:  t.version,
			Decision:       dec,
			ObservationIDs: t.obs,
		})
		s.TurnAdvantages = append(s.TurnAdvantages, t.adv)
		s.TurnValueTargets = append(s.TurnValueTargets, t.vt)
		if t.vt != 0 {
			withVT = true
		}
	}
	if !withVT {
		s.TurnValueTargets = nil
	}
	return s
}

func testOptions() Options {
	return Options{
		TokenBudget: 64,
		BatchTokens: 1 << 30,
		Overflow:    OverflowReject,
		MaxLag:      1,
		StalePolicy: StaleDrop,
	}
}

// refColumns is the per-token expansion of one segment computed naively
// from the scored record: one role per token, then the shift.
type refColumns struct {
	ids, turn, pv []int32
	mask          []uint8
	lp, adv, vt   []float32
	truncated     bool
}

// reference is an independent, per-token formulation of reconstruction
// (docs/PIPELINE.md §11) used to check Reconstruct + Pack.
func reference(s *schemas.Scored, tv int64, o Options) (refColumns, Filter) {
	if s.Group.Filtered != "" {
		return refColumns{}, Filter(s.Group.Filtered)
	}
	var ids []int32
	var isAct []bool
	var tokTurn []int
	var tokLP []float32
	for i, t := range s.Turns {
		for _, id := range t.PromptIDs {
			ids, isAct, tokTurn, tokLP = append(ids, id), append(isAct, false), append(tokTurn, i), append(tokLP, 0)
		}
		for j, id := range t.ActionIDs {
			ids, isAct, tokTurn, tokLP = append(ids, id), append(isAct, true), append(tokTurn, i), append(tokLP, t.ActionLogprobs[j])
		}
		for _, id := range t.ObservationIDs {
			ids, isAct, tokTurn, tokLP = append(ids, id), append(isAct, false), append(tokTurn, i), append(tokLP, 0)
		}
	}
	anyAction := false
	for _, a := range isAct {
		anyAction = anyAction || a
	}
	if !anyAction {
		return refColumns{}, FilterNoTargets
	}
	var c refColumns
	if len(ids) > o.TokenBudget {
		if o.Overflow == OverflowReject {
			return refColumns{}, FilterOverlong
		}
		ids, isAct, tokTurn, tokLP = ids[:o.TokenBudget], isAct[:o.TokenBudget], tokTurn[:o.TokenBudget], tokLP[:o.TokenBudget]
		c.truncated = true
	}
	n := len(ids)
	stale := func(turn int) bool { return tv-s.Turns[turn].PolicyVersion > o.MaxLag }
	trained, anyStale := 0, false
	c.ids = ids
	c.mask = make([]uint8, n)
	c.lp = make([]float32, n)
	c.adv = make([]float32, n)
	c.vt = make([]float32, n)
	c.turn = make([]int32, n)
	c.pv = make([]int32, n)
	for i := 0; i < n; i++ {
		c.turn[i], c.pv[i] = -1, -1
		if i+1 >= n || !isAct[i+1] {
			continue
		}
		tt := tokTurn[i+1]
		if stale(tt) {
			anyStale = true
			continue
		}
		trained++
		c.mask[i] = 1
		c.lp[i] = tokLP[i+1]
		c.adv[i] = s.TurnAdvantages[tt]
		if len(s.TurnValueTargets) > 0 {
			c.vt[i] = s.TurnValueTargets[tt]
		}
		c.turn[i] = int32(tt)
		c.pv[i] = int32(s.Turns[tt].PolicyVersion)
	}
	if anyStale && o.StalePolicy == StaleDrop {
		return refColumns{}, FilterStale
	}
	if trained == 0 {
		if anyStale {
			return refColumns{}, FilterStale
		}
		return refColumns{}, FilterNoTargets
	}
	return c, FilterNone
}

// randomScored draws a trajectory of about total tokens split into turns.
func randomScored(r *rand.Rand, id, group string, total int, tv int64) schemas.Scored {
	var specs []turnSpec
	left := total
	tok := int32(1)
	next := func(k int) []int32 {
		if k <= 0 {
			return nil
		}
		out := make([]int32, k)
		for i := range out {
			out[i] = tok
			tok++
		}
		return out
	}
	for left > 0 {
		p := min(left, 1+r.IntN(64))
		left -= p
		a := min(left, r.IntN(256))
		left -= a
		ob := min(left, r.IntN(512))
		left -= ob
		lps := make([]float32, a)
		for i := range lps {
			lps[i] = -r.Float32() * 5
		}
		decs := []string{schemas.DecisionOK, schemas.DecisionOK, schemas.DecisionInvalid, schemas.DecisionDenied}
		specs = append(specs, turnSpec{
			prompt: next(p), action: next(a), obs: next(ob), logprobs: lps,
			version:  tv - lagOf(r),
			decision: decs[r.IntN(len(decs))],
			adv:      float32(r.NormFloat64()),
			vt:       float32(r.NormFloat64()),
		})
	}
	return scored(id, group, specs...)
}

// lagOf draws a policy lag: mostly 0, sometimes 1, rarely 2.
func lagOf(r *rand.Rand) int64 {
	switch x := r.IntN(40); {
	case x == 0:
		return 2
	case x < 10:
		return 1
	}
	return 0
}

// logNormalLength draws a heavy-tailed length with the given mean, clipped
// to [lo, hi].
func logNormalLength(r *rand.Rand, mean, sigma float64, lo, hi int) int {
	mu := math.Log(mean) - sigma*sigma/2
	l := int(math.Exp(mu + sigma*r.NormFloat64()))
	return min(max(l, lo), hi)
}

// checkRows verifies the packing invariants of rows against the scored
// records they came from (by trajectory id): every admitted segment appears
// exactly once with its tokens in order; positions restart; segment ids are
// 0..k-1 and consistent with the per-segment columns; every target-aligned
// column equals the naive reference (so no target crosses a segment
// boundary and every segment's last entry is masked); rows fit the budget.
func checkRows(t *testing.T, rows []schemas.PackedRow, st Stats, budget int, want map[string]refColumns) {
	t.Helper()
	seen := make(map[string]bool)
	var tokens, trained int64
	segments := 0
	for r, row := range rows {
		n := len(row.InputIDs)
		if n == 0 || n > budget {
			t.Fatalf("row %d has %d tokens, budget %d", r, n, budget)
		}
		for name, l := range map[string]int{"pos": len(row.PositionIDs), "seg": len(row.SegmentIDs), "mask": len(row.ActionMask),
			"lp": len(row.OldLogprobs), "adv": len(row.Advantages), "vt": len(row.ValueTargets), "turn": len(row.TurnIDs), "pv": len(row.PolicyVersions)} {
			if l != n {
				t.Fatalf("row %d: column %s has %d entries, want %d", r, name, l, n)
			}
		}
		if row.RefLogprobs != nil {
			t.Fatalf("row %d: RefLogprobs set", r)
		}
		k := len(row.SegTrajectoryIDs)
		if len(row.SegGroupIDs) != k || len(row.SegLengths) != k || len(row.SegPolicyVersions) != k || len(row.SegWeights) != k || len(row.SegTruncated) != k {
			t.Fatalf("row %d: per-segment columns disagree in length", r)
		}
		if row.ActionMask[n-1] != 0 {
			t.Fatalf("row %d: last entry masked in", r)
		}
		o := 0
		for seg := 0; seg < k; seg++ {
			id := row.SegTrajectoryIDs[seg]
			if seen[id] {
				t.Fatalf("trajectory %s packed twice", id)
			}
			seen[id] = true
			ref, ok := want[id]
			if !ok {
				t.Fatalf("row %d segment %d: unknown trajectory %q", r, seg, id)
			}
			l := int(row.SegLengths[seg])
			if l != len(ref.ids) || o+l > n {
				t.Fatalf("trajectory %s: length %d, want %d", id, l, len(ref.ids))
			}
			if row.SegTruncated[seg] != ref.truncated || row.SegWeights[seg] != 1 {
				t.Fatalf("trajectory %s: truncated %v weight %v", id, row.SegTruncated[seg], row.SegWeights[seg])
			}
			oldest := int64(-1)
			for i := 0; i < l; i++ {
				p := o + i
				if row.SegmentIDs[p] != int32(seg) || row.PositionIDs[p] != int32(i) || row.InputIDs[p] != ref.ids[i] {
					t.Fatalf("trajectory %s token %d: seg %d pos %d id %d, want seg %d pos %d id %d",
						id, i, row.SegmentIDs[p], row.PositionIDs[p], row.InputIDs[p], seg, i, ref.ids[i])
				}
				if row.ActionMask[p] != ref.mask[i] || row.OldLogprobs[p] != ref.lp[i] || row.Advantages[p] != ref.adv[i] ||
					row.ValueTargets[p] != ref.vt[i] || row.TurnIDs[p] != ref.turn[i] || row.PolicyVersions[p] != ref.pv[i] {
					t.Fatalf("trajectory %s entry %d: got mask %d lp %v adv %v vt %v turn %d pv %d, want %d %v %v %v %d %d", id, i,
						row.ActionMask[p], row.OldLogprobs[p], row.Advantages[p], row.ValueTargets[p], row.TurnIDs[p], row.PolicyVersions[p],
						ref.mask[i], ref.lp[i], ref.adv[i], ref.vt[i], ref.turn[i], ref.pv[i])
				}
				if ref.mask[i] == 1 {
					trained++
					if oldest < 0 || int64(ref.pv[i]) < oldest {
						oldest = int64(ref.pv[i])
					}
				}
			}
			if row.ActionMask[o+l-1] != 0 {
				t.Fatalf("trajectory %s: last position masked in", id)
			}
			if row.SegPolicyVersions[seg] != oldest {
				t.Fatalf("trajectory %s: segment policy version %d, want %d", id, row.SegPolicyVersions[seg], oldest)
			}
			o += l
			segments++
		}
		if o != n {
			t.Fatalf("row %d: segments cover %d of %d tokens", r, o, n)
		}
		tokens += int64(n)
	}
	if len(seen) != len(want) {
		t.Fatalf("%d trajectories packed, want %d", len(seen), len(want))
	}
	if st.Rows != len(rows) || st.Segments != segments || st.Tokens != tokens || st.TrainedTokens != trained || st.Budget != budget {
		t.Fatalf("stats %+v, want rows %d segments %d tokens %d trained %d", st, len(rows), segments, tokens, trained)
	}
	if len(rows) > 0 {
		if eff := float64(tokens) / float64(len(rows)*budget); math.Abs(eff-st.Efficiency) > 1e-12 {
			t.Fatalf("efficiency %v, want %v", st.Efficiency, eff)
		}
	}
}

func idOf(i int) string { return fmt.Sprintf("traj-%05d", i) }
