package dispatch

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

func tasks(domains ...string) []Task {
	var out []Task
	for d, dom := range domains {
		for i := 0; i < 8; i++ {
			out = append(out, Task{ID: fmt.Sprintf("%s-%02d", dom, i), Version: "1", Domain: dom, Split: schemas.SplitTrain, EnvVersion: "e", Weight: float64(1 + d)})
		}
	}
	return out
}

func planner(t *testing.T, cfg PlannerConfig) *Planner {
	t.Helper()
	if cfg.RunID == "" {
		cfg.RunID = "run"
	}
	if cfg.Tasks == nil {
		cfg.Tasks = tasks("a", "b")
	}
	if cfg.TasksPerRound == 0 {
		cfg.TasksPerRound, cfg.GroupsPerRound, cfg.GroupSize = 4, 8, 3
	}
	p, err := NewPlanner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestPlan: a round's plan is a pure function of the seed and the round:
// distinct tasks, groups per task, unique group ids, and quotas hold.
func TestPlan(t *testing.T) {
	for _, tc := range []struct {
		name   string
		quotas map[string]float64
		maxA   int // most groups of domain a per round
	}{
		{"no quota", nil, 8},
		{"quota a 50%", map[string]float64{"a": 0.5}, 4},
		{"quota a 25%", map[string]float64{"a": 0.25}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := planner(t, PlannerConfig{Seed: 7, DomainQuotas: tc.quotas})
			q := planner(t, PlannerConfig{Seed: 7, DomainQuotas: tc.quotas, Tasks: reversed(tasks("a", "b"))})
			ids := map[string]bool{}
			for r := int64(0); r < 20; r++ {
				g := p.Plan(r)
				if !reflect.DeepEqual(g, q.Plan(r)) {
					t.Fatalf("round %d: plan depends on task order", r)
				}
				if len(g) != 8 {
					t.Fatalf("round %d: %d groups", r, len(g))
				}
				per := map[string]int{}
				a := 0
				for i, x := range g {
					if ids[x.GroupID] || x.Index != r*8+int64(i) {
						t.Fatalf("round %d: group %d id %s index %d", r, i, x.GroupID, x.Index)
					}
					ids[x.GroupID] = true
					per[x.Task.ID]++
					if x.Task.Domain == "a" {
						a++
					}
				}
				if len(per) != 4 || a > tc.maxA {
					t.Fatalf("round %d: tasks %v, %d groups of domain a", r, per, a)
				}
			}
			if reflect.DeepEqual(p.Plan(0), planner(t, PlannerConfig{Seed: 8, DomainQuotas: tc.quotas}).Plan(0)) {
				t.Fatal("the seed does not change the plan")
			}
		})
	}
}

func reversed(ts []Task) []Task {
	for i, j := 0, len(ts)-1; i < j; i, j = i+1, j-1 {
		ts[i], ts[j] = ts[j], ts[i]
	}
	return ts
}

// TestPlannerRefuses: hidden-eval tasks are refused by the denylist (or
// their split) before anything is dispatched; impossible quotas fail.
func TestPlannerRefuses(t *testing.T) {
	eval := append(tasks("a"), Task{ID: "kv-eval-00001", Split: schemas.SplitTrain, Domain: "a"})
	evalSplit := append(tasks("a"), Task{ID: "x", Split: schemas.SplitEval, Domain: "a"})
	deny := func(id string) bool { return id == "kv-eval-00001" }
	for _, tc := range []struct {
		name string
		cfg  PlannerConfig
		want error
	}{
		{"denylisted id", PlannerConfig{RunID: "r", Tasks: eval, Denylist: deny, TasksPerRound: 1, GroupsPerRound: 1, GroupSize: 1}, ErrDenied},
		{"eval split", PlannerConfig{RunID: "r", Tasks: evalSplit, TasksPerRound: 1, GroupsPerRound: 1, GroupSize: 1}, ErrDenied},
		{"quota too tight", PlannerConfig{RunID: "r", Tasks: tasks("a"), TasksPerRound: 4, GroupsPerRound: 4, GroupSize: 1, DomainQuotas: map[string]float64{"a": 0.5}}, ErrConfig},
		{"groups not a multiple", PlannerConfig{RunID: "r", Tasks: tasks("a"), TasksPerRound: 3, GroupsPerRound: 4, GroupSize: 1}, ErrConfig},
		{"too few tasks", PlannerConfig{RunID: "r", Tasks: tasks("a"), TasksPerRound: 9, GroupsPerRound: 9, GroupSize: 1}, ErrConfig},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewPlanner(tc.cfg); !errors.Is(err, tc.want) {
				t.Fatalf("err %v, want %v", err, tc.want)
			}
		})
	}
}

