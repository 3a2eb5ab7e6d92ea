package envsvc

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// FuzzStep: whatever a policy sends as one turn's action — ids of any
// value, text of any bytes, at any turn number — under a valid token to a
// fresh episode of either family, the service answers with a well-formed
// response (executed with a transition whose decision is one of the
// three, or refused with a reason), never a panic or a broken reply, and
// the episode still terminates cleanly after it. Ids come from the
// fuzzer four bytes each, the whole int32 range included.
func FuzzStep(f *testing.F) {
	regs := registries(f)
	// Tokens good for the whole fuzzing run: an hour, which the service
	// accepts once its maximum token lifetime allows it.
	svc := startService(f, Config{Registries: regs, MaxTokenTTL: time.Hour})
	base := newRaw(f, svc.url, time.Hour, nil)
	le := func(ids ...int32) []byte {
		b := make([]byte, 0, 4*len(ids))
		for _, id := range ids {
			b = binary.LittleEndian.AppendUint32(b, uint32(id))
		}
		return b
	}
	f.Add(uint8(0), int32(0), le(rollout.TokXfer, rollout.TokKey0+1, rollout.TokEnd), "")
	f.Add(uint8(0), int32(0), le(rollout.TokAns, rollout.TokVal0, rollout.TokEnd), "")
	f.Add(uint8(0), int32(-1), le(rollout.TokCall, -1<<31, rollout.TokEnd), "")
	f.Add(uint8(1), int32(0), []byte(nil), "CALL K1")
	f.Add(uint8(1), int32(3), le(rollout.TokCall), "ANS V2\x00\xff")
	n := 0
	f.Fuzz(func(t *testing.T, fam uint8, turn int32, idBytes []byte, text string) {
		r := &raw{t: t, url: base.url, iss: base.iss, now: base.now}
		reg := regs[int(fam)%len(regs)]
		n++
		task := reg.Train()[n%len(reg.Train())]
		att := attempts([]rollout.Task{task}, 1, int32(n))[0]
		al := r.allocate(att, fmt.Sprintf("k%d", n), 0)
		if al.Outcome != Executed || al.EpisodeID == "" {
			t.Fatalf("allocate: %+v", al)
		}
		ids := make([]int32, len(idBytes)/4)
		for i := range ids {
			ids[i] = int32(binary.LittleEndian.Uint32(idBytes[4*i:]))
		}
		req := r.stepReq(al.EpisodeID, 1, "s1", turn, ids...)
		req.Action.Text = text
		req.Token = r.iss.Issue(al.EpisodeID, 1, StepAction(turn, req.Action))
		got := r.send(PathStep, al.EpisodeID, req)
		if executed(t, "step", got.Response) {
			if got.Transition == nil || got.NextSeq != 2 {
				t.Fatalf("executed: %+v", got)
			}
			if msg := unusable(*got.Transition); msg != "" {
				t.Fatalf("executed: %s", msg)
			}
		}
		if end := r.terminate(al.EpisodeID, "done"); end.Outcome != Executed {
			t.Fatalf("terminate after the step: %+v", end)
		}
	})
}

