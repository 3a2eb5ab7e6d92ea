package pack

import (
	"errors"
	"testing"

	"github.com/trajflow/trajflow/internal/redelivery"
	"github.com/trajflow/trajflow/schemas"
)

// scoredOf is a scored form of a table record: one advantage and value
// target per turn.
func scoredOf(r schemas.Rewarded) schemas.Scored {
	return schemas.Scored{Rewarded: r, TurnAdvantages: []float32{1, 1}, TurnValueTargets: []float32{1, 1}}
}

// TestRedeliveryTable: the shared table of testdata/dedup (the advantage
// Assembler is held to the same rows). An identical redelivery is a
// Duplicate the window counts, in the open window and after it closed; the
// same record id with other content is ErrMalformed and the first
// decision stands.
func TestRedeliveryTable(t *testing.T) {
	cases, err := redelivery.Load("../../testdata/dedup/redelivery.yaml")
	if err != nil {
		t.Fatal(err)
	}
	opts := Options{TokenBudget: 64, BatchTokens: 1 << 20, Overflow: OverflowReject, MaxLag: 4, StalePolicy: StaleDrop}
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			again, err := c.Redelivered()
			if err != nil {
				t.Fatal(err)
			}
			for _, closeFirst := range []bool{false, true} {
				w, err := NewWindow(opts, 4)
				if err != nil {
					t.Fatal(err)
				}
				if res, err := w.Add(scoredOf(c.Record())); err != nil || res.Outcome != Admitted {
					t.Fatalf("first delivery: %+v, %v", res, err)
				}
				if closeFirst {
					if b, _ := w.Close(0, "run", "h", 4); len(b.Rows) != 1 {
						t.Fatalf("closed batch of %d rows", len(b.Rows))
					}
				}
				res, err := w.Add(scoredOf(again))
				switch c.Want {
				case redelivery.Duplicate:
					if err != nil || res.Outcome != Duplicate || w.Duplicates() != 1 {
						t.Fatalf("closed %v: redelivery %+v, %v, %d duplicates; want one duplicate", closeFirst, res, err, w.Duplicates())
					}
				case redelivery.Malformed:
					if !errors.Is(err, ErrMalformed) || res.Outcome != 0 || w.Duplicates() != 0 {
						t.Fatalf("closed %v: redelivery %+v, %v, %d duplicates; want ErrMalformed", closeFirst, res, err, w.Duplicates())
					}
					if want := "pack: malformed scored trajectory: record r0 of group g delivered again with other content"; err.Error() != want {
						t.Errorf("error %q, want %q", err, want)
					}
				}
				// The first decision stands: one segment with the first
				// delivery's last action token.
				if !closeFirst {
					b, closed := w.Close(0, "run", "h", 4)
					if len(b.Rows) != 1 || len(closed.Admitted) != 1 || !containsToken(b.Rows[0].InputIDs, 7) {
						t.Fatalf("batch %+v", b.Rows)
					}
				}
			}
			// An id restored with MarkSeen has no content to compare.
			w, _ := NewWindow(opts, 4)
			w.MarkSeen("r0")
			if res, err := w.Add(scoredOf(again)); err != nil || res.Outcome != Duplicate {
				t.Fatalf("after MarkSeen: %+v, %v", res, err)
			}
		})
	}
}

func containsToken(ids []int32, tok int32) bool {
	for _, x := range ids {
		if x == tok {
			return true
		}
	}
	return false
}
