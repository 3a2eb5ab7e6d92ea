package pack

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	"github.com/trajflow/trajflow/schemas"
)

// Stats summarizes one Pack call. No padding is stored: a row holds only
// its segments' tokens, and Efficiency is the fraction of the row budgets
// the tokens fill.
type Stats struct {
	Budget        int     // token budget of a row
	Rows          int     // packed rows
	Segments      int     // segments packed
	Tokens        int64   // input tokens over all rows
	TrainedTokens int64   // entries with action mask 1
	Truncated     int     // segments cut by the overflow rule
	Efficiency    float64 // Tokens / (Rows * Budget); 0 when there are no rows
}

// Pack packs segments into rows of at most budget tokens (pipeline §11,
// DESIGN.md "Packing") and expands their target-aligned columns.
//
// Placement is first-fit-decreasing: segments are taken by decreasing
// length, ties broken by TrajectoryID and then by input index, and each goes
// to the lowest-numbered row with room for it. The result is a pure
// function of the multiset of segments with their ids, so the order of segs
// never changes a batch unless two segments share both length and id.
// Within a row, segments appear in placement order.
//
// In each row, PositionIDs restart at 0 in every segment, SegmentIDs number
// the segments 0..k-1, and the target-aligned columns follow the contract
// of schemas.PackedRow: entry i predicts InputIDs[i+1]; the last entry of
// every segment predicts nothing inside its segment and is masked (mask 0,
// turn id -1, policy version -1, zeros elsewhere), so no target crosses a
// segment boundary. RefLogprobs is left nil (no reference runs at pack).
// The per-segment columns take TrajectoryID, GroupID, the oldest behavior
// version of the trained tokens (-1 when none), the length, Weight and
// Truncated.
//
// Preconditions (violations are programming errors and panic): budget > 0;
// every segment has 1..budget tokens; every span lies inside its segment
// with At >= 0 and At+Len <= Len()-1; Logprobs holds the spans' entries.
// Reconstruct with Options.TokenBudget <= budget guarantees them.
//
// The rows of one call share backing arrays (one per element type); each
// row's slices are capped at the row's length, so appending to one never
// writes into another.
func Pack(segs []Segment, budget int) ([]schemas.PackedRow, Stats) {
	st := Stats{Budget: budget, Segments: len(segs)}
	if budget <= 0 {
		panic(fmt.Sprintf("pack: budget %d must be positive", budget))
	}
	n := len(segs)
	if n == 0 {
		return nil, st
	}
	var total int
	order := make([]int32, n)
	for i := range segs {
		l := len(segs[i].Tokens)
		if l == 0 || l > budget {
			panic(fmt.Sprintf("pack: segment %d (%s) has %d tokens, budget %d", i, segs[i].TrajectoryID, l, budget))
		}
		order[i] = int32(i)
		total += l
	}
	slices.SortFunc(order, func(a, b int32) int {
		if c := cmp.Compare(len(segs[b].Tokens), len(segs[a].Tokens)); c != 0 {
			return c
		}
		if c := strings.Compare(segs[a].TrajectoryID, segs[b].TrajectoryID); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})

	// First fit in O(log n) per segment: a max-tree over the remaining room
	// of rows 0..size-1 (at most n rows are ever opened). The leftmost leaf
	// with room >= l is the first row that fits; unopened rows have full
	// room and lie to the right of every opened one.
	size := 1
	for size < n {
		size <<= 1
	}
	tree := make([]int32, 2*size)
	for i := range tree {
		tree[i] = int32(budget)
	}
	rowOf := make([]int32, n) // row of order[k]
	rows := 0
	for k, si := range order {
		l := int32(len(segs[si].Tokens))
		node := 1
		for node < size {
			node <<= 1
			if tree[node] < l {
				node++
			}
		}
		r := node - size
		tree[node] -= l
		for node > 1 {
			node >>= 1
			tree[node] = max(tree[2*node], tree[2*node+1])
		}
		rowOf[k] = int32(r)
		rows = max(rows, r+1)
	}

	// Group placements by row (counting sort keeps placement order).
	rowTok := make([]int, rows)
	segStart := make([]int32, rows+1)
	for k, si := range order {
		r := rowOf[k]
		rowTok[r] += len(segs[si].Tokens)
		segStart[r+1]++
	}
	for r := 0; r < rows; r++ {
		segStart[r+1] += segStart[r]
	}
	byRow := make([]int32, n)
	next := slices.Clone(segStart[:rows])
	for k, si := range order {
		r := rowOf[k]
		byRow[next[r]] = si
		next[r]++
	}

	// Backing arrays: int32 columns [ids | pos | segid | turn | pv],
	// float32 columns [oldlp | adv | vt], the mask, and the per-segment
	// columns.
	i32 := make([]int32, 5*total)
	f32 := make([]float32, 3*total)
	mask := make([]uint8, total)
	fill32(i32[3*total:], -1) // turn ids and policy versions of context
	ramp := make([]int32, len(segs[order[0]].Tokens))
	for j := range ramp {
		ramp[j] = int32(j)
	}
	segTraj := make([]string, n)
	segGroup := make([]string, n)
	segVer := make([]int64, n)
	segLen := make([]int32, n)
	segW := make([]float32, n)
	segTrunc := make([]bool, n)

	out := make([]schemas.PackedRow, rows)
	off := 0
	for r := range out {
		lo, hi := off, off+rowTok[r]
		sl, sh := int(segStart[r]), int(segStart[r+1])
		row := &out[r]
		row.InputIDs = i32[lo:hi:hi]
		row.PositionIDs = i32[total+lo : total+hi : total+hi]
		row.SegmentIDs = i32[2*total+lo : 2*total+hi : 2*total+hi]
		row.TurnIDs = i32[3*total+lo : 3*total+hi : 3*total+hi]
		row.PolicyVersions = i32[4*total+lo : 4*total+hi : 4*total+hi]
		row.OldLogprobs = f32[lo:hi:hi]
		row.Advantages = f32[total+lo : total+hi : total+hi]
		row.ValueTargets = f32[2*total+lo : 2*total+hi : 2*total+hi]
		row.ActionMask = mask[lo:hi:hi]
		row.SegTrajectoryIDs = segTraj[sl:sh:sh]
		row.SegGroupIDs = segGroup[sl:sh:sh]
		row.SegPolicyVersions = segVer[sl:sh:sh]
		row.SegLengths = segLen[sl:sh:sh]
		row.SegWeights = segW[sl:sh:sh]
		row.SegTruncated = segTrunc[sl:sh:sh]

		o := 0
		for k, si := range byRow[sl:sh] {
			seg := &segs[si]
			l := len(seg.Tokens)
			copy(row.InputIDs[o:o+l], seg.Tokens)
			copy(row.PositionIDs[o:o+l], ramp[:l])
			if k > 0 {
				fill32(row.SegmentIDs[o:o+l], int32(k))
			}
			trained, oldest := expand(row, o, seg)
			st.TrainedTokens += int64(trained)
			if seg.Truncated {
				st.Truncated++
			}
			j := sl + k
			segTraj[j] = seg.TrajectoryID
			segGroup[j] = seg.GroupID
			segVer[j] = oldest
			segLen[j] = int32(l)
			segW[j] = seg.Weight
			segTrunc[j] = seg.Truncated
			o += l
		}
		off = hi
	}
	st.Rows = rows
	st.Tokens = int64(total)
	st.Efficiency = float64(total) / (float64(rows) * float64(budget))
	return out, st
}