// TestAttemptsDeterministic: ids and seeds depend only on the plan, not on
// the policy version or the time.
func TestAttemptsDeterministic(t *testing.T) {
	p := planner(t, PlannerConfig{Seed: 3})
	g := p.Plan(5)[2]
	a, b := p.Attempts(g, 0, 1), p.Attempts(g, 4, 2)
	for i := range a {
		if a[i].AttemptID != b[i].AttemptID || a[i].Seed != b[i].Seed || a[i].Member != int32(i) || a[i].GroupID != g.GroupID {
			t.Fatalf("member %d: %+v vs %+v", i, a[i], b[i])
		}
	}
	if b[0].PolicyVersion != 4 || a[0].GroupSize != 3 {
		t.Fatalf("attempt %+v", b[0])
	}
}

type harness struct {
	t      *testing.T
	s      *Stage
	topics pipeline.Topics
	off    int64
}

func newHarness(t *testing.T, mode string, maxLag, rounds int64) *harness {
	topics, _ := pipeline.TopicsFor("run")
	s, err := NewStage(StageConfig{Planner: planner(t, PlannerConfig{Seed: 1}), Topics: topics, RunID: "run", Mode: mode, MaxLag: maxLag, Rounds: rounds})
	if err != nil {
		t.Fatal(err)
	}
	return &harness{t: t, s: s, topics: topics}
}

// feed processes one record and returns the rounds of the tasks emitted.
func (h *harness) feed(topic string, v []byte) []int64 {
	h.t.Helper()
	h.off++
	res, err := h.s.Process(context.Background(), pipeline.Message{Ref: pipeline.Ref{Topic: topic, Offset: h.off}, Value: v, Time: time.Unix(h.off, 0)})
	if err != nil {
		h.t.Fatal(err)
	}
	var rounds []int64
	seen := map[int64]bool{}
	for _, o := range res.Outputs {
		if o.Topic != h.topics.Tasks {
			continue
		}
		atts, err := schemas.TaskAttempts.Decode(nil, o.Value)
		if err != nil || len(atts) != 3 || string(o.Key) != atts[0].GroupID {
			h.t.Fatalf("tasks message: %v %d", err, len(atts))
		}
		var r int64
		fmt.Sscan(string((&pipeline.Message{Headers: o.Headers}).Header(HeaderRound)), &r)
		if !seen[r] {
			rounds = append(rounds, r)
			seen[r] = true
		}
	}
	return rounds
}

func (h *harness) release(v int64) []int64 {
	b, _ := schemas.EncodeRelease(schemas.PolicyRelease{PolicyVersion: v, Ready: true})
	return h.feed(h.topics.Policy, b)
}

// window reports groups of round r decided; batch says whether they made
// a batch at trainer version v.
func (h *harness) window(r int64, from, to int, batch bool, v int64) []int64 {
	var groups []string
	for _, g := range h.s.cfg.Planner.Plan(r)[from:to] {
		groups = append(groups, g.GroupID)
	}
	rec := schemas.WindowRecord{Groups: groups, TrainerVersion: v}
	if batch {
		rec.BatchID = "b"
	}
	b, _ := schemas.EncodeWindow(rec)
	return h.feed(h.topics.Windows, b)
}

