package envsvc

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// The tests of this file hold the service to what docs/ENV_PROTOCOL.md
// promises a client written from the document alone.

// without is the JSON of req (a request, or its JSON as a string) without
// its field name, or with it set to the JSON value to when to is not
// empty.
func without(t *testing.T, req any, name, to string) string {
	t.Helper()
	b, _ := json.Marshal(req)
	if s, ok := req.(string); ok {
		b = []byte(s)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	delete(m, name)
	if to != "" {
		m[name] = json.RawMessage(to)
	}
	b, _ = json.Marshal(m)
	return string(b)
}

// TestMissingRequiredFields: a request without one of its required fields
// (or with it null) is answered 400 bad_request naming the field, before
// any token is looked at; a step's or status query's answer still carries
// the episode's next sequence number. A seq of 0 is present, not missing:
// a step of it is a gap, a status query of it was not received.
func TestMissingRequiredFields(t *testing.T) {
	regs := registries(t)
	svc := startService(t, Config{Registries: regs, DefaultLease: time.Hour})
	r := newRaw(t, svc.url, time.Minute, nil)
	task, att := ledgerTask(t, regs, 3)
	id := r.allocate(att, "k", 0).EpisodeID
	call := []int32{rollout.TokCall, rollout.TokKey0 + task.Key, rollout.TokEnd}
	if got := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, call...)); got.Outcome != Executed {
		t.Fatal(got)
	}
	path := func(p string) string { return strings.Replace(p, "{id}", id, 1) }
	step2 := r.stepReq(id, 2, "s2", 1, call...)
	step0 := r.stepReq(id, 0, "s0", 1, call...)
	renew := RenewRequest{Protocol: 1, Token: r.iss.Issue(id, 0, RenewAction)}
	term := TerminateRequest{Protocol: 1, Reason: "answer", Token: r.iss.Issue(id, 0, TerminateAction)}
	for _, tc := range []struct {
		name, path, body string
		code             int
		reason, detail   string
	}{
		{"renew without token", path(PathRenew), without(t, renew, "token", ""), http.StatusBadRequest, ReasonBadRequest, "missing token"},
		{"renew with token null", path(PathRenew), without(t, renew, "token", "null"), http.StatusBadRequest, ReasonBadRequest, "missing token"},
		{"terminate without token", path(PathTerminate), without(t, term, "token", ""), http.StatusBadRequest, ReasonBadRequest, "missing token"},
		{"step without seq", path(PathStep), without(t, step2, "seq", ""), http.StatusBadRequest, ReasonBadRequest, "missing seq"},
		{"step with seq null", path(PathStep), without(t, step2, "seq", "null"), http.StatusBadRequest, ReasonBadRequest, "missing seq"},
		{"status without seq", path(PathStatus), without(t, step2, "seq", ""), http.StatusBadRequest, ReasonBadRequest, "missing seq"},
		{"step without token", path(PathStep), without(t, step2, "token", ""), http.StatusBadRequest, ReasonBadRequest, "missing token"},
		{"step without seq and key", path(PathStep), without(t, without(t, step2, "seq", ""), "idempotency_key", `""`), http.StatusBadRequest,
			ReasonBadRequest, "missing idempotency_key, seq"},
		{"step without turn", path(PathStep), without(t, step2, "turn", ""), http.StatusBadRequest, ReasonBadRequest, "missing turn"},
		{"step of seq 0", path(PathStep), without(t, step0, "", ""), http.StatusOK, ReasonSeqGap, ""},
		{"status of seq 0", path(PathStatus), without(t, step0, "", ""), http.StatusOK, ReasonNotReceived, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got StepResponse // renew and terminate answers decode into it too
			code := r.postRaw(tc.path, tc.body, &got)
			if code != tc.code || got.Reason != tc.reason || (tc.detail != "" && got.Detail != tc.detail) {
				t.Fatalf("%d %+v, want %d %s %q", code, got, tc.code, tc.reason, tc.detail)
			}
			if tc.path != path(PathRenew) && tc.path != path(PathTerminate) && got.NextSeq != 2 {
				t.Fatalf("next_seq %d, want 2: %+v", got.NextSeq, got)
			}
		})
	}
	// Nothing was renewed or ended: the episode goes on.
	if got := r.send(PathStep, id, step2); got.Outcome != Executed || got.NextSeq != 3 {
		t.Fatalf("step 2 after the bad requests: %+v", got)
	}
}

