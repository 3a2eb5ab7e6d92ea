package pipeline

import (
	"sort"
	"testing"
)

func points(t *tracker) map[string]int64 {
	out := map[string]int64{}
	for _, c := range t.committable() {
		out[c.Topic+"/"+string(rune('0'+c.Partition))] = c.Offset
	}
	return out
}

func TestTrackerCommitsContiguousPrefixOnly(t *testing.T) {
	tr := newTracker()
	for o := int64(10); o < 15; o++ {
		tr.seen(Ref{"in", 0, o})
	}
	tr.complete(Ref{"in", 0, 11}) // 10 still pending: nothing committable
	if got := points(tr); len(got) != 0 {
		t.Fatalf("committable with a hole at 10: %v", got)
	}
	tr.complete(Ref{"in", 0, 10})
	if got := points(tr)["in/0"]; got != 12 {
		t.Fatalf("commit point = %d, want 12 (10 and 11 done)", got)
	}
	tr.markCommitted(tr.committable())
	if got := points(tr); len(got) != 0 {
		t.Fatalf("nothing new since last commit, got %v", got)
	}
	tr.complete(Ref{"in", 0, 14})
	tr.complete(Ref{"in", 0, 13})
	if got := points(tr); len(got) != 0 {
		t.Fatalf("12 is pending: nothing beyond the last commit may be committable, got %v", got)
	}
	tr.complete(Ref{"in", 0, 12})
	if got := points(tr)["in/0"]; got != 15 {
		t.Fatalf("commit point = %d, want 15", got)
	}
	if n := tr.pending(); n != 0 {
		t.Fatalf("pending = %d", n)
	}
}

func TestTrackerReassignmentResets(t *testing.T) {
	tr := newTracker()
	tr.seen(Ref{"in", 1, 5})
	tr.seen(Ref{"in", 1, 6})
	tr.complete(Ref{"in", 1, 6})
	// Partition re-read from 5 after a rebalance.
	tr.seen(Ref{"in", 1, 5})
	tr.seen(Ref{"in", 1, 6})
	if n := tr.pending(); n != 2 {
		t.Fatalf("pending after reset = %d, want 2", n)
	}
	tr.complete(Ref{"in", 1, 5})
	tr.complete(Ref{"in", 1, 6})
	cs := tr.committable()
	sort.Slice(cs, func(i, j int) bool { return cs[i].Partition < cs[j].Partition })
	if len(cs) != 1 || cs[0].Offset != 7 {
		t.Fatalf("committable = %+v, want in/1 -> 7", cs)
	}
	tr.complete(Ref{"in", 9, 1}) // unknown partition: ignored
}

func TestTrackerNonContiguousOffsets(t *testing.T) {
	tr := newTracker()
	for _, o := range []int64{3, 7, 8, 20} { // compaction or control records leave gaps
		tr.seen(Ref{"in", 0, o})
	}
	for _, o := range []int64{20, 7, 3} {
		tr.complete(Ref{"in", 0, o})
	}
	if got := points(tr)["in/0"]; got != 8 {
		t.Fatalf("commit point = %d, want 8 (offset 8 pending)", got)
	}
	tr.complete(Ref{"in", 0, 8})
	if got := points(tr)["in/0"]; got != 21 {
		t.Fatalf("commit point = %d, want 21", got)
	}
}