// TestStageSync: round r+1 waits for every group of round r to be decided
// and, when they made a batch, for the next release; a round without a
// batch does not wait for a release (no deadlock).
func TestStageSync(t *testing.T) {
	h := newHarness(t, ModeSync, 0, 4)
	steps := []struct {
		name string
		do   func() []int64
		want []int64
	}{
		{"initial policy", func() []int64 { return h.release(0) }, []int64{0}},
		{"half of round 0 decided", func() []int64 { return h.window(0, 0, 4, true, 0) }, nil},
		{"rest of round 0 decided", func() []int64 { return h.window(0, 4, 8, true, 0) }, nil},
		{"stale release", func() []int64 { return h.release(0) }, nil},
		{"round 0 trained", func() []int64 { return h.release(1) }, []int64{1}},
		{"round 1 all filtered", func() []int64 { return h.window(1, 0, 8, false, 1) }, []int64{2}},
		{"window replayed", func() []int64 { return h.window(1, 0, 8, false, 1) }, nil},
		{"round 2 decided", func() []int64 { return h.window(2, 0, 8, true, 1) }, nil},
		{"round 2 trained", func() []int64 { return h.release(2) }, []int64{3}},
		{"round 3 done, no round 4", func() []int64 { h.window(3, 0, 8, true, 2); return h.release(3) }, nil},
	}
	for _, st := range steps {
		if got := st.do(); !reflect.DeepEqual(got, st.want) {
			t.Fatalf("%s: dispatched rounds %v, want %v", st.name, got, st.want)
		}
	}
	if !h.s.Done() {
		t.Fatal("not done after the last round")
	}
}

// batchWindow reports groups [from, to) of round r decided into batch
// index k (k < 0: a window without a batch), closed at the latest release
// dispatch knows (as pack's would be).
func (h *harness) batchWindow(r int64, from, to int, k int64) []int64 {
	return h.batchWindowAt(r, from, to, k, max(h.s.policy, 0))
}

// batchWindowAt is batchWindow closed at trainer version v.
func (h *harness) batchWindowAt(r int64, from, to int, k, v int64) []int64 {
	var groups []string
	for _, g := range h.s.cfg.Planner.Plan(r)[from:to] {
		groups = append(groups, g.GroupID)
	}
	rec := schemas.WindowRecord{Groups: groups, BatchIndex: k, TrainerVersion: v}
	if k >= 0 {
		rec.BatchID = fmt.Sprintf("b%d", k)
	}
	b, _ := schemas.EncodeWindow(rec)
	return h.feed(h.topics.Windows, b)
}

// trained releases version v after the trainer consumed every batch below
// next.
func (h *harness) trained(v, next int64) []int64 {
	b, _ := schemas.EncodeRelease(schemas.PolicyRelease{PolicyVersion: v, Ready: true, NextBatch: next})
	return h.feed(h.topics.Policy, b)
}

// TestStageAsync: with max_lag 1, two rounds are in flight, and a round
// stays in flight until the trainer consumed its batches (the releases'
// next_batch), not merely until pack decided it: pack running ahead of a
// slow trainer does not let dispatch run ahead. A window without a batch
// settles its groups at once.
func TestStageAsync(t *testing.T) {
	h := newHarness(t, ModeAsync, 1, 0)
	steps := []struct {
		name string
		do   func() []int64
		want []int64
	}{
		{"initial policy: two rounds", func() []int64 { return h.trained(0, 0) }, []int64{0, 1}},
		{"round 0 decided into batch 0, not trained", func() []int64 { return h.batchWindow(0, 0, 8, 0) }, nil},
		{"round 1 decided into batch 1", func() []int64 { return h.batchWindow(1, 0, 8, 1) }, nil},
		{"batch 0 trained", func() []int64 { return h.trained(1, 1) }, []int64{2}},
		{"round 2 half in batch 2, half filtered", func() []int64 {
			h.batchWindow(2, 0, 4, 2)
			return h.batchWindow(2, 4, 8, -1)
		}, nil},
		{"batch 1 trained", func() []int64 { return h.trained(2, 2) }, []int64{3}},
		{"round 3 decided, batch 2 trained", func() []int64 { h.batchWindow(3, 0, 8, 3); return h.trained(3, 3) }, []int64{4}},
	}
	for _, st := range steps {
		if got := st.do(); !reflect.DeepEqual(got, st.want) {
			t.Fatalf("%s: dispatched rounds %v, want %v (in flight %d)", st.name, got, st.want, h.s.InFlight())
		}
	}
	if n := h.s.InFlight(); n != 16 {
		t.Fatalf("%d groups in flight, want 16 (round 3 in batch 3, round 4 undecided)", n)
	}
}