// inProcess runs actions on an in-process episode of a and returns their
// transitions and the artifacts of its Close: what the service's episode
// must report after executing the same actions.
func inProcess(t *testing.T, reg *rollout.Registry, a schemas.TaskAttempt, acts ...rollout.EnvAction) ([]rollout.Transition, string) {
	t.Helper()
	ctx := context.Background()
	ep, _, err := reg.Reset(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	var trs []rollout.Transition
	for i, act := range acts {
		tr, err := ep.Step(ctx, int32(i), act)
		if err != nil {
			t.Fatal(err)
		}
		trs = append(trs, tr)
	}
	fin, err := ep.Close(ctx, rollout.ReasonAborted)
	if err != nil {
		t.Fatal(err)
	}
	return trs, fin.Artifacts
}

// TestObservationOverCapRunsNothing: an observation over the service's
// cap is refused (observation_size): the action did not run, so the
// episode's end — steps, final transition, artifacts — is that of the
// actions before it, and a status query of it does not find it executed.
func TestObservationOverCapRunsNothing(t *testing.T) {
	regs := registries(t)
	reg := family(regs, rollout.FamilyText)
	svc := startService(t, Config{Registries: regs, MaxObservationBytes: 40})
	r := newRaw(t, svc.url, time.Minute, nil)
	att := attempts(reg.Train()[:1], 1, 0)[0]
	id := r.allocate(att, "k", 0).EpisodeID
	calc := rollout.EnvAction{Text: "<tool>calc: 1+1</tool>"}
	memo := rollout.EnvAction{Text: "<tool>lookup: memo</tool>"} // its observation is over 40 bytes
	first := r.send(PathStep, id, r.stepReqOf(id, 1, "s1", 0, calc))
	if first.Outcome != Executed {
		t.Fatal(first)
	}
	got := r.send(PathStep, id, r.stepReqOf(id, 2, "s2", 1, memo))
	if got.Outcome != Refused || got.Reason != ReasonObservation || got.NextSeq != 2 {
		t.Fatalf("over-size observation: %+v", got)
	}
	if st := r.send(PathStatus, id, r.stepReqOf(id, 2, "s2", 1, memo)); st.Outcome == Executed {
		t.Fatalf("status of the refused action: %+v", st)
	}
	trs, art := inProcess(t, reg, att, calc)
	end := r.terminate(id, rollout.ReasonAnswer)
	if end.Status != StatusInfra || end.EndReason != ReasonObservation || end.Steps != 1 || end.Final == nil ||
		!reflect.DeepEqual(*end.Final, trs[0]) || end.Artifacts != art {
		t.Fatalf("end %+v\nwant steps 1, final %+v, artifacts %s", end, trs[0], art)
	}
}

// TestRefusalsCarryNextSeq: a refusal of a step carries the episode's
// real next sequence number, also when the step itself ends the episode.
func TestRefusalsCarryNextSeq(t *testing.T) {
	regs := registries(t)
	for _, tc := range []struct {
		name   string
		family string
		cfg    func(clk *clock) Config
		before func(clk *clock) // before the refused step
		act    rollout.EnvAction
		reason string
	}{
		{
			name: "observation_size", family: rollout.FamilyText,
			cfg:    func(*clock) Config { return Config{MaxObservationBytes: 40} },
			before: func(*clock) {},
			act:    rollout.EnvAction{Text: "<tool>lookup: memo</tool>"}, reason: ReasonObservation,
		},
		{
			name: "lease_expired noticed by the step", family: rollout.FamilyText,
			cfg:    func(clk *clock) Config { return Config{Now: clk.now, ReapInterval: time.Hour} },
			before: func(clk *clock) { clk.add(time.Hour) },
			act:    rollout.EnvAction{Text: "<tool>calc: 2+2</tool>"}, reason: ReasonLeaseExpired,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := &clock{t: time.Now()}
			cfg := tc.cfg(clk)
			cfg.Registries = regs
			svc := startService(t, cfg)
			r := newRaw(t, svc.url, time.Minute, clk.now)
			id := r.allocate(attempts(family(regs, tc.family).Train()[:1], 1, 0)[0], "k", 60000).EpisodeID
			if got := r.send(PathStep, id, r.stepReqOf(id, 1, "s1", 0, rollout.EnvAction{Text: "<tool>calc: 1+1</tool>"})); got.Outcome != Executed {
				t.Fatal(got)
			}
			tc.before(clk)
			got := r.send(PathStep, id, r.stepReqOf(id, 2, "s2", 1, tc.act))
			if got.Outcome != Refused || got.Reason != tc.reason || got.NextSeq != 2 {
				t.Fatalf("%+v, want %s with next_seq 2", got, tc.reason)
			}
		})
	}
}