// FuzzClientStep: whatever a service answers to a step — any bytes, with
// the status 200 — the client returns a transition with one of the three
// decisions (and a reason when it is not ok) or an error wrapping
// ErrInfrastructure; it never panics, and the episode can still be
// closed. The service is real: allocation, status queries and
// termination reach it; only the step's answer is replaced. The seeds
// are the real service's answers to a few steps, and corruptions of them.
func FuzzClientStep(f *testing.F) {
	regs := registries(f)
	svc := startService(f, Config{Registries: regs})
	var body atomic.Pointer[[]byte]
	var record atomic.Pointer[[][]byte]
	real := svc.srv.Handler()
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasSuffix(r.URL.Path, "/step") {
			real.ServeHTTP(w, r)
			return
		}
		if b := body.Load(); b != nil {
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			w.Write(*b)
			return
		}
		rec := httptest.NewRecorder()
		real.ServeHTTP(rec, r)
		if got := record.Load(); got != nil {
			*got = append(*got, bytes.Clone(rec.Body.Bytes()))
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(rec.Code)
		w.Write(rec.Body.Bytes())
	}))
	f.Cleanup(hs.Close)
	c := newClient(f, []string{hs.URL}, Options{ToolRetries: 0, Backoff: time.Millisecond, ToolTimeout: 2 * time.Second})
	reg := family(regs, rollout.FamilyLedger)
	ctx := context.Background()
	n := 0
	episode := func(tb testing.TB) rollout.Episode {
		n++
		task := reg.Train()[n%len(reg.Train())]
		ep, _, err := c.Reset(ctx, attempts([]rollout.Task{task}, 1, int32(n))[0])
		if err != nil {
			tb.Fatal(err)
		}
		return ep
	}
	var seeds [][]byte
	record.Store(&seeds)
	for _, ids := range [][]int32{{rollout.TokXfer, rollout.TokKey0, rollout.TokEnd}, {rollout.TokAns, rollout.TokVal0, rollout.TokEnd}, {7}} {
		ep := episode(f)
		if _, err := ep.Step(ctx, 0, rollout.EnvAction{IDs: ids}); err != nil {
			f.Fatal(err)
		}
		if _, err := ep.Close(ctx, "done"); err != nil {
			f.Fatal(err)
		}
	}
	record.Store(nil)
	if len(seeds) != 3 {
		f.Fatalf("%d answers recorded, want 3", len(seeds))
	}
	for _, b := range seeds {
		f.Add(b)
		f.Add(b[:len(b)/2])
		f.Add(bytes.ReplaceAll(b, []byte(`"decision":"`), []byte(`"decision":"x`)))
	}
	f.Add([]byte(`{"protocol":1,"outcome":"executed"}`))
	f.Add([]byte(`{"protocol":1,"outcome":"executed","transition":{}}`))
	f.Fuzz(func(t *testing.T, answer []byte) {
		ep := episode(t)
		body.Store(&answer)
		tr, err := ep.Step(ctx, 0, rollout.EnvAction{IDs: []int32{rollout.TokAns, rollout.TokVal0, rollout.TokEnd}})
		body.Store(nil)
		switch {
		case err != nil && !errors.Is(err, ErrInfrastructure):
			t.Fatalf("%v: not an infrastructure failure", err)
		case err == nil && unusable(tr) != "":
			t.Fatalf("accepted %s: %s", answer, unusable(tr))
		}
		if _, err := ep.Close(ctx, "done"); err != nil && !errors.Is(err, ErrInfrastructure) {
			t.Fatalf("close after the answer %s: %v", answer, err)
		}
	})
}

// TestClientBadTransitionAsksStatus: the service executes a step but its
// answer carries a decision the agent cannot use; the client asks the
// step's status, takes the stored transition (the step is not executed
// again: the ledger holds one transfer) and counts the retry as
// bad_transition.
func TestClientBadTransitionAsksStatus(t *testing.T) {
	regs := registries(t)
	svc := startService(t, Config{Registries: regs})
	real := svc.srv.Handler()
	var spoiled atomic.Int64
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasSuffix(r.URL.Path, "/step") || spoiled.Load() > 0 {
			real.ServeHTTP(w, r)
			return
		}
		spoiled.Add(1)
		rec := httptest.NewRecorder()
		real.ServeHTTP(rec, r)
		w.WriteHeader(rec.Code)
		w.Write(bytes.Replace(rec.Body.Bytes(), []byte(`"decision":"ok"`), []byte(`"decision":"maybe"`), 1))
	}))
	t.Cleanup(hs.Close)
	c := newClient(t, []string{hs.URL}, Options{ToolRetries: 2, Backoff: time.Millisecond})
	task, att := ledgerTask(t, regs, 1)
	ctx := ctxT(t, time.Minute)
	ep, _, err := c.Reset(ctx, att)
	if err != nil {
		t.Fatal(err)
	}
	tr, err := ep.Step(ctx, 0, rollout.EnvAction{IDs: []int32{rollout.TokXfer, rollout.TokKey0 + task.Key, rollout.TokEnd}})
	if err != nil || tr.Decision != schemas.DecisionOK || spoiled.Load() != 1 {
		t.Fatalf("step: %+v, %v (%d spoiled answers)", tr, err, spoiled.Load())
	}
	final, err := ep.Close(ctx, "done")
	if err != nil {
		t.Fatal(err)
	}
	var art rollout.LedgerArtifacts
	if err := json.Unmarshal([]byte(final.Artifacts), &art); err != nil || len(art.Transfers) != 1 {
		t.Fatalf("ledger %s (%v): want one transfer", final.Artifacts, err)
	}
	n := c.Counters()
	if n.Retries["bad_transition"] != 1 || n.StatusExecuted != 1 {
		t.Fatalf("counters %+v: want one bad_transition retry answered by the status query", n)
	}
}