// TestStageAsyncContinue: without continuation a straggler group of round
// 0 holds round 2 back (max_lag 1: at most two rounds in flight); with
// partial-rollout continuation it does not — only the groups in flight
// are bounded, (1+1)·8 = 16: round 2 goes out beside the straggler, round
// 3 waits.
func TestStageAsyncContinue(t *testing.T) {
	for _, cont := range []bool{false, true} {
		topics, _ := pipeline.TopicsFor("run")
		s, err := NewStage(StageConfig{Planner: planner(t, PlannerConfig{Seed: 1}), Topics: topics, RunID: "run",
			Mode: ModeAsync, MaxLag: 1, Continue: cont})
		if err != nil {
			t.Fatal(err)
		}
		h := &harness{t: t, s: s, topics: topics}
		h.trained(0, 0)
		h.batchWindow(0, 0, 7, 0) // one group of round 0 still running
		h.batchWindow(1, 0, 8, 1)
		got := h.trained(2, 2)
		want := []int64(nil)
		if cont {
			want = []int64{2}
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("continue %v: dispatched %v beside a straggler, want %v", cont, got, want)
		}
	}
}

// TestStageAsyncStaleBatch: a straggler of round 0 lands alone in the
// last batch, closed at version 0, while round 1 trained up to version 2
// (max_lag 1). The trainer can only refuse that batch (every token is two
// versions old at its update), so no release will say it consumed it:
// dispatch stops counting it in flight once a release makes it stale,
// and rounds 2 and 3 go out (two rounds in flight) instead of the loop
// stalling.
func TestStageAsyncStaleBatch(t *testing.T) {
	h := newHarness(t, ModeAsync, 1, 0)
	h.trained(0, 0)
	h.batchWindowAt(0, 0, 7, 0, 0)
	h.batchWindowAt(1, 0, 8, 1, 0)
	h.batchWindowAt(0, 7, 8, 2, 0) // the straggler, in the last batch
	if got := h.trained(1, 1); got != nil {
		t.Fatalf("batch 0 trained: dispatched %v; round 0's straggler batch can still train", got)
	}
	if got := h.trained(2, 2); !reflect.DeepEqual(got, []int64{2, 3}) {
		t.Fatalf("batch 1 trained at version 2: dispatched %v, want rounds 2 and 3 (batch 2 is stale: in flight %d)", got, h.s.InFlight())
	}
	if n := h.s.InFlight(); n != 16 {
		t.Fatalf("%d groups in flight, want rounds 2 and 3's 16", n)
	}
}

// TestStageAsyncStaleBatchOlderTokens: the straggler's batch closed at
// trainer version 1, but every token it can train was sampled by version
// 0 (min_lag 1): at the release of version 2 the trainer refuses it whole,
// two versions beyond its tokens, although the window's own version is
// only one behind. Dispatch must judge by the tokens, or it waits for a
// consumption no release will report and the loop stops.
func TestStageAsyncStaleBatchOlderTokens(t *testing.T) {
	for _, minLag := range []int64{0, 1} {
		h := newHarness(t, ModeAsync, 1, 0)
		h.trained(0, 0)
		h.batchWindowAt(0, 0, 7, 0, 0)
		h.batchWindowAt(1, 0, 8, 1, 1)
		var groups []string
		for _, g := range h.s.cfg.Planner.Plan(0)[7:8] {
			groups = append(groups, g.GroupID)
		}
		b, _ := schemas.EncodeWindow(schemas.WindowRecord{Groups: groups, BatchIndex: 2, BatchID: "b2", TrainerVersion: 1, MinLag: minLag})
		h.feed(h.topics.Windows, b)
		h.trained(1, 1)
		got := h.trained(2, 2)
		want := []int64(nil) // the batch can still train at version 2
		if minLag == 1 {
			want = []int64{2, 3}
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("min_lag %d: dispatched %v at version 2, want %v (in flight %d)", minLag, got, want, h.s.InFlight())
		}
	}
}