// TestEndedAtRestartKeepsItsHistory: an episode that a restart ends
// instead of resuming (its family no longer served or changed, its world
// state unreadable, no free slot) still answers for the actions it
// executed: a status query gets the stored transition, a later step is
// refused with the real next sequence number, and terminate reports its
// steps, final transition and artifacts (none when its state cannot be
// read).
func TestEndedAtRestartKeepsItsHistory(t *testing.T) {
	regs := registries(t)
	changed := slices.Clone(regs)
	for i, g := range changed {
		if g.Family() == rollout.FamilyLedger {
			cfg := g.Config()
			cfg.Seed = 99
			var err error
			if changed[i], err = rollout.NewRegistry(cfg); err != nil {
				t.Fatal(err)
			}
		}
	}
	notLedger := slices.DeleteFunc(slices.Clone(regs), func(g *rollout.Registry) bool { return g.Family() == rollout.FamilyLedger })
	for _, tc := range []struct {
		name      string
		restart   Config
		damage    func(t *testing.T, srv *Server, id string) // the store, before the restart
		reason    string
		ended     int // how many of the two episodes end
		artifacts bool
	}{
		{name: "family no longer served", restart: Config{Registries: notLedger}, reason: endSnapshotChanged, ended: 2, artifacts: true},
		{name: "family changed", restart: Config{Registries: changed}, reason: endSnapshotChanged, ended: 2, artifacts: true},
		{name: "no free slot", restart: Config{Registries: regs, MaxEpisodes: 1}, reason: ReasonCapacity, ended: 1, artifacts: true},
		{name: "world state unreadable", restart: Config{Registries: regs}, reason: endCorruptState, ended: 1,
			damage: func(t *testing.T, srv *Server, id string) {
				var rec stepRec
				if ok, err := srv.load(stepKey(id, 1), &rec); !ok || err != nil {
					t.Fatal(ok, err)
				}
				rec.State = []byte("not a world")
				if err := srv.put(stepKey(id, 1), rec); err != nil {
					t.Fatal(err)
				}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := openStore(t, t.TempDir(), false)
			defer st.Close()
			srv, err := NewServer(Config{Registries: regs, Key: testKey, Store: st})
			if err != nil {
				t.Fatal(err)
			}
			hs := httptest.NewServer(srv.Handler())
			r := newRaw(t, hs.URL, time.Minute, nil)
			type episode struct {
				att  schemas.TaskAttempt
				act  rollout.EnvAction
				step StepResponse
			}
			eps := map[string]*episode{}
			var ids []string
			for i := range 2 {
				task, att := ledgerTask(t, regs, 20+i)
				e := &episode{att: att, act: rollout.EnvAction{IDs: []int32{rollout.TokXfer, rollout.TokKey0 + task.Key, rollout.TokEnd}}}
				id := r.allocate(att, "k", 60000).EpisodeID
				if e.step = r.send(PathStep, id, r.stepReqOf(id, 1, "s1", 0, e.act)); e.step.Outcome != Executed {
					t.Fatal(e.step)
				}
				eps[id] = e
				ids = append(ids, id)
			}
			if tc.damage != nil {
				tc.damage(t, srv, ids[0])
			}
			hs.Close()
			srv.Close()

			cfg := tc.restart
			cfg.Key, cfg.Store = testKey, st
			if srv, err = NewServer(cfg); err != nil {
				t.Fatal(err)
			}
			defer srv.Close()
			hs = httptest.NewServer(srv.Handler())
			defer hs.Close()
			r.url = hs.URL
			ended := 0
			for _, id := range ids {
				srv.mu.Lock()
				live := srv.live[id] != nil
				srv.mu.Unlock()
				if live {
					continue
				}
				ended++
				e := eps[id]
				st := r.send(PathStatus, id, r.stepReqOf(id, 1, "s1", 0, e.act))
				if st.Outcome != Executed || !st.Replayed || st.NextSeq != 2 || !reflect.DeepEqual(st.Transition, e.step.Transition) {
					t.Fatalf("status of seq 1: %+v, want the stored %+v", st, e.step.Transition)
				}
				next := r.send(PathStep, id, r.stepReqOf(id, 2, "s2", 1, e.act))
				if next.Outcome != Refused || next.Reason != ReasonEpisodeEnded || next.EndReason != tc.reason || next.NextSeq != 2 {
					t.Fatalf("step 2: %+v", next)
				}
				want := ""
				if tc.artifacts {
					_, want = inProcess(t, family(regs, rollout.FamilyLedger), e.att, e.act)
				}
				end := r.terminate(id, rollout.ReasonAnswer)
				if end.Status != StatusInfra || end.EndReason != tc.reason || end.Steps != 1 || end.Final == nil ||
					!reflect.DeepEqual(end.Final, e.step.Transition) || end.Artifacts != want || end.ValidatorInput.Artifacts != want {
					t.Fatalf("terminate: %+v\nwant steps 1, final %+v, artifacts %q", end, e.step.Transition, want)
				}
			}
			if ended != tc.ended {
				t.Fatalf("%d episodes ended at the restart, want %d", ended, tc.ended)
			}
		})
	}
}

