package advantage_test

import (
	"errors"
	"testing"

	"github.com/trajflow/trajflow/internal/redelivery"
	"github.com/trajflow/trajflow/operators/advantage"
)

// TestRedeliveryTable: the shared table of testdata/dedup (the pack Window
// is held to the same rows). An identical redelivery of a member of an
// open group is a Duplicate the Assembler counts; the same record id with
// other content is malformed input (ErrInvalid, counted Malformed) and the
// group keeps its first delivery.
func TestRedeliveryTable(t *testing.T) {
	cases, err := redelivery.Load("../../testdata/dedup/redelivery.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(cases) < 5 {
		t.Fatalf("%d cases", len(cases))
	}
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			again, err := c.Redelivered()
			if err != nil {
				t.Fatal(err)
			}
			a := advantage.NewAssembler(4)
			if out, g, err := a.Offer(c.Record()); out != advantage.Added || g != nil || err != nil {
				t.Fatalf("first delivery: %v, %d members, %v", out, len(g), err)
			}
			out, g, err := a.Offer(again)
			want := advantage.AssemblerStats{Added: 1}
			switch c.Want {
			case redelivery.Duplicate:
				if out != advantage.Duplicate || g != nil || err != nil {
					t.Fatalf("redelivery: %v, %d members, %v; want a duplicate", out, len(g), err)
				}
				want.Duplicates = 1
			case redelivery.Malformed:
				if out != advantage.Malformed || g != nil || !errors.Is(err, advantage.ErrInvalid) {
					t.Fatalf("redelivery: %v, %d members, %v; want malformed (ErrInvalid)", out, len(g), err)
				}
				if want := "advantage: invalid input: record r0 of group g delivered again with other content"; err.Error() != want {
					t.Errorf("error %q, want %q", err, want)
				}
				want.Malformed = 1
			}
			if st := a.Stats(); st != want {
				t.Fatalf("stats %+v, want %+v", st, want)
			}
			// Add, the form without an error, counts the same way.
			b := advantage.NewAssembler(4)
			b.Add(c.Record())
			b.Add(again)
			if st := b.Stats(); st != want {
				t.Fatalf("Add: stats %+v, want %+v", st, want)
			}
			// The group keeps the first delivery.
			members, ok := a.Close("g")
			if !ok || len(members) != 1 {
				t.Fatalf("close: %d members, %v", len(members), ok)
			}
			first := c.Record()
			if members[0].Turns[1].ActionIDs[0] != first.Turns[1].ActionIDs[0] || members[0].RewardTotal != first.RewardTotal {
				t.Fatalf("the group holds the second delivery")
			}
			// Once the group is emitted its content is not kept: a
			// redelivery of either kind is Late.
			if out, _, err := a.Offer(again); out != advantage.Late || err != nil {
				t.Fatalf("after close: %v, %v; want late", out, err)
			}
		})
	}
}
