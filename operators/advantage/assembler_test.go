package advantage_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"

	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/schemas"
)

func rec(group string, size, member int32, id string) schemas.Rewarded {
	return schemas.Rewarded{Trajectory: schemas.Trajectory{
		RecordID: id, GroupID: group, GroupSize: size, Member: member, Status: schemas.StatusCompleted,
	}}
}

func members(g []schemas.Rewarded) []string {
	var out []string
	for _, r := range g {
		out = append(out, fmt.Sprintf("%d:%s", r.Member, r.RecordID))
	}
	return out
}

func TestAssemblerCompletes(t *testing.T) {
	a := advantage.NewAssembler(16)
	steps := []struct {
		r        schemas.Rewarded
		done     bool
		want     []string
		pending  int
		buffered int
	}{
		{r: rec("A", 3, 2, "a2"), pending: 1, buffered: 1},
		{r: rec("B", 2, 1, "b1"), pending: 2, buffered: 2},
		{r: rec("A", 3, 0, "a0"), pending: 2, buffered: 3},
		{r: rec("A", 3, 0, "a0"), pending: 2, buffered: 3},       // redelivery: duplicate
		{r: rec("A", 3, 0, "a0-retry"), pending: 2, buffered: 3}, // another record for slot 0: conflict
		{r: rec("A", 4, 1, "a1-bad"), pending: 2, buffered: 3},   // group size disagrees: conflict
		{r: rec("B", 2, 5, "b5"), pending: 2, buffered: 3},       // member out of range: rejected
		{r: withStatus(rec("A", 3, 1, "a1-infra"), schemas.StatusInfra), pending: 2, buffered: 3},
		{r: rec("A", 3, 1, "a1"), done: true, want: []string{"0:a0", "1:a1", "2:a2"}, pending: 1, buffered: 1},
		{r: rec("A", 3, 1, "a1"), pending: 1, buffered: 1}, // late: A already emitted
		{r: rec("B", 2, 0, "b0"), done: true, want: []string{"0:b0", "1:b1"}, pending: 0, buffered: 0},
	}
	for i, s := range steps {
		g, done := a.Add(s.r)
		if done != s.done || !slices.Equal(members(g), s.want) {
			t.Fatalf("step %d: Add(%s) = %v, %v; want %v, %v", i, s.r.RecordID, members(g), done, s.want, s.done)
		}
		if a.Pending() != s.pending || a.Buffered() != s.buffered {
			t.Fatalf("step %d: pending %d buffered %d, want %d %d", i, a.Pending(), a.Buffered(), s.pending, s.buffered)
		}
	}
	want := advantage.AssemblerStats{Added: 5, Duplicates: 1, Conflicts: 2, Late: 1, Rejected: 1, Infra: 1}
	if got := a.Stats(); got != want {
		t.Fatalf("stats %+v, want %+v", got, want)
	}
	var total int64
	for _, v := range []int64{want.Added, want.Duplicates, want.Conflicts, want.Late, want.Rejected, want.Infra} {
		total += v
	}
	if total != int64(len(steps)) {
		t.Fatalf("counters cover %d records of %d", total, len(steps))
	}
}

func withStatus(r schemas.Rewarded, s string) schemas.Rewarded { r.Status = s; return r }

func TestAssemblerOpenAndClose(t *testing.T) {
	a := advantage.NewAssembler(0)
	a.Add(rec("Z", 4, 3, "z3"))
	a.Add(rec("Y", 4, 0, "y0"))
	a.Add(rec("Z", 4, 1, "z1"))
	a.Add(rec("X", 2, 0, "x0"))
	open := a.Open()
	want := []advantage.OpenGroup{
		{GroupID: "Z", Have: 2, Expected: 4, FirstSeq: 1},
		{GroupID: "Y", Have: 1, Expected: 4, FirstSeq: 2},
		{GroupID: "X", Have: 1, Expected: 2, FirstSeq: 4},
	}
	if !slices.Equal(open, want) {
		t.Fatalf("Open() = %+v, want %+v", open, want)
	}
	g, ok := a.Close("Z")
	if !ok || !slices.Equal(members(g), []string{"1:z1", "3:z3"}) {
		t.Fatalf("Close(Z) = %v, %v", members(g), ok)
	}
	if _, ok := a.Close("Z"); ok {
		t.Fatal("Close of a closed group succeeded")
	}
	if _, ok := a.Close("nope"); ok {
		t.Fatal("Close of an unknown group succeeded")
	}
	if a.Pending() != 2 || a.Buffered() != 2 {
		t.Fatalf("pending %d buffered %d after close", a.Pending(), a.Buffered())
	}
	// With no memory, a late record of Z reopens it.
	a.Add(rec("Z", 4, 0, "z0"))
	if a.Pending() != 3 || a.Stats().Late != 0 {
		t.Fatalf("pending %d late %d", a.Pending(), a.Stats().Late)
	}
}

func TestAssemblerMemoryEvictsOldest(t *testing.T) {
	a := advantage.NewAssembler(2)
	for _, g := range []string{"A", "B", "C"} {
		if _, done := a.Add(rec(g, 1, 0, g+"0")); !done {
			t.Fatalf("group %s of size 1 did not complete", g)
		}
	}
	// A was forgotten (capacity 2), B and C are remembered.
	if _, done := a.Add(rec("A", 1, 0, "A0")); !done {
		t.Fatal("forgotten group A was not emitted again")
	}
	a.Add(rec("C", 1, 0, "C0"))
	if st := a.Stats(); st.Late != 1 || st.Added != 4 {
		t.Fatalf("stats %+v", st)
	}
}