// FuzzAllocate: an allocation of any attempt — the task id, versions,
// split, group, member, seed and lease as the fuzzer makes them — under a
// valid token is answered executed, with an episode id and a spec of one
// of the served families (and the episode then terminates), or refused
// with a reason; never a panic or a broken reply.
func FuzzAllocate(f *testing.F) {
	regs := registries(f)
	// Tokens good for the whole fuzzing run: an hour, which the service
	// accepts once its maximum token lifetime allows it.
	svc := startService(f, Config{Registries: regs, MaxTokenTTL: time.Hour})
	base := newRaw(f, svc.url, time.Hour, nil)
	reg := family(regs, rollout.FamilyLedger)
	a := attempts(reg.Train()[:1], 1, 0)[0]
	f.Add(a.TaskID, a.TaskVersion, a.EnvVersion, a.Split, int32(1), int32(0), int64(7), int64(0))
	f.Add(a.TaskID, "v999", a.EnvVersion, "eval", int32(-1), int32(5), int64(-1), int64(-5))
	f.Add("", "", "", "", int32(0), int32(0), int64(0), int64(1<<62))
	f.Add("kv-train-0001\x00", a.TaskVersion, "env-x", a.Split, int32(1<<30), int32(-7), int64(1), int64(1))
	families := make([]string, len(regs))
	for i, r := range regs {
		families[i] = r.Family()
	}
	n := 0
	f.Fuzz(func(t *testing.T, taskID, taskVersion, envVersion, split string, groupSize, member int32, seed, leaseMS int64) {
		r := &raw{t: t, url: base.url, iss: base.iss, now: base.now}
		n++
		att := a
		att.TaskID, att.TaskVersion, att.EnvVersion, att.Split = taskID, taskVersion, envVersion, split
		att.GroupSize, att.Member, att.Seed = groupSize, member, seed
		att.AttemptID = fmt.Sprintf("fz-%d", n)
		got := r.allocate(att, fmt.Sprintf("k%d", n), leaseMS)
		if !executed(t, "allocate", got.Response) {
			return
		}
		if got.EpisodeID == "" || !slices.Contains(families, got.Spec.Family) {
			t.Fatalf("executed without an episode of a served family: %+v", got)
		}
		if end := r.terminate(got.EpisodeID, "done"); end.Outcome != Executed {
			t.Fatalf("terminate: %+v", end)
		}
	})
}

// executed checks what every answer must hold — this protocol's version,
// an outcome of executed or refused, a refusal's reason — and reports
// whether op was executed.
func executed(t *testing.T, op string, r Response) bool {
	t.Helper()
	switch {
	case r.Protocol != ProtocolVersion:
		t.Fatalf("%s answered protocol %d: %+v", op, r.Protocol, r)
	case r.Outcome == Refused && r.Reason == "":
		t.Fatalf("%s refused without a reason: %+v", op, r)
	case r.Outcome != Refused && r.Outcome != Executed:
		t.Fatalf("%s: outcome %q: %+v", op, r.Outcome, r)
	}
	return r.Outcome == Executed
}

// unusable says why an agent could not take tr as a turn's transition
// (docs/ENV_PROTOCOL.md "Step": one of the three decisions, a refusal
// with its reason), or "".
func unusable(tr rollout.Transition) string {
	switch {
	case !slices.Contains([]string{schemas.DecisionOK, schemas.DecisionInvalid, schemas.DecisionDenied}, tr.Decision):
		return fmt.Sprintf("decision %q", tr.Decision)
	case tr.Decision != schemas.DecisionOK && tr.Reason == "":
		return fmt.Sprintf("decision %q without a reason", tr.Decision)
	}
	return ""
}