// expand writes seg's non-stale spans into the target-aligned columns of
// row at offset o (the columns are pre-set to the context values) and
// returns the number of trained entries and their oldest behavior version.
func expand(row *schemas.PackedRow, o int, seg *Segment) (trained int, oldest int64) {
	oldest = -1
	have := false
	l := len(seg.Tokens)
	lp := seg.Logprobs
	for _, sp := range seg.Spans {
		at, n := int(sp.At), int(sp.Len)
		if at < 0 || n < 0 || at+n > l-1 || n > len(lp) {
			panic(fmt.Sprintf("pack: segment %s: span at %d len %d outside %d tokens (%d log-probs left)",
				seg.TrajectoryID, at, n, l, len(lp)))
		}
		src := lp[:n]
		lp = lp[n:]
		if sp.Stale {
			continue
		}
		e := o + at
		copy(row.OldLogprobs[e:e+n], src)
		fill8(row.ActionMask[e:e+n], 1)
		fillF32(row.Advantages[e:e+n], sp.Advantage)
		if sp.ValueTarget != 0 {
			fillF32(row.ValueTargets[e:e+n], sp.ValueTarget)
		}
		fill32(row.TurnIDs[e:e+n], sp.Turn)
		fill32(row.PolicyVersions[e:e+n], int32(sp.PolicyVersion))
		trained += n
		if !have || sp.PolicyVersion < oldest {
			oldest, have = sp.PolicyVersion, true
		}
	}
	return trained, oldest
}

func fill32(s []int32, v int32) {
	for i := range s {
		s[i] = v
	}
}

func fillF32(s []float32, v float32) {
	for i := range s {
		s[i] = v
	}
}

func fill8(s []uint8, v uint8) {
	for i := range s {
		s[i] = v
	}
}