// TestAssemblerGroupSizeIsAClaim: the first record of a group declaring
// a huge size opens it (the size is legal) without allocating member
// slots for the size it claims: the group holds what arrived.
func TestAssemblerGroupSizeIsAClaim(t *testing.T) {
	const claim = 1 << 20
	a := advantage.NewAssembler(16)
	out, group, err := a.Offer(rec("G", claim, 0, "g0"))
	if out != advantage.Added || group != nil || err != nil {
		t.Fatalf("first member of a group of %d: %v %v %v", claim, out, members(group), err)
	}
	if open := a.Open(); len(open) != 1 || open[0].Expected != claim || open[0].Have != 1 {
		t.Fatalf("open groups %+v", open)
	}
	group, ok := a.Close("G")
	if !ok || len(group) != 1 {
		t.Fatalf("closed group: %v %v", members(group), ok)
	}
	if c := cap(group); c >= 1<<10 {
		t.Fatalf("a group of one record claiming %d members holds %d slots: sized by the claim", claim, c)
	}
}

// TestAssemblerOrderIndependent: whatever the arrival order, the same groups
// complete with the same sorted members, and ScoreGroup gives the same output.
func TestAssemblerOrderIndependent(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	var all []schemas.Rewarded
	for g := range 10 {
		all = append(all, randomGroup(rng, fmt.Sprintf("g%02d", g), 1+rng.IntN(8), 4)...)
	}
	opts := allEstimators()["gae"]
	score := func(in []schemas.Rewarded) map[string][]schemas.Scored {
		a := advantage.NewAssembler(100)
		out := map[string][]schemas.Scored{}
		for _, r := range in {
			if g, done := a.Add(r); done {
				s, err := advantage.ScoreGroup(opts, g)
				if err != nil {
					t.Fatal(err)
				}
				out[g[0].GroupID] = s
			}
		}
		if a.Pending() != 0 {
			t.Fatalf("%d groups left open", a.Pending())
		}
		return out
	}
	want := score(all)
	if len(want) != 10 {
		t.Fatalf("%d groups completed, want 10", len(want))
	}
	for range 5 {
		in := slices.Clone(all)
		rng.Shuffle(len(in), func(i, j int) { in[i], in[j] = in[j], in[i] })
		in = append(in, in[:7]...) // redeliveries
		got := score(in)
		for id, s := range want {
			if !reflect.DeepEqual(got[id], s) {
				t.Fatalf("group %s differs under another arrival order", id)
			}
		}
	}
}

func TestCheckMember(t *testing.T) {
	tests := []struct {
		r    schemas.Rewarded
		want error
	}{
		{rec("g", 2, 1, "x"), nil},
		{rec("", 2, 1, "x"), advantage.ErrInvalid},
		{rec("g", 2, 1, ""), advantage.ErrInvalid},
		{rec("g", 0, 0, "x"), advantage.ErrInvalid},
		{rec("g", 2, -1, "x"), advantage.ErrInvalid},
		{rec("g", 2, 2, "x"), advantage.ErrInvalid},
		{withStatus(rec("g", 2, 1, "x"), schemas.StatusInfra), advantage.ErrInfra},
	}
	for i, tc := range tests {
		if err := advantage.CheckMember(&tc.r); !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
			t.Errorf("case %d: %v, want %v", i, err, tc.want)
		}
	}
}

// TestAssemblerAbsent: declared slots count toward completion; the first
// record or declaration for a slot wins; declarations for unknown groups,
// slots out of range, held or already declared slots change nothing.
func TestAssemblerAbsent(t *testing.T) {
	a := advantage.NewAssembler(16)
	type step struct {
		add      *schemas.Rewarded // else a declaration
		group    string
		member   int32
		done     bool
		want     []string
		declared int64
	}
	r := func(group string, size, member int32, id string) *schemas.Rewarded {
		x := rec(group, size, member, id)
		return &x
	}
	steps := []step{
		{group: "A", member: 1},                     // A not open: ignored
		{add: r("A", 4, 0, "a0")},                   // opens A
		{group: "A", member: 4},                     // out of range
		{group: "A", member: -1},                    // out of range
		{group: "A", member: 0},                     // held by a0
		{group: "A", member: 2, declared: 1},        // declared
		{group: "A", member: 2, declared: 1},        // declared twice: no change
		{add: r("A", 4, 2, "a2-late"), declared: 1}, // record for a declared slot: conflict
		{add: r("A", 4, 3, "a3"), declared: 1},
		{group: "A", member: 1, declared: 2, done: true, want: []string{"0:a0", "3:a3"}},
		{group: "A", member: 1, declared: 2}, // A emitted: not open
		{add: r("A", 4, 1, "a1"), declared: 2},
	}
	for i, s := range steps {
		var g []schemas.Rewarded
		var done bool
		if s.add != nil {
			g, done = a.Add(*s.add)
		} else {
			g, done = a.Absent(s.group, s.member)
		}
		if done != s.done || !slices.Equal(members(g), s.want) {
			t.Fatalf("step %d: got %v, %v; want %v, %v", i, members(g), done, s.want, s.done)
		}
		if d := a.Stats().Declared; d != s.declared {
			t.Fatalf("step %d: declared %d, want %d", i, d, s.declared)
		}
	}
	want := advantage.AssemblerStats{Added: 2, Conflicts: 1, Late: 1, Declared: 2}
	if got := a.Stats(); got != want {
		t.Fatalf("stats %+v, want %+v", got, want)
	}
	if a.Pending() != 0 || a.Buffered() != 0 {
		t.Fatalf("pending %d buffered %d after the group closed", a.Pending(), a.Buffered())
	}
}
