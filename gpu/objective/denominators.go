package objective

import (
	"fmt"

	"github.com/trajflow/trajflow/schemas"
)

// Denominators are the global normalizers of one update (docs/PIPELINE.md §13:
// "gradient accumulation and distributed denominator"; §14: "globally
// normalize using true valid-token/sample denominators"). They are counted
// once over every row of the global batch and passed unchanged to every
// microbatch's Compute, so that the microbatch losses (and gradients) sum to
// the loss (and gradient) of the whole batch.
type Denominators struct {
	// Tokens is the number of masked (trained) tokens in the global batch.
	Tokens int64 `json:"tokens"`
	// Sequences is the number of sequences (packed segments) in the global
	// batch that have at least one masked token. Sequences with no trained
	// token are not counted: they contribute nothing to any mode.
	Sequences int64 `json:"sequences"`
}

// Add returns the element-wise sum of d and o (denominators of disjoint row
// sets add up).
func (d Denominators) Add(o Denominators) Denominators {
	return Denominators{Tokens: d.Tokens + o.Tokens, Sequences: d.Sequences + o.Sequences}
}

// CountDenominators counts the denominators of one row: the masked tokens,
// and the distinct segments owning at least one of them. mask values must be
// 0 or 1; segment ids must lie in [0, len(mask)) (a row of T positions holds
// at most T segments). Segment ids are read per position, so a segment need
// not be contiguous. Errors wrap ErrShape or ErrInput.
func CountDenominators(mask []uint8, segmentIDs []int32) (Denominators, error) {
	var d Denominators
	perSeg, err := segmentCounts(mask, segmentIDs)
	if err != nil {
		return d, err
	}
	for _, n := range perSeg {
		if n > 0 {
			d.Tokens += int64(n)
			d.Sequences++
		}
	}
	return d, nil
}

// segmentCounts returns, indexed by segment id, the number of masked
// positions of each segment of one row.
func segmentCounts(mask []uint8, segmentIDs []int32) ([]int32, error) {
	T := len(mask)
	if len(segmentIDs) != T {
		return nil, fmt.Errorf("objective: %d segment ids for %d mask entries: %w", len(segmentIDs), T, ErrShape)
	}
	var maxSeg int32 = -1
	for i, s := range segmentIDs {
		if s < 0 || int(s) >= T {
			return nil, fmt.Errorf("objective: segment id %d at position %d not in [0, %d): %w", s, i, T, ErrInput)
		}
		if s > maxSeg {
			maxSeg = s
		}
	}
	counts := make([]int32, maxSeg+1)
	for i, m := range mask {
		switch m {
		case 0:
		case 1:
			counts[segmentIDs[i]]++
		default:
			return nil, fmt.Errorf("objective: action mask %d at position %d (want 0 or 1): %w", m, i, ErrInput)
		}
	}
	return counts, nil
}

// GlobalDenominators sums CountDenominators over every row of a global
// batch (schemas.PackedRow.ActionMask and SegmentIDs). Pass all rows the
// update consumes, not only one microbatch's.
func GlobalDenominators(rows ...schemas.PackedRow) (Denominators, error) {
	var total Denominators
	for r := range rows {
		d, err := CountDenominators(rows[r].ActionMask, rows[r].SegmentIDs)
		if err != nil {
			return Denominators{}, fmt.Errorf("row %d: %w", r, err)
		}
		total = total.Add(d)
	}
	return total, nil
}