// TestStageAsyncGroupBudget: with windows of 4 groups (half a round) and
// max_lag 1, at most (1+1)·4 = 8 groups are in flight: one round at a
// time, the next dispatched when the trainer has consumed both batches of
// the previous one — or, with a trainer that does not record next_batch,
// one batch per version.
func TestStageAsyncGroupBudget(t *testing.T) {
	topics, _ := pipeline.TopicsFor("run")
	s, err := NewStage(StageConfig{Planner: planner(t, PlannerConfig{Seed: 1}), Topics: topics, RunID: "run",
		Mode: ModeAsync, MaxLag: 1, BatchGroups: 4})
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, s: s, topics: topics}
	if got := h.trained(0, 0); !reflect.DeepEqual(got, []int64{0}) {
		t.Fatalf("initial: %v, want round 0 only", got)
	}
	h.batchWindow(0, 0, 4, 0)
	h.batchWindow(0, 4, 8, 1)
	if got := h.trained(1, 1); got != nil {
		t.Fatalf("half of round 0 trained: %v", got)
	}
	if got := h.release(2); !reflect.DeepEqual(got, []int64{1}) {
		t.Fatalf("version 2 without next_batch: %v, want round 1", got)
	}
}

// FuzzProcess: any bytes on the policy or windows topic give a refusal or
// nothing, never a panic.
func FuzzProcess(f *testing.F) {
	f.Add([]byte(`{"groups":["x"],"batch_id":"b","trainer_version":3}`), false)
	b, _ := schemas.EncodeRelease(schemas.PolicyRelease{PolicyVersion: 2, Ready: true})
	f.Add(b, true)
	f.Fuzz(func(t *testing.T, v []byte, policy bool) {
		h := newHarness(&testing.T{}, ModeSync, 0, 2)
		topic := h.topics.Windows
		if policy {
			topic = h.topics.Policy
		}
		_, _ = h.s.Process(context.Background(), pipeline.Message{Ref: pipeline.Ref{Topic: topic}, Value: v})
	})
}

// decide feeds a gate decision on release v and returns the rounds
// emitted and dispatch's halted record, if one came out.
func (h *harness) decide(v int64, action string) ([]int64, *schemas.GateDecision) {
	h.t.Helper()
	b, _ := schemas.EncodeGateDecision(schemas.GateDecision{RunID: "run", PolicyVersion: v, Action: action, StopRule: "safety_violation"})
	h.off++
	m := pipeline.Message{Ref: pipeline.Ref{Topic: h.topics.Decisions, Offset: h.off}, Value: b, Time: time.Unix(h.off, 0),
		Headers: stagekit.Headers(schemas.KindGateDecision, "d")}
	res, err := h.s.Process(context.Background(), m)
	if err != nil {
		h.t.Fatal(err)
	}
	var rounds []int64
	var halted *schemas.GateDecision
	for _, o := range res.Outputs {
		switch o.Topic {
		case h.topics.Tasks:
			var r int64
			fmt.Sscan(string((&pipeline.Message{Headers: o.Headers}).Header(HeaderRound)), &r)
			if len(rounds) == 0 || rounds[len(rounds)-1] != r {
				rounds = append(rounds, r)
			}
		case h.topics.Decisions:
			d, err := schemas.DecodeGateDecision(o.Value)
			if err != nil {
				h.t.Fatal(err)
			}
			halted = &d
		}
	}
	return rounds, halted
}