// TestRecoveredArtifactsAsClosed: the artifacts of an episode whose family
// a restarted service no longer serves are read from its persisted world
// state; for every built-in family they are the bytes its Close returns.
func TestRecoveredArtifactsAsClosed(t *testing.T) {
	regs := registries(t)
	srv, err := NewServer(Config{Registries: regs[:1], Key: testKey})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ctx := context.Background()
	for _, reg := range regs {
		t.Run(reg.Family(), func(t *testing.T) {
			task := reg.Train()[0]
			att := attempts([]rollout.Task{task}, 1, 0)[0]
			ep, _, err := reg.Reset(ctx, att)
			if err != nil {
				t.Fatal(err)
			}
			for i, act := range []rollout.EnvAction{
				{IDs: []int32{rollout.TokCall, rollout.TokKey0 + task.Key, rollout.TokEnd}, Text: "<tool>calc: 1+1</tool>"},
				{IDs: []int32{rollout.TokXfer, rollout.TokKey0 + task.Key, rollout.TokEnd}, Text: "<tool>lookup: memo</tool>"},
			} {
				if _, err := ep.Step(ctx, int32(i), act); err != nil {
					t.Fatal(err)
				}
			}
			state, err := ep.(rollout.Stateful).State()
			if err != nil {
				t.Fatal(err)
			}
			fin, err := ep.Close(ctx, rollout.ReasonAborted)
			if err != nil {
				t.Fatal(err)
			}
			m := &epMeta{Family: reg.Family() + "-retired", Attempt: att}
			if got := srv.closedArtifacts(m, state); got != fin.Artifacts || got == "" {
				t.Fatalf("artifacts from the state %s\nclosed %s", got, fin.Artifacts)
			}
		})
	}
}

// TestSignedFieldsHaveOneReading: a token binds the bytes of a request's
// named fields as sent; a body that names such a field a second time, or
// in another case ("Action", which Go's JSON decoder would read into the
// action field), is refused 400 bad_request naming the key, and nothing
// runs. Before, a token for "calc: 1+1" ran "calc: 7*6" sent beside it as
// "Action".
func TestSignedFieldsHaveOneReading(t *testing.T) {
	regs := registries(t)
	svc := startService(t, Config{Registries: regs, DefaultLease: time.Hour})
	r := newRaw(t, svc.url, time.Minute, nil)
	att := attempts(family(regs, rollout.FamilyText).Train()[:1], 1, 0)[0]
	// appended is the JSON of req with the extra members added at its end
	// (after the signed field, where a lenient decoder's last value wins).
	appended := func(req any, extra string) string {
		b, _ := json.Marshal(req)
		return string(b[:len(b)-1]) + "," + extra + "}"
	}
	signed := AllocateRequest{Protocol: 1, Attempt: att, IdempotencyKey: "k",
		Token: r.iss.Issue(AllocateScope(att), 0, AllocateAction(att, "k"))}
	other := att
	other.AttemptID += "-other"
	otherJSON, _ := json.Marshal(other)
	var alloc AllocateResponse
	if code := r.postRaw(PathEpisodes, appended(signed, `"Attempt":`+string(otherJSON)), &alloc); code != http.StatusBadRequest ||
		alloc.Reason != ReasonBadRequest || !strings.Contains(alloc.Detail, `key "Attempt"`) {
		t.Fatalf("allocate with a second attempt: %d %+v", code, alloc)
	}
	id := r.allocate(att, "k", 0).EpisodeID
	if id == "" {
		t.Fatal("no episode allocated after the refused request")
	}
	step := r.stepReqOf(id, 1, "s1", 0, rollout.EnvAction{Text: "<tool>calc: 1+1</tool>"})
	path := strings.Replace(PathStep, "{id}", id, 1)
	for _, tc := range []struct{ name, extra, key string }{
		{"another case", `"Action":{"text":"<tool>calc: 7*6</tool>"}`, `key "Action": keys are case-sensitive, the field is "action"`},
		{"given twice", `"action":{"text":"<tool>calc: 7*6</tool>"}`, `key "action" given twice`},
		{"turn given twice", `"turn":0`, `key "turn" given twice`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got StepResponse
			if code := r.postRaw(path, appended(step, tc.extra), &got); code != http.StatusBadRequest || got.Reason != ReasonBadRequest || got.Detail != tc.key {
				t.Fatalf("%d %+v, want 400 bad_request %q", code, got, tc.key)
			}
		})
	}
	if got := r.send(PathStatus, id, step); got.Reason != ReasonNotReceived {
		t.Fatalf("status of seq 1 after the refused steps: %+v, want not_received", got)
	}
	got := r.send(PathStep, id, step)
	if got.Outcome != Executed || got.Transition == nil || got.Transition.Observation.Text != "calc result: 2" {
		t.Fatalf("the signed step: %+v", got)
	}
}
