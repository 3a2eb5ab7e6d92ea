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
	// NewestTrained is the newest behavior version of a trained entry and
	// NewestOldest the newest among the segments' oldest trained versions
	// (-1 when no entry is trained): what NewestKept reads back from the
	// packed columns, taken here from the spans (see Stats.NewestKept).
	NewestTrained int64
	NewestOldest  int64
}

// NewestKept is NewestKept of the packed batch under stalePolicy, from the
// spans the packing walked rather than a scan of every token: the newest
// trained version, or under StaleDrop the newest of the segments' oldest.
func (st Stats) NewestKept(stalePolicy string) int64 {
	if stalePolicy == StaleDrop {
		return st.NewestOldest
	}
	return st.NewestTrained
}

// Pack packs segments into rows of at most budget tokens (docs/PIPELINE.md §11,
// docs/PIPELINE.md §11) and expands their target-aligned columns.
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
// segment boundary. RefLogprobs is left nil: the trainer computes them when
// the KL term is in the loss (docs/PIPELINE.md §12).
// The per-segment columns take TrajectoryID, GroupID, the oldest behavior
// version of the trained tokens (-1 when none), the length, Weight and
// Truncated.
//
// Preconditions (violations are programming errors and panic): budget > 0;
// every segment has 1..budget tokens; spans are in stream order, do not
// overlap, and lie inside their segment (At >= 0, At+Len <= Len()-1);
// Logprobs holds the spans' entries.
// Reconstruct with Options.TokenBudget <= budget guarantees them.
//
// The columns of a row share backing arrays; every slice is capped at its
// length, so appending to one never writes into another.
func Pack(segs []Segment, budget int) ([]schemas.PackedRow, Stats) {
	return PackInto(nil, segs, budget)
}

// Columns keeps the token-aligned backing arrays of packed batches for
// reuse: a packed batch of many MB is then not allocated (and zeroed) for
// every window.
type Columns struct {
	i32  []int32
	f32  []float32
	mask []uint8
}

// reuse returns s resized to n when its capacity suffices (reused: true),
// else a fresh zeroed slice.
func reuse[E any](s []E, n int) ([]E, bool) {
	if cap(s) >= n {
		return s[:n], true
	}
	return make([]E, n), false
}

// PackInto is Pack with the token-aligned columns built in c's arrays
// (nil c: fresh arrays, as Pack). The rows of the previous batch packed
// into c are overwritten: the caller must be done with them.
func PackInto(c *Columns, segs []Segment, budget int) ([]schemas.PackedRow, Stats) {
	st := Stats{Budget: budget, Segments: len(segs), NewestTrained: -1, NewestOldest: -1}
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

	// Backing arrays. Per row: int32 columns [ids | pos | segid | turn |
	// pv], float32 columns [oldlp | adv | vt] and the mask, allocated row
	// by row so that a row's memory is zeroed and then written while it is
	// still in cache (one ~1 MiB row at a 32768-token budget). The
	// per-segment columns of all rows share one array each.
	//
	// Sources for copies (memmove is vectorized, a fill loop is not):
	// 0, 1, 2, ... for positions and -1 for context turn ids and versions.
	maxLen := len(segs[order[0]].Tokens)
	ramp := make([]int32, 2*maxLen)
	for j := range maxLen {
		ramp[j] = int32(j)
		ramp[maxLen+j] = -1
	}
	neg := ramp[maxLen:]
	segTraj := make([]string, n)
	segGroup := make([]string, n)
	segVer := make([]int64, n)
	segLen := make([]int32, n)
	segW := make([]float32, n)
	segTrunc := make([]bool, n)

	// Each column's values of all rows lie back to back in one array, in
	// row order: one array per column to reuse for the next batch
	// (PackInto), and ToRecord shares it instead of copying.
	packed := 0
	for _, rl := range rowTok {
		packed += rl
	}
	var i32 []int32
	var f32 []float32
	var mask []uint8
	if c == nil {
		i32, f32, mask = make([]int32, 5*packed), make([]float32, 3*packed), make([]uint8, packed)
	} else {
		// The columns that expand leaves at zero (mask, log-probs,
		// advantages, value targets of context entries) and the first
		// segment's segment ids must start at zero; the others are
		// written in full.
		var again bool
		if i32, again = reuse(c.i32, 5*packed); again {
			clear(i32[2*packed : 3*packed])
		}
		if f32, again = reuse(c.f32, 3*packed); again {
			clear(f32)
		}
		if mask, again = reuse(c.mask, packed); again {
			clear(mask)
		}
		c.i32, c.f32, c.mask = i32, f32, mask
	}
	col32 := func(c, off, rl int) []int32 { return i32[c*packed+off : c*packed+off+rl : c*packed+off+rl] }
	colF := func(c, off, rl int) []float32 { return f32[c*packed+off : c*packed+off+rl : c*packed+off+rl] }
	out := make([]schemas.PackedRow, rows)
	off := 0
	for r := range out {
		rl := rowTok[r]
		sl, sh := int(segStart[r]), int(segStart[r+1])
		row := &out[r]
		row.InputIDs = col32(0, off, rl)
		row.PositionIDs = col32(1, off, rl)
		row.SegmentIDs = col32(2, off, rl)
		row.TurnIDs = col32(3, off, rl)
		row.PolicyVersions = col32(4, off, rl)
		row.OldLogprobs = colF(0, off, rl)
		row.Advantages = colF(1, off, rl)
		row.ValueTargets = colF(2, off, rl)
		row.ActionMask = mask[off : off+rl : off+rl]
		off += rl
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
			trained, oldest, newest := expand(row, o, seg, neg)
			st.TrainedTokens += int64(trained)
			if trained > 0 {
				st.NewestTrained = max(st.NewestTrained, newest)
				st.NewestOldest = max(st.NewestOldest, oldest)
			}
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
	}
	st.Rows = rows
	st.Tokens = int64(total)
	st.Efficiency = float64(total) / (float64(rows) * float64(budget))
	return out, st
}

