package train

import (
	"fmt"
	"sort"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/schemas"
)

// LagRule is the lag rule at the optimizer step (docs/PIPELINE.md §15), the same
// for every backend: at an update taken at trainer version v, a trained
// token (action mask 1) whose behavior version b (PackedRow.PolicyVersions,
// per target) has v - b > MaxLag is stale and is never trained. Policy is
// the contract's packing.stale_policy: pack.StaleDrop takes the whole
// segment (trajectory) of a stale token out, pack.StaleMaskTurns masks the
// stale tokens only (turns of an older policy stay as context). A segment
// left with no trained token counts as dropped either way.
//
// Pack judges lag when it admits a record and again when its window closes;
// the trainer's version when it trains a batch can be newer than both (the
// batch waited on the batches topic while earlier ones trained), so pack's
// admission is a filter and this rule is the guarantee.
type LagRule struct {
	MaxLag int64
	Policy string
}

// Validate reports whether r is usable.
func (r LagRule) Validate() error {
	if r.MaxLag < 0 {
		return fmt.Errorf("train: max_lag %d must not be negative", r.MaxLag)
	}
	if r.Policy != pack.StaleDrop && r.Policy != pack.StaleMaskTurns {
		return fmt.Errorf("train: stale_policy %q (want %q or %q)", r.Policy, pack.StaleDrop, pack.StaleMaskTurns)
	}
	return nil
}

// LagOutcome is what LagRule.Apply did to a batch.
type LagOutcome struct {
	// StaleTokens are the trained tokens the rule masked out, StaleLag
	// the same by lag; Lag the tokens left to train by lag.
	StaleTokens int64
	StaleLag    []schemas.LagCount
	Lag         []schemas.LagCount
	// Dropped lists the trajectory ids of segments that had a trained
	// token and have none left (in row, then segment order); Trained those
	// with a trained token left; Masked the tokens masked per trajectory
	// (dropped or not), Left the tokens left to train per trajectory.
	Dropped []string
	Trained []string
	Masked  map[string]int64
	Left    map[string]int64
	// Selection is the segments and groups before and after the rule.
	Selection schemas.UpdateSelection
}

// Apply masks the stale tokens of batch in place (ActionMask set to 0)
// against trainer version v and returns what it did. Segments with no
// trained token before the rule (for example duplicates masked out
// earlier) appear in neither Dropped nor Trained.
func (r LagRule) Apply(batch *schemas.PackedBatch, v int64) LagOutcome {
	out := LagOutcome{Masked: map[string]int64{}, Left: map[string]int64{}}
	stale, kept := map[int64]int64{}, map[int64]int64{}
	groups, trainedGroups := map[string]bool{}, map[string]bool{}
	var length, lengthTrained, before int64
	sel := &out.Selection
	for ri := range batch.Rows {
		row := &batch.Rows[ri]
		nseg := len(row.SegTrajectoryIDs)
		had := make([]int64, nseg)  // trained tokens before the rule
		left := make([]int64, nseg) // after
		hasStale := make([]bool, nseg)
		for i, m := range row.ActionMask {
			if m != 1 {
				continue
			}
			k := row.SegmentIDs[i]
			had[k]++
			if v-int64(row.PolicyVersions[i]) > r.MaxLag {
				hasStale[k] = true
			}
		}
		for i, m := range row.ActionMask {
			if m != 1 {
				continue
			}
			k := row.SegmentIDs[i]
			lag := v - int64(row.PolicyVersions[i])
			if lag > r.MaxLag || (hasStale[k] && r.Policy == pack.StaleDrop) {
				row.ActionMask[i] = 0
				stale[lag]++
				out.StaleTokens++
				out.Masked[row.SegTrajectoryIDs[k]]++
				continue
			}
			left[k]++
			kept[lag]++
		}
		for k, id := range row.SegTrajectoryIDs {
			group, n := segMeta(row, k)
			if had[k] > 0 {
				sel.Segments++
				groups[group] = true
				length += n
				before += had[k]
			}
			switch {
			case had[k] == 0:
			case left[k] == 0:
				out.Dropped = append(out.Dropped, id)
			default:
				out.Trained = append(out.Trained, id)
				out.Left[id] += left[k]
				sel.TrainedSegments++
				trainedGroups[group] = true
				lengthTrained += n
			}
		}
	}
	out.StaleLag, out.Lag = lagCounts(stale), lagCounts(kept)
	sel.Groups, sel.TrainedGroups = len(groups), len(trainedGroups)
	if sel.Segments > 0 {
		sel.LengthMean = float64(length) / float64(sel.Segments)
	}
	if sel.TrainedSegments > 0 {
		sel.LengthMeanTrained = float64(lengthTrained) / float64(sel.TrainedSegments)
	}
	if before > 0 {
		sel.StaleShare = float64(out.StaleTokens) / float64(before)
	}
	return out
}

// checkSegments checks what the stage reads of a row before the backend
// steps on it: that every segment id names one of the row's segments
// (segment_trajectory_ids), and the row's shapes (gpu.CheckRow, which the
// backend checks again). A batch that decodes can still break these (a
// writer other than pack, a corrupted record); the duplicate mask and the
// lag rule index by them.
func checkSegments(row *schemas.PackedRow) error {
	nseg := len(row.SegTrajectoryIDs)
	for i, k := range row.SegmentIDs {
		if k < 0 || int(k) >= nseg {
			return fmt.Errorf("segment_ids[%d] = %d, the row has %d segments", i, k, nseg)
		}
	}
	return gpu.CheckRow(row)
}

// segMeta is segment k's group id and length (empty and 0 in a row
// built without them).
func segMeta(row *schemas.PackedRow, k int) (string, int64) {
	var g string
	var n int64
	if k < len(row.SegGroupIDs) {
		g = row.SegGroupIDs[k]
	}
	if k < len(row.SegLengths) {
		n = int64(row.SegLengths[k])
	}
	return g, n
}

// lagCounts turns a lag histogram into LagCounts in increasing lag order.
func lagCounts(h map[int64]int64) []schemas.LagCount {
	out := make([]schemas.LagCount, 0, len(h))
	for lag, n := range h {
		out = append(out, schemas.LagCount{Lag: lag, Tokens: n})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Lag < out[j].Lag })
	return out
}
