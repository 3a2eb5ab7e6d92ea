package advantage_test

import (
	"encoding/binary"
	"errors"
	"math"
	"testing"

	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/schemas"
)

// byteReader hands out fuzz bytes; past the end it returns zeros.
type byteReader struct{ b []byte }

func (r *byteReader) u8() byte {
	if len(r.b) == 0 {
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *byteReader) u32() uint32 {
	var buf [4]byte
	for i := range buf {
		buf[i] = r.u8()
	}
	return binary.LittleEndian.Uint32(buf[:])
}

// FuzzScoreGroup: arbitrary groups (bad scopes and turn indexes, NaN and
// huge values, mixed endings; zero-variance groups kept, dropped or, for
// GRPO and RLOO, penalized when they failed whole) either fail with one of
// the package's errors or give well-formed, finite, sorted output. Never a
// panic.
func FuzzScoreGroup(f *testing.F) {
	f.Add([]byte{0, 3, 2, 1, 0, 0, 0, 128, 63, 1, 0, 0})
	f.Add([]byte{2, 4, 1, 9, 3, 1, 0, 0, 192, 127, 7, 7, 7, 7})
	f.Add([]byte{1, 2, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5})
	estimators := allEstimators()
	names := []string{"grpo", "rloo", "gae"}
	f.Fuzz(func(t *testing.T, data []byte) {
		br := &byteReader{b: data}
		opts := estimators[names[int(br.u8())%3]]
		size := int32(1 + br.u8()%8)
		n := 1 + int(br.u8())%int(size)
		var members []schemas.Rewarded
		for m := range n {
			id := string(rune('a' + m))
			r := schemas.Rewarded{Trajectory: schemas.Trajectory{
				RecordID: id, GroupID: "g", GroupSize: size, Member: int32(m),
				Status: schemas.StatusCompleted, End: schemas.EndTerminated,
			}}
			if br.u8()%2 == 1 {
				r.End, r.EndReason, r.BootstrapValue = schemas.EndTruncated, "max_turns", math.Float32frombits(br.u32())
			}
			turns := 1 + int(br.u8()%6)
			for i := range turns {
				r.Turns = append(r.Turns, schemas.Turn{Index: int32(i), ActionIDs: make([]int32, 4), Value: float32(int8(br.u8())) / 16})
			}
			for range int(br.u8() % 4) {
				scope := []string{schemas.ScopeTrajectory, schemas.ScopeTurn, schemas.ScopeSpan, "bogus"}[br.u8()%4]
				c := schemas.RewardComponent{TrajectoryID: id, Name: "c", Scope: scope, Turn: int32(int8(br.u8())) % 8,
					SpanStart: int32(br.u8() % 6), SpanEnd: int32(br.u8() % 6), Value: float64(math.Float32frombits(br.u32()))}
				r.Rewards = append(r.Rewards, c)
			}
			members = append(members, r)
		}
		if opts.Estimator != advantage.GAE && br.u8()%2 == 1 {
			opts.ZeroVariance = advantage.ZeroVarPenalizeFailed
		}
		out, err := advantage.ScoreGroup(opts, members)
		if err != nil {
			for _, want := range []error{advantage.ErrInvalid, advantage.ErrNoCritic, advantage.ErrUnavailable, advantage.ErrInfra, advantage.ErrOptions} {
				if errors.Is(err, want) {
					return
				}
			}
			t.Fatalf("error wraps none of the package errors: %v", err)
		}
		if len(out) != n {
			t.Fatalf("%d outputs for %d members", len(out), n)
		}
		for k, s := range out {
			if s.Member != int32(k) {
				t.Fatalf("output %d is member %d", k, s.Member)
			}
			for _, col := range [][]float32{s.TurnRewards, s.TurnReturns, s.TurnAdvantages, s.TurnValueTargets} {
				if len(col) != len(s.Turns) {
					t.Fatalf("member %d: column of %d for %d turns", k, len(col), len(s.Turns))
				}
				for _, x := range col {
					if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
						t.Fatalf("member %d: non-finite output %v", k, x)
					}
				}
			}
			switch s.Group.Filtered {
			case "", advantage.FilterIncomplete, advantage.FilterZeroVariance:
			default:
				t.Fatalf("filter reason %q", s.Group.Filtered)
			}
			if s.Group.Incomplete != (int32(n) < size) || s.EstimatorVersion == "" {
				t.Fatalf("group %+v version %q", s.Group, s.EstimatorVersion)
			}
		}
	})
}
