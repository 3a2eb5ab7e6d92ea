package dashboard

import (
	"slices"
	"testing"

	"github.com/trajflow/trajflow/schemas"
)

// traj is a trajectory of version v in domain d, started and finished at
// the given microseconds, with one turn per (generation µs, environment
// µs, decision).
func traj(id, d string, v, start, finish int64, turns ...any) *schemas.Trajectory {
	t := &schemas.Trajectory{RecordID: id, TaskID: "task-" + id, Domain: d, StartedAt: start, FinishedAt: finish}
	for i := 0; i+2 < len(turns); i += 3 {
		t.Turns = append(t.Turns, schemas.Turn{PolicyVersion: v, GenLatencyUS: turns[i].(int64),
			EnvLatencyUS: turns[i+1].(int64), Decision: turns[i+2].(string)})
	}
	return t
}

// TestLatency checks the latency section against values computed by hand.
func TestLatency(t *testing.T) {
	const ok, inv, den = schemas.DecisionOK, schemas.DecisionInvalid, schemas.DecisionDenied
	r := &Records{Trajs: map[string]*schemas.Trajectory{}}
	for _, tr := range []*schemas.Trajectory{
		traj("a", "kv", 0, 1e6, 2e6, int64(200e3), int64(100e3), ok),
		traj("b", "kv", 0, 1e6, 2e6, int64(300e3), int64(50e3), inv),
		traj("c", "kv", 0, 1e6, 4e6, int64(1000e3), int64(500e3), ok, int64(1000e3), int64(500e3), den),
		traj("d", "code", 1, 5e6, 7e6, int64(400e3), int64(800e3), ok),
		traj("e", "code", 1, 5e6, 0, int64(100e3), int64(-1), ok), // untimed; a negative latency is left out
	} {
		r.Trajs[tr.RecordID] = tr
		r.TrajOrder = append(r.TrajOrder, tr.RecordID)
	}
	l := latency(r, map[string]Fate{"c": {Outcome: schemas.CensusAdmitted}})
	// Generation per turn (ms): 100 200 300 400 1000 1000; environment:
	// 50 100 500 500 800; attempts (s): 1 1 2 3 (e untimed).
	want := struct{ gen, env, att Dist }{
		Dist{N: 6, Mean: 500, Min: 100, P10: 100, P50: 400, P90: 1000, P99: 1000, Max: 1000},
		Dist{N: 5, Mean: 390, Min: 50, P10: 50, P50: 500, P90: 800, P99: 800, Max: 800},
		Dist{N: 4, Mean: 1.75, Min: 1, P10: 1, P50: 2, P90: 3, P99: 3, Max: 3},
	}
	if l.GenerationMS != want.gen || l.EnvStepMS != want.env || l.AttemptS != want.att {
		t.Errorf("distributions:\n gen %+v\n env %+v\n att %+v\nwant %+v", l.GenerationMS, l.EnvStepMS, l.AttemptS, want)
	}
	// Timed attempts' wall time 7 s; their generation 0.2+0.3+2+0.4 = 2.9 s,
	// environment 0.1+0.05+1+0.8 = 1.95 s.
	if !near(l.GenerationShare, 2.9/7, 1e-12) || !near(l.EnvShare, 1.95/7, 1e-12) || l.Untimed != 1 {
		t.Errorf("shares %v %v, untimed %d; want %v %v, 1", l.GenerationShare, l.EnvShare, l.Untimed, 2.9/7, 1.95/7)
	}
	// Version 0's median is 1 s: c (3 s) is in the tail; version 1's is 2 s.
	if l.TailFactor != 2 || l.Tail != 1 || len(l.ByVersion) != 2 || l.ByVersion[0].Tail != 1 || l.ByVersion[1].Tail != 0 ||
		l.ByVersion[0].AttemptS.P50 != 1 || l.ByVersion[1].AttemptS.N != 1 || l.ByVersion[1].GenerationMS.N != 2 {
		t.Errorf("tail %d (factor %v), by version %+v", l.Tail, l.TailFactor, l.ByVersion)
	}
	var order []string
	for _, s := range l.Slowest {
		order = append(order, s.ID)
	}
	if len(order) != 4 || order[0] != "c" || order[1] != "d" || order[2] != "a" || order[3] != "b" {
		t.Fatalf("slowest %v, want c d a b", order)
	}
	c := l.Slowest[0]
	if !c.InTail || c.Seconds != 3 || c.Turns != 2 || !near(c.GenerationS, 2, 1e-12) || !near(c.EnvS, 1, 1e-12) ||
		c.Outcome != schemas.CensusAdmitted || c.Task != "task-c" || c.Version != 0 || l.Slowest[1].InTail || l.Slowest[1].Outcome != "" {
		t.Errorf("slowest %+v", l.Slowest)
	}
	if len(l.ByDomain) != 2 {
		t.Fatalf("by domain %+v", l.ByDomain)
	}
	code, kv := l.ByDomain[0], l.ByDomain[1]
	if code.Domain != "code" || code.Attempts != 2 || code.Turns != 2 || code.EnvStepMS.N != 1 || code.Invalid+code.Denied != 0 ||
		kv.Domain != "kv" || kv.Attempts != 3 || kv.Turns != 4 || kv.EnvStepMS.N != 4 || kv.EnvStepMS.Mean != 287.5 ||
		kv.Invalid != 1 || kv.Denied != 1 {
		t.Errorf("by domain %+v", l.ByDomain)
	}
	if (latency(&Records{}, nil).AttemptS != Dist{}) {
		t.Error("a run without trajectories has attempt times")
	}
}

// TestFailures counts failed and retried census events by kind, stage,
// reason and infra, events and distinct attempts, and nothing else.
func TestFailures(t *testing.T) {
	ev := func(kind, attempt, reason string, infra bool) schemas.CensusEvent {
		return schemas.CensusEvent{Kind: kind, AttemptID: attempt, Stage: "rollout", Reason: reason, Infra: infra}
	}
	const f, r = schemas.CensusFailed, schemas.CensusRetried
	got := failures([]schemas.CensusEvent{
		ev(r, "a", "timeout", true), ev(r, "a", "timeout", true), ev(r, "b", "timeout", true),
		ev(r, "b", "capacity", true),
		ev(f, "c", "env_unavailable", true), ev(f, "d", "env_unavailable", true),
		ev(f, "e", "parse", false),
		ev(schemas.CensusQuarantined, "f", "nan_logprob", false), ev(schemas.CensusAdmitted, "g", "", false),
	})
	want := []FailureRow{
		{Kind: f, Stage: "rollout", Reason: "env_unavailable", Infra: true, Events: 2, Attempts: 2},
		{Kind: f, Stage: "rollout", Reason: "parse", Events: 1, Attempts: 1},
		{Kind: r, Stage: "rollout", Reason: "timeout", Infra: true, Events: 3, Attempts: 2},
		{Kind: r, Stage: "rollout", Reason: "capacity", Infra: true, Events: 1, Attempts: 1},
	}
	if !slices.Equal(got, want) {
		t.Errorf("failures\n got %+v\nwant %+v", got, want)
	}
	if got := failures(nil); got == nil || len(got) != 0 {
		t.Errorf("no events: %#v, want an empty list", got)
	}
}
