package cuda

import (
	"math/rand/v2"

	"github.com/trajflow/trajflow/schemas"
)

// randomBatch builds a well-formed packed batch of `rows` rows of about
// rowLen tokens over vocabulary V: segments of random lengths (positions
// restart at 0), trained tokens at random non-final positions of each
// segment, behavior log-probs in [-4, -0.05], advantages in [-2, 2] (some
// exactly 0), policy versions in [0, version], and reference log-probs
// when withRef.
func randomBatch(rng *rand.Rand, rows, rowLen, V int, withRef bool, version int32) schemas.PackedBatch {
	b := schemas.PackedBatch{BatchID: "b", RunID: "r", ContractHash: "c", TokenBudget: int32(rowLen + 8)}
	for r := 0; r < rows; r++ {
		n := rowLen/2 + rng.IntN(rowLen/2+1)
		var row schemas.PackedRow
		seg := int32(-1)
		left := 0
		for i := 0; i < n; i++ {
			if left == 0 {
				seg++
				left = 2 + rng.IntN(12)
				if left > n-i {
					left = n - i
				}
				row.SegLengths = append(row.SegLengths, int32(left))
			}
			pos := int32(0)
			if i > 0 && row.SegmentIDs[i-1] == seg {
				pos = row.PositionIDs[i-1] + 1
			}
			row.InputIDs = append(row.InputIDs, int32(1+rng.IntN(V-1)))
			row.PositionIDs = append(row.PositionIDs, pos)
			row.SegmentIDs = append(row.SegmentIDs, seg)
			left--
			m := uint8(0)
			if left > 0 && rng.Float64() < 0.7 {
				m = 1
			}
			row.ActionMask = append(row.ActionMask, m)
			row.OldLogprobs = append(row.OldLogprobs, -0.05-4*rng.Float32())
			a := 4*rng.Float32() - 2
			if rng.IntN(10) == 0 {
				a = 0
			}
			row.Advantages = append(row.Advantages, a)
			row.PolicyVersions = append(row.PolicyVersions, int32(rng.IntN(int(version)+1)))
			if withRef {
				row.RefLogprobs = append(row.RefLogprobs, -0.05-4*rng.Float32())
			}
		}
		b.Rows = append(b.Rows, row)
	}
	return b
}
