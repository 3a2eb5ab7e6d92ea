package pack

import (
	"errors"
	"testing"

	"github.com/trajflow/trajflow/schemas"
)

// scoredFromBytes builds a trajectory from fuzz input: each group of four
// bytes is a turn (prompt, action and observation lengths, lag and flags).
// Flag bits produce malformed columns on purpose.
func scoredFromBytes(data []byte, tv int64) schemas.Scored {
	var s schemas.Scored
	s.RecordID, s.GroupID = "f", "g"
	tok := int32(1)
	ids := func(n int) []int32 {
		var out []int32
		for range n {
			out = append(out, tok)
			tok++
		}
		return out
	}
	for len(data) >= 4 {
		p, a, o, x := int(data[0]%9), int(data[1]%9), int(data[2]%9), data[3]
		data = data[4:]
		t := schemas.Turn{Index: int32(len(s.Turns)), PromptIDs: ids(p), ActionIDs: ids(a), ObservationIDs: ids(o),
			PolicyVersion: tv - int64(x%4), Decision: schemas.DecisionOK}
		nlp := a
		if x&0x40 != 0 {
			nlp++ // malformed: one log-prob too many
		}
		for i := range nlp {
			t.ActionLogprobs = append(t.ActionLogprobs, -float32(i+1))
		}
		s.Turns = append(s.Turns, t)
		s.TurnAdvantages = append(s.TurnAdvantages, float32(x%7)-3)
		s.TurnValueTargets = append(s.TurnValueTargets, float32(x%5))
		if x&0x80 != 0 && x&0x20 != 0 {
			s.TurnAdvantages = append(s.TurnAdvantages, 0) // malformed: extra advantage
		}
	}
	return s
}

// FuzzReconstructPack checks that no input makes Reconstruct or Pack panic,
// that errors are the declared ones, and that every admitted trajectory
// packs to exactly the naive per-token reference.
func FuzzReconstructPack(f *testing.F) {
	f.Add([]byte{3, 2, 1, 0, 1, 3, 0, 1}, uint8(16), uint8(1), uint8(0))
	f.Add([]byte{0, 4, 2, 2, 2, 2, 2, 0}, uint8(5), uint8(0), uint8(3))
	f.Add([]byte{1, 1, 1, 0x40}, uint8(8), uint8(2), uint8(1))
	f.Add([]byte{8, 8, 8, 0xA0, 8, 8, 8, 3}, uint8(9), uint8(1), uint8(2))
	f.Fuzz(func(t *testing.T, data []byte, budget, maxLag, mode uint8) {
		const tv = 10
		o := Options{
			TokenBudget: int(budget%64) + 1,
			BatchTokens: 1,
			MaxLag:      int64(maxLag % 4),
			Overflow:    []string{OverflowReject, OverflowTruncate}[mode&1],
			StalePolicy: []string{StaleDrop, StaleMaskTurns}[(mode>>1)&1],
		}
		s := scoredFromBytes(data, tv)
		seg, f, err := Reconstruct(&s, tv, o)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("unexpected error %v", err)
			}
			return
		}
		ref, rf := reference(&s, tv, o)
		if f != rf {
			t.Fatalf("filter %q, reference %q", f, rf)
		}
		if f != FilterNone {
			return
		}
		// Two copies: when they share a row, the boundary between them is
		// checked too.
		twin := seg
		twin.TrajectoryID = "f2"
		rows, st := Pack([]Segment{seg, twin}, o.TokenBudget)
		checkRows(t, rows, st, o.TokenBudget, map[string]refColumns{"f": ref, "f2": ref})
	})
}