// TestStageGated: with a gate, a round is launched at a release only once
// the gate ruled on it; a stop halts dispatch (no round after it) and
// dispatch acknowledges it once, with the rounds it launched.
func TestStageGated(t *testing.T) {
	h := newHarness(t, ModeSync, 0, 10)
	h.s.cfg.Gated = true
	if got := h.release(0); got != nil {
		t.Fatalf("round launched before the gate ruled on release 0: %v", got)
	}
	if got, _ := h.decide(0, schemas.GateContinue); !reflect.DeepEqual(got, []int64{0}) {
		t.Fatalf("after the ruling on release 0: %v", got)
	}
	h.window(0, 0, 8, true, 0)
	if got := h.release(1); got != nil {
		t.Fatalf("round 1 launched before the ruling on release 1: %v", got)
	}
	if got, _ := h.decide(1, schemas.GatePromote); !reflect.DeepEqual(got, []int64{1}) {
		t.Fatalf("after the ruling on release 1: %v", got)
	}
	h.window(1, 0, 8, true, 1)
	h.release(2)
	if got, _ := h.decide(2, schemas.GateRollback); got != nil {
		t.Fatalf("round launched at the rolled-back release 2: %v", got)
	}
	if got := h.release(3); got != nil {
		t.Fatalf("round launched at release 3 before its ruling: %v", got)
	}
	if got, _ := h.decide(3, schemas.GateContinue); !reflect.DeepEqual(got, []int64{2}) {
		t.Fatalf("after the restored release 3: %v", got)
	}
	h.window(2, 0, 8, true, 3)
	h.release(4)
	got, halted := h.decide(4, schemas.GateStop)
	if got != nil || halted == nil || halted.Action != schemas.GateHalted || halted.RoundsDispatched != 3 || halted.StopRule != "safety_violation" {
		t.Fatalf("stop at release 2: rounds %v, halted %+v", got, halted)
	}
	if !h.s.Done() || h.s.Halted() == nil {
		t.Fatal("not done after the stop")
	}
	if got, again := h.decide(5, schemas.GateContinue); got != nil || again != nil {
		t.Fatalf("after the stop: rounds %v, halted again %+v", got, again)
	}
}

// TestStageDealsGroupsOutInTurn: every tasks message is pinned to the
// partition of its group's index (taken modulo the topic's partitions by
// the runtime), so consecutive groups — across rounds — go to consecutive
// partitions, whatever their keys hash to, and the same group always goes
// to the same one.
func TestStageDealsGroupsOutInTurn(t *testing.T) {
	h := newHarness(t, ModeAsync, 1, 3)
	var got []int
	collect := func(res pipeline.Result) {
		for _, o := range res.Outputs {
			if o.Topic != h.topics.Tasks {
				continue
			}
			if !o.Pinned {
				t.Fatalf("tasks message of %s not pinned", o.Key)
			}
			got = append(got, o.Partition)
		}
	}
	b, _ := schemas.EncodeRelease(schemas.PolicyRelease{PolicyVersion: 0, Ready: true})
	res, err := h.s.Process(context.Background(), pipeline.Message{Ref: pipeline.Ref{Topic: h.topics.Policy}, Value: b, Time: time.Unix(1, 0)})
	if err != nil {
		t.Fatal(err)
	}
	collect(res)
	g := h.s.cfg.Planner.GroupsPerRound()
	if len(got) != 2*g {
		t.Fatalf("%d groups dispatched, want two rounds of %d", len(got), g)
	}
	for i, p := range got {
		if p != i {
			t.Fatalf("group %d of the run pinned to %d, want %d (dealt in turn)", i, p, i)
		}
	}
	for r := int64(0); r < 2; r++ {
		for i, grp := range h.s.cfg.Planner.Plan(r) {
			if grp.Index != r*int64(g)+int64(i) {
				t.Fatalf("round %d group %d: index %d", r, i, grp.Index)
			}
		}
	}
}