// expand writes the target-aligned columns of seg into row at offset o,
// each entry once, in stream order: context runs get turn id and version
// -1 (copied from neg, which holds at least len(seg.Tokens) entries of -1;
// mask, log-prob, advantage and value stay 0 as allocated), non-stale spans
// get their values; a span of no entries is context too. It returns the
// number of trained entries and their oldest and newest behavior versions
// (-1 when none).
func expand(row *schemas.PackedRow, o int, seg *Segment, neg []int32) (trained int, oldest, newest int64) {
	oldest, newest = -1, -1
	have := false
	l := len(seg.Tokens)
	lp := seg.Logprobs
	turn := row.TurnIDs[o : o+l]
	ver := row.PolicyVersions[o : o+l]
	cur := 0 // entries before cur are written
	for _, sp := range seg.Spans {
		at, n := int(sp.At), int(sp.Len)
		if at < cur || n < 0 || at+n > l-1 || n > len(lp) {
			panic(fmt.Sprintf("pack: segment %s: span at %d len %d outside %d tokens, before entry %d, or without log-probs (%d left)",
				seg.TrajectoryID, at, n, l, cur, len(lp)))
		}
		src := lp[:n]
		lp = lp[n:]
		if sp.Stale || sp.Older || n == 0 {
			continue // context: written with the next gap
		}
		copy(turn[cur:at], neg)
		copy(ver[cur:at], neg)
		e := o + at
		copy(row.OldLogprobs[e:e+n], src)
		// One pass writes the five constant columns of the span.
		m := row.ActionMask[e : e+n]
		adv := row.Advantages[e : e+n][:len(m)]
		vt := row.ValueTargets[e : e+n][:len(m)]
		tu := turn[at : at+n][:len(m)]
		pv := ver[at : at+n][:len(m)]
		a, v, t, p := sp.Advantage, sp.ValueTarget, sp.Turn, int32(sp.PolicyVersion)
		for j := range m {
			m[j] = 1
			adv[j] = a
			vt[j] = v
			tu[j] = t
			pv[j] = p
		}
		cur = at + n
		trained += n
		if !have || sp.PolicyVersion < oldest {
			oldest, have = sp.PolicyVersion, true
		}
		newest = max(newest, sp.PolicyVersion)
	}
	copy(turn[cur:], neg)
	copy(ver[cur:], neg)
	return trained, oldest, newest
}

func fill32(s []int32, v int32) {
	for i := range s {
		s[i] = v
	}
}
