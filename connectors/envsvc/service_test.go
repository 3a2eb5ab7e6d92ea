package envsvc

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/env/capability"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/faketok"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// textScript plays fixed action texts, one per turn, each ended by the
// end-of-turn token of the fake tokenizer.
type textScript []string

func (s textScript) Generate(_ context.Context, reqs []model.Request) ([]model.Sample, error) {
	out := make([]model.Sample, len(reqs))
	for i, r := range reqs {
		turn := strings.Count(faketok.Decode(r.Context), "<|im_start|>assistant") - 1
		ids := append(faketok.Encode(s[min(turn, len(s)-1)]), faketok.IMEnd)
		out[i] = model.Sample{Tokens: ids, Logprobs: make([]float32, len(ids))}
	}
	return out, nil
}

// TestSameTrajectoriesInProcessAndService: the same attempts give
// byte-identical trajectories (Arrow IPC) in process and through the
// service, for every family; episodes spread over two services.
func TestSameTrajectoriesInProcessAndService(t *testing.T) {
	ctx := ctxT(t, 2*time.Minute)
	regs := registries(t)
	a := startService(t, Config{Registries: regs, Store: openStore(t, t.TempDir(), false)})
	b := startService(t, Config{Registries: regs, Store: openStore(t, t.TempDir(), false)})
	c := newClient(t, []string{a.url, b.url}, Options{})
	tok := &faketok.Tokenizer{}
	for _, tc := range []struct {
		family string
		pol    rollout.Policy
		tasks  int
		lim    func(*rollout.Limits)
	}{
		{rollout.FamilyKV, randomPolicy(t, 3), 64, nil},
		{rollout.FamilyLedger, randomPolicy(t, 5), 32, nil},
		{rollout.FamilyLedger, rollout.LedgerTeacher{}, 16, nil},
		{rollout.FamilyText, textScript{"<tool>lookup: amber</tool>", "<tool>calc: 6*7 - 2</tool>", "<tool>lookup: memo</tool>", "<answer>40</answer>"}, 16,
			func(l *rollout.Limits) { l.MaxEpisodeTokens = 4096 }},
	} {
		reg := family(regs, tc.family)
		atts := attempts(reg.Train()[:tc.tasks], 4, 0)
		lim := fixedLimits()
		if tc.lim != nil {
			tc.lim(&lim)
		}
		s := rollout.DefaultSettings(reg)
		in, err := rollout.Agent{Env: reg, Policy: tc.pol, Tokenizer: tok, Settings: s, Limits: lim}.Run(ctx, atts)
		if err != nil {
			t.Fatal(err)
		}
		out, err := rollout.Agent{Env: c, Policy: tc.pol, Tokenizer: tok, Settings: s, Limits: lim}.Run(ctx, atts)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(encode(t, in), encode(t, out)) {
			for i := range in {
				if !bytes.Equal(encode(t, in[i:i+1]), encode(t, out[i:i+1])) {
					t.Fatalf("%s: trajectory %d differs:\nin process %+v\nservice    %+v", tc.family, i, in[i], out[i])
				}
			}
			t.Fatalf("%s: batches differ", tc.family)
		}
		v := rollout.NewValidator(reg)
		for i := range out {
			task, _ := reg.Lookup(out[i].TaskID)
			if _, _, err := v.Validate(task, &out[i]); err != nil {
				t.Fatalf("%s: %v", tc.family, err)
			}
		}
	}
	na := value(a.srv.met.allocated.WithLabelValues(rollout.FamilyKV))
	nb := value(b.srv.met.allocated.WithLabelValues(rollout.FamilyKV))
	if na+nb != 256 || na < 64 || nb < 64 {
		t.Fatalf("kv episodes per service %v + %v", na, nb)
	}
	if a.srv.Live() != 0 || b.srv.Live() != 0 {
		t.Fatalf("live episodes after the runs: %d, %d", a.srv.Live(), b.srv.Live())
	}
}

// TestLeastLoadedRouting: episodes go to the service with the fewest live
// episodes; every call of an episode goes to the service that holds it.
func TestLeastLoadedRouting(t *testing.T) {
	ctx := ctxT(t, time.Minute)
	regs := registries(t)
	a := startService(t, Config{Registries: regs})
	b := startService(t, Config{Registries: regs})
	busy := newRaw(t, a.url, time.Minute, nil)
	kv := family(regs, rollout.FamilyKV)
	for i, att := range attempts(kv.Train()[100:104], 1, 0) { // four episodes of another controller on a
		if r := busy.allocate(att, fmt.Sprint("other-", i), 60000); r.Outcome != Executed {
			t.Fatal(r)
		}
	}
	c := newClient(t, []string{a.url, b.url}, Options{})
	var eps []rollout.Episode
	for _, att := range attempts(kv.Train()[:8], 1, 0) {
		ep, _, err := c.Reset(ctx, att)
		if err != nil {
			t.Fatal(err)
		}
		eps = append(eps, ep)
	}
	// a starts with 4 (reported after the first answer from it), so b
	// takes the first ones until both are even.
	if la, lb := a.srv.Live(), b.srv.Live(); la+lb != 12 || la < 5 || lb < 5 {
		t.Fatalf("live a %d, b %d", la, lb)
	}
	for _, ep := range eps {
		if _, err := ep.Step(ctx, 0, rollout.EnvAction{IDs: []int32{rollout.TokAns, rollout.TokVal0, rollout.TokEnd}}); err != nil {
			t.Fatal(err)
		}
		if _, err := ep.Close(ctx, rollout.ReasonAnswer); err != nil {
			t.Fatal(err)
		}
	}
	if a.srv.Live() != 4 || b.srv.Live() != 0 {
		t.Fatalf("after close: a %d, b %d", a.srv.Live(), b.srv.Live())
	}
}

func ledgerTask(t testing.TB, regs []*rollout.Registry, i int) (rollout.Task, schemas.TaskAttempt) {
	reg := family(regs, rollout.FamilyLedger)
	task := reg.Train()[i]
	return task, attempts([]rollout.Task{task}, 1, 0)[0]
}

// TestSequenceNumbers: a repeated delivery with the same idempotency key
// gets the stored transition and executes nothing; a different action
// under a used sequence number, another delivery of a used one, a gap and
// sequence number 0 are refused; a status query of an action never sent is
// unknown. The ledger shows one transfer.
func TestSequenceNumbers(t *testing.T) {
	regs := registries(t)
	svc := startService(t, Config{Registries: regs})
	r := newRaw(t, svc.url, time.Minute, nil)
	task, att := ledgerTask(t, regs, 2)
	al := r.allocate(att, "k1", 0)
	if al.Outcome != Executed || al.EpisodeID == "" || al.Spec.Family != rollout.FamilyLedger {
		t.Fatalf("allocate %+v", al)
	}
	if again := r.allocate(att, "k1", 0); again.EpisodeID != al.EpisodeID || again.Outcome != Executed {
		t.Fatalf("repeated allocation %+v", again)
	}
	id := al.EpisodeID
	dst := rollout.TokKey0 + task.Key
	xfer := []int32{rollout.TokXfer, dst, rollout.TokEnd}
	first := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, xfer...))
	if first.Outcome != Executed || first.Replayed || first.Transition == nil || first.Transition.Decision != schemas.DecisionOK || first.NextSeq != 2 {
		t.Fatalf("first step %+v", first)
	}
	dup := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, xfer...))
	if dup.Outcome != Executed || !dup.Replayed || !slices.Equal(dup.Transition.Observation.IDs, first.Transition.Observation.IDs) {
		t.Fatalf("duplicate %+v", dup)
	}
	for _, tc := range []struct {
		name   string
		req    StepRequest
		reason string
	}{
		{"another action under seq 1", r.stepReq(id, 1, "s1", 0, rollout.TokCall, dst, rollout.TokEnd), ReasonSeqConflict},
		{"another delivery of seq 1", r.stepReq(id, 1, "s1-bis", 0, xfer...), ReasonSeqReplayed},
		{"gap", r.stepReq(id, 3, "s3", 2, xfer...), ReasonSeqGap},
		{"seq 0", r.stepReq(id, 0, "s0", 0, xfer...), ReasonSeqGap},
	} {
		got := r.send(PathStep, id, tc.req)
		if got.Outcome != Refused || got.Reason != tc.reason || got.Transition != nil {
			t.Fatalf("%s: %+v", tc.name, got)
		}
	}
	if st := r.send(PathStatus, id, r.stepReq(id, 2, "s2", 1, xfer...)); st.Outcome != Unknown || st.Reason != ReasonNotReceived {
		t.Fatalf("status of an unsent action %+v", st)
	}
	if st := r.send(PathStatus, id, r.stepReq(id, 1, "s1", 0, xfer...)); st.Outcome != Executed || st.Transition == nil {
		t.Fatalf("status of seq 1 %+v", st)
	}
	ans := []int32{rollout.TokAns, first.Transition.Observation.IDs[1], rollout.TokEnd}
	if st := r.send(PathStep, id, r.stepReq(id, 2, "s2", 1, ans...)); st.Outcome != Executed || !st.Transition.Terminated {
		t.Fatalf("answer %+v", st)
	}
	// The answer ended the episode: another action is refused as
	// episode_ended (not as the environment's failure), before terminate.
	if after := r.send(PathStep, id, r.stepReq(id, 3, "s3", 2, xfer...)); after.Outcome != Refused || after.Reason != ReasonEpisodeEnded ||
		after.NextSeq != 3 || !strings.Contains(after.Detail, "sequence number 2 ended the episode") {
		t.Fatalf("a step after the terminating one %+v", after)
	}
	end := r.terminate(id, rollout.ReasonAnswer)
	if end.Outcome != Executed || end.Status != StatusCompleted || end.Steps != 2 || end.ValidatorInput == nil || end.ValidatorInput.TaskID != task.ID {
		t.Fatalf("terminate %+v", end)
	}
	var art rollout.LedgerArtifacts
	if err := json.Unmarshal([]byte(end.Artifacts), &art); err != nil || len(art.Transfers) != 1 {
		t.Fatalf("ledger %s", end.Artifacts)
	}
	if again := r.terminate(id, rollout.ReasonAnswer); again.Artifacts != end.Artifacts || again.Status != StatusCompleted {
		t.Fatalf("second terminate %+v", again)
	}
	// After the end: a stored delivery still answers, nothing new runs.
	if late := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, xfer...)); late.Outcome != Executed || !late.Replayed {
		t.Fatalf("late duplicate %+v", late)
	}
	if late := r.send(PathStep, id, r.stepReq(id, 3, "s3", 2, xfer...)); late.Outcome != Refused || late.Reason != ReasonEpisodeEnded {
		t.Fatalf("step after the end %+v", late)
	}
	if got := value(svc.srv.met.steps.WithLabelValues(rollout.FamilyLedger)); got != 2 {
		t.Fatalf("%v actions executed, want 2", got)
	}
	if re := r.allocate(att, "k1", 0); re.Outcome != Refused || re.Reason != ReasonEpisodeEnded {
		t.Fatalf("allocation of an ended episode %+v", re)
	}
}

// TestTokensRefused: forged, expired, malformed, replayed and mis-scoped
// tokens are refused with their reasons, and nothing executes.
func TestTokensRefused(t *testing.T) {
	regs := registries(t)
	clk := &clock{t: time.Unix(1_800_000_000, 0)}
	svc := startService(t, Config{Registries: regs, Now: clk.now, DefaultLease: time.Hour})
	r := newRaw(t, svc.url, 30*time.Second, clk.now)
	task, att := ledgerTask(t, regs, 4)
	id := r.allocate(att, "k", 0).EpisodeID
	other := r.allocate(attempts(family(regs, rollout.FamilyLedger).Train()[5:6], 1, 0)[0], "k", 0).EpisodeID
	xfer := rollout.EnvAction{IDs: []int32{rollout.TokXfer, rollout.TokKey0 + task.Key, rollout.TokEnd}}
	act := StepAction(0, xfer)
	otherKey := bytes.Repeat([]byte{9}, capability.KeySize)
	forger, _ := capability.NewIssuer(otherKey, "run", time.Minute, clk.now)
	otherRun, _ := capability.NewIssuer(testKey, "run-2", time.Minute, clk.now)
	req := func(tok string) StepRequest {
		return StepRequest{Protocol: 1, Seq: 1, IdempotencyKey: "s1", Turn: 0, Action: xfer, Token: tok}
	}
	expired := r.iss.Issue(id, 1, act)
	clk.add(31 * time.Second)
	for _, tc := range []struct {
		name, tok, reason string
	}{
		{"forged", forger.Issue(id, 1, act), ReasonTokenForged},
		{"tampered", func() string { s := r.iss.Issue(id, 1, act); return s[:len(s)-3] + "AAA" }(), ReasonTokenForged},
		{"expired", expired, ReasonTokenExpired},
		{"malformed", "not-a-token", ReasonTokenMalformed},
		{"another episode's", r.iss.Issue(other, 1, act), ReasonTokenScope},
		{"another sequence number's", r.iss.Issue(id, 2, act), ReasonTokenScope},
		{"another action's", r.iss.Issue(id, 1, StepAction(0, rollout.EnvAction{IDs: []int32{rollout.TokCall, rollout.TokKey0, rollout.TokEnd}})), ReasonTokenScope},
		{"another run's", otherRun.Issue(id, 1, act), ReasonTokenScope},
	} {
		got := r.send(PathStep, id, req(tc.tok))
		if got.Outcome != Refused || got.Reason != tc.reason || got.NextSeq != 1 {
			t.Fatalf("%s token: %+v (want next_seq 1)", tc.name, got)
		}
	}
	if got := value(svc.srv.met.steps.WithLabelValues(rollout.FamilyLedger)); got != 0 {
		t.Fatalf("%v actions executed with bad tokens", got)
	}
	// A valid token executes once; replayed as another delivery it is refused.
	tok := r.iss.Issue(id, 1, act)
	if got := r.send(PathStep, id, req(tok)); got.Outcome != Executed {
		t.Fatalf("valid token %+v", got)
	}
	replay := req(tok)
	replay.IdempotencyKey = "intruder"
	if got := r.send(PathStep, id, replay); got.Outcome != Refused || got.Reason != ReasonSeqReplayed {
		t.Fatalf("replayed token %+v", got)
	}
	// Control requests are scoped too.
	var rr RenewResponse
	r.post(strings.Replace(PathRenew, "{id}", id, 1), RenewRequest{Protocol: 1, Token: r.iss.Issue(other, 0, RenewAction)}, &rr)
	if rr.Outcome != Refused || rr.Reason != ReasonTokenScope {
		t.Fatalf("renewal with another episode's token %+v", rr)
	}
	var tr TerminateResponse
	r.post(strings.Replace(PathTerminate, "{id}", id, 1), TerminateRequest{Protocol: 1, Token: r.iss.Issue(id, 0, RenewAction)}, &tr)
	if tr.Outcome != Refused || tr.Reason != ReasonTokenScope {
		t.Fatalf("termination with a renewal token %+v", tr)
	}
	var ar AllocateResponse
	r.post(PathEpisodes, AllocateRequest{Protocol: 1, Attempt: att, IdempotencyKey: "k2", Token: forger.Issue(AllocateScope(att), 0, AllocateAction(att, "k2"))}, &ar)
	if ar.Outcome != Refused || ar.Reason != ReasonTokenForged {
		t.Fatalf("forged allocation %+v", ar)
	}
	// Wrong protocol version and garbage are bad requests.
	var bad StepResponse
	w := req(tok)
	w.Protocol = 2
	if code := r.post(strings.Replace(PathStep, "{id}", id, 1), w, &bad); code != http.StatusBadRequest || bad.Reason != ReasonBadRequest {
		t.Fatalf("protocol 2: %d %+v", code, bad)
	}
	// Missing fields are bad requests too, answered 400 and named, before
	// any token is looked at.
	noKey := req(tok)
	noKey.IdempotencyKey = ""
	if code := r.post(strings.Replace(PathStep, "{id}", id, 1), noKey, &bad); code != http.StatusBadRequest ||
		bad.Reason != ReasonBadRequest || bad.Detail != "missing idempotency_key" {
		t.Fatalf("a step without its idempotency key: %d %+v", code, bad)
	}
	var noFields AllocateResponse
	if code := r.post(PathEpisodes, map[string]int{"protocol": 1}, &noFields); code != http.StatusBadRequest || noFields.Reason != ReasonBadRequest ||
		noFields.Detail != "missing attempt, idempotency_key" {
		t.Fatalf("an allocation of nothing: %d %+v", code, noFields)
	}
	resp, err := http.Post(svc.url+"/v1/episodes/"+id+"/step", "application/json", strings.NewReader("{"))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), ReasonBadRequest) || resp.Header.Get(HeaderProtocol) != "1" {
		t.Fatalf("garbage: %d %s", resp.StatusCode, body)
	}
}

// TestTokensBindTheBytesSent: a client that is not the Go client signs
// the bytes it sends — here an attempt object with its keys in another
// order and spaces, an action with spaces — and the service verifies the
// token against those bytes (docs/ENV_PROTOCOL.md, "Capability tokens").
func TestTokensBindTheBytesSent(t *testing.T) {
	regs := registries(t)
	svc := startService(t, Config{Registries: regs, DefaultLease: time.Hour})
	r := newRaw(t, svc.url, time.Minute, time.Now)
	task, att := ledgerTask(t, regs, 4)
	var fields map[string]any
	b, _ := json.Marshal(att)
	if err := json.Unmarshal(b, &fields); err != nil {
		t.Fatal(err)
	}
	sorted, _ := json.MarshalIndent(fields, "", " ") // keys sorted, newlines and spaces
	action := []byte(`{"attempt":` + string(sorted) + `,"idempotency_key":"k 1"}`)
	body := `{"protocol": 1, "idempotency_key": "k 1", "attempt": ` + string(sorted) + `, "token": "` +
		r.iss.Issue(AllocateScope(att), 0, action) + `"}`
	var ar AllocateResponse
	if code := r.postRaw(PathEpisodes, body, &ar); code != http.StatusOK || ar.Outcome != Executed {
		t.Fatalf("allocation signed over the bytes sent: %d %+v", code, ar)
	}
	ids := fmt.Sprintf("[%d, %d, %d]", rollout.TokXfer, rollout.TokKey0+task.Key, rollout.TokEnd)
	stepAction := []byte(`{"turn":0,"action":{ "ids" : ` + ids + ` }}`)
	step := `{"protocol":1,"seq":1,"idempotency_key":"s1","turn":0,"action":{ "ids" : ` + ids + ` },"token":"` +
		r.iss.Issue(ar.EpisodeID, 1, stepAction) + `"}`
	var st StepResponse
	if code := r.postRaw(strings.Replace(PathStep, "{id}", ar.EpisodeID, 1), step, &st); code != http.StatusOK || st.Outcome != Executed {
		t.Fatalf("step signed over the bytes sent: %d %+v", code, st)
	}
	// The Go client's canonical bytes of the same action are other bytes:
	// a token over them does not fit this request.
	step2 := `{"protocol":1,"seq":2,"idempotency_key":"s2","turn":1,"action":{ "ids" : ` + ids + ` },"token":"` +
		r.iss.Issue(ar.EpisodeID, 2, StepAction(1, rollout.EnvAction{IDs: []int32{rollout.TokXfer, rollout.TokKey0 + task.Key, rollout.TokEnd}})) + `"}`
	if code := r.postRaw(strings.Replace(PathStep, "{id}", ar.EpisodeID, 1), step2, &st); code != http.StatusOK || st.Reason != ReasonTokenScope {
		t.Fatalf("a token over other bytes than those sent: %d %+v", code, st)
	}
}

// TestLeaseExpiry: an episode whose lease runs out ends as an
// infrastructure failure: steps are refused, termination reports status
// infra, the client's Close and Step say ErrInfrastructure. A client that
// renews keeps its episode past many lease lengths.
func TestLeaseExpiry(t *testing.T) {
	ctx := ctxT(t, time.Minute)
	regs := registries(t)
	svc := startService(t, Config{Registries: regs, ReapInterval: 10 * time.Millisecond})
	r := newRaw(t, svc.url, time.Minute, nil)
	task, att := ledgerTask(t, regs, 6)
	id := r.allocate(att, "k", 150).EpisodeID
	xfer := []int32{rollout.TokXfer, rollout.TokKey0 + task.Key, rollout.TokEnd}
	deadline := time.Now().Add(5 * time.Second)
	for svc.srv.Live() != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, xfer...)); got.Outcome != Refused || got.Reason != ReasonLeaseExpired {
		t.Fatalf("step after expiry %+v", got)
	}
	if got := r.renew(id, 1000); got.Outcome != Refused || got.Reason != ReasonLeaseExpired {
		t.Fatalf("renewal after expiry %+v", got)
	}
	if end := r.terminate(id, rollout.ReasonAnswer); end.Outcome != Executed || end.Status != StatusInfra || end.EndReason != ReasonLeaseExpired {
		t.Fatalf("terminate after expiry %+v", end)
	}
	if got := value(svc.srv.met.ended.WithLabelValues(StatusInfra, ReasonLeaseExpired)); got != 1 {
		t.Fatalf("ended infra/lease_expired = %v", got)
	}
	// The client renews every Lease/3.
	c := newClient(t, []string{svc.url}, Options{Lease: 900 * time.Millisecond})
	ep, _, err := c.Reset(ctx, attempts(family(regs, rollout.FamilyLedger).Train()[7:8], 1, 0)[0])
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2700 * time.Millisecond)
	if _, err := ep.Step(ctx, 0, rollout.EnvAction{IDs: []int32{rollout.TokCall, rollout.TokKey0, rollout.TokEnd}}); err != nil {
		t.Fatalf("step after 4 lease lengths with renewals: %v", err)
	}
	if _, err := ep.Close(ctx, rollout.ReasonMaxTurns); err != nil {
		t.Fatal(err)
	}
	if n := c.Counters().LeaseRenewals; n < 3 {
		t.Fatalf("%d renewals", n)
	}
	// A client whose renewals cannot keep up loses the episode: an
	// infrastructure failure.
	slow := newClient(t, []string{svc.url}, Options{Lease: time.Hour})
	ep, _, err = slow.Reset(ctx, attempts(family(regs, rollout.FamilyLedger).Train()[8:9], 1, 0)[0])
	if err != nil {
		t.Fatal(err)
	}
	svc.srv.mu.Lock()
	e := svc.srv.live[ep.(*remoteEpisode).id]
	svc.srv.mu.Unlock()
	e.leaseMu.Lock()
	e.lease = time.Now() // as if it had not been renewed
	e.leaseMu.Unlock()
	for svc.srv.Live() != 0 && time.Now().Before(deadline.Add(5*time.Second)) {
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := ep.Step(ctx, 0, rollout.EnvAction{IDs: []int32{rollout.TokCall, rollout.TokKey0, rollout.TokEnd}}); !errors.Is(err, ErrInfrastructure) {
		t.Fatalf("step of an expired episode: %v", err)
	}
	if _, err := ep.Close(ctx, rollout.ReasonAborted); !errors.Is(err, ErrInfrastructure) {
		t.Fatalf("close of an expired episode: %v", err)
	}
}

// TestSlotScrubbedBeforeReuse: with one slot, the next episode reuses the
// slot of the last; nothing of the last one's world (a transfer, its
// journal, its sequence numbers) is visible in it.
func TestSlotScrubbedBeforeReuse(t *testing.T) {
	regs := registries(t)
	svc := startService(t, Config{Registries: regs, MaxEpisodes: 1})
	r := newRaw(t, svc.url, time.Minute, nil)
	task, att := ledgerTask(t, regs, 9)
	dst := rollout.TokKey0 + task.Key
	fresh := func(a schemas.TaskAttempt, key string) (AllocateResponse, rollout.Transition) {
		al := r.allocate(a, key, 0)
		if al.Outcome != Executed || al.Slot != 0 {
			t.Fatalf("allocate %+v", al)
		}
		bal := r.send(PathStep, al.EpisodeID, r.stepReq(al.EpisodeID, 1, "q", 0, rollout.TokCall, dst, rollout.TokEnd))
		if bal.Outcome != Executed {
			t.Fatalf("balance %+v", bal)
		}
		return al, *bal.Transition
	}
	al1, open1 := fresh(att, "first")
	// The slot is taken: a second allocation is refused (capacity, retry).
	other := attempts([]rollout.Task{task}, 1, 1)[0]
	if busy := r.allocate(other, "second", 0); busy.Outcome != Refused || busy.Reason != ReasonCapacity || !busy.Retry {
		t.Fatalf("second allocation %+v", busy)
	}
	if x := r.send(PathStep, al1.EpisodeID, r.stepReq(al1.EpisodeID, 2, "x", 1, rollout.TokXfer, dst, rollout.TokEnd)); x.Transition.Decision != schemas.DecisionOK {
		t.Fatalf("transfer %+v", x)
	}
	end1 := r.terminate(al1.EpisodeID, rollout.ReasonMaxTurns)
	if !strings.Contains(end1.Artifacts, `"transfers":[{`) {
		t.Fatalf("first episode's journal %s", end1.Artifacts)
	}
	// Same task, same slot: the opening balance again, an empty journal,
	// sequence numbers from 1.
	al2, open2 := fresh(other, "second")
	if al2.EpisodeID == al1.EpisodeID || !slices.Equal(open2.Observation.IDs, open1.Observation.IDs) {
		t.Fatalf("second episode %s sees balance %v, first saw %v", al2.EpisodeID, open2.Observation.IDs, open1.Observation.IDs)
	}
	if st := r.send(PathStatus, al2.EpisodeID, r.stepReq(al2.EpisodeID, 2, "x", 1, rollout.TokXfer, dst, rollout.TokEnd)); st.Outcome != Unknown {
		t.Fatalf("the first episode's seq 2 visible in the second: %+v", st)
	}
	end2 := r.terminate(al2.EpisodeID, rollout.ReasonMaxTurns)
	if !strings.Contains(end2.Artifacts, `"transfers":[]`) {
		t.Fatalf("second episode's journal %s", end2.Artifacts)
	}
	// And the first episode's records still answer for it alone.
	if late := r.send(PathStatus, al1.EpisodeID, r.stepReq(al1.EpisodeID, 2, "x", 1, rollout.TokXfer, dst, rollout.TokEnd)); late.Outcome != Executed {
		t.Fatalf("first episode's seq 2 %+v", late)
	}
}

// TestPersistFailureExecutesNothing: a transition that cannot be persisted
// is not acknowledged and leaves no trace in the world: the retry executes
// the transfer once.
func TestPersistFailureExecutesNothing(t *testing.T) {
	ctx := ctxT(t, time.Minute)
	regs := registries(t)
	svc := startService(t, Config{Registries: regs})
	fail := 1
	put := svc.srv.put
	svc.srv.put = func(key string, v any) error {
		if strings.Contains(key, "/step/") && fail > 0 {
			fail--
			return errors.New("disk full")
		}
		return put(key, v)
	}
	c := newClient(t, []string{svc.url}, Options{ToolRetries: 2, Backoff: time.Millisecond})
	reg := family(regs, rollout.FamilyLedger)
	trajs, err := rollout.Agent{Env: c, Policy: rollout.LedgerTeacher{}, Settings: rollout.DefaultSettings(reg), Limits: fixedLimits()}.Run(ctx, attempts(reg.Train()[:1], 1, 0))
	if err != nil {
		t.Fatal(err)
	}
	task, _ := reg.Lookup(trajs[0].TaskID)
	if ok, ev, err := rollout.NewValidator(reg).Validate(task, &trajs[0]); err != nil || !ok {
		t.Fatalf("%v %s %v", ok, ev, err)
	}
	if n := c.Counters().Retries[ReasonPersistFailed]; n != 1 {
		t.Fatalf("persist_failed retries %d (%s)", n, c.Counters())
	}
}

// TestRestartResumesEpisodes: a new server on the same store resumes the
// live episodes at their persisted state and sequence numbers; one whose
// registry configuration changed ends as an infrastructure failure.
func TestRestartResumesEpisodes(t *testing.T) {
	dir := t.TempDir()
	regs := registries(t)
	st := openStore(t, dir, true)
	srv, err := NewServer(Config{Registries: regs, Key: testKey, Store: st})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	r := newRaw(t, hs.URL, time.Minute, nil)
	task, att := ledgerTask(t, regs, 11)
	_, att2 := ledgerTask(t, regs, 12)
	id := r.allocate(att, "k", 60000).EpisodeID
	id2 := r.allocate(att2, "k", 60000).EpisodeID
	xfer := []int32{rollout.TokXfer, rollout.TokKey0 + task.Key, rollout.TokEnd}
	first := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, xfer...))
	if first.Outcome != Executed {
		t.Fatal(first)
	}
	hs.Close()
	srv.Close()
	st.Close()

	st = openStore(t, dir, true)
	defer st.Close()
	srv, err = NewServer(Config{Registries: regs, Key: testKey, Store: st})
	if err != nil {
		t.Fatal(err)
	}
	hs = httptest.NewServer(srv.Handler())
	r.url = hs.URL
	if srv.Live() != 2 {
		t.Fatalf("%d live episodes after the restart", srv.Live())
	}
	if again := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, xfer...)); again.Outcome != Executed || !again.Replayed ||
		!slices.Equal(again.Transition.Observation.IDs, first.Transition.Observation.IDs) {
		t.Fatalf("seq 1 after the restart %+v", again)
	}
	ans := []int32{rollout.TokAns, first.Transition.Observation.IDs[1], rollout.TokEnd}
	if st := r.send(PathStep, id, r.stepReq(id, 2, "s2", 1, ans...)); st.Outcome != Executed || !st.Transition.Terminated {
		t.Fatalf("answer after the restart %+v", st)
	}
	end := r.terminate(id, rollout.ReasonAnswer)
	var art rollout.LedgerArtifacts
	if err := json.Unmarshal([]byte(end.Artifacts), &art); err != nil || len(art.Transfers) != 1 || end.Status != StatusCompleted {
		t.Fatalf("after the restart: %+v", end)
	}
	hs.Close()
	srv.Close()

	// Another ledger configuration: the snapshot the episode was allocated
	// from is gone.
	other := slices.Clone(regs)
	cfg := family(regs, rollout.FamilyLedger).Config()
	cfg.Seed = 99
	for i, g := range other {
		if g.Family() == rollout.FamilyLedger {
			if other[i], err = rollout.NewRegistry(cfg); err != nil {
				t.Fatal(err)
			}
		}
	}
	srv, err = NewServer(Config{Registries: other, Key: testKey, Store: st})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	hs = httptest.NewServer(srv.Handler())
	defer hs.Close()
	r.url = hs.URL
	if srv.Live() != 0 {
		t.Fatalf("%d live episodes from a changed registry", srv.Live())
	}
	if end := r.terminate(id2, rollout.ReasonAborted); end.Status != StatusInfra || end.EndReason != "snapshot_changed" {
		t.Fatalf("episode of a changed registry %+v", end)
	}
}

// TestStepTimeoutThenStatus: a step past the step cap is answered unknown;
// it completes and is persisted in the background, and the client's status
// query finds it executed (nothing runs twice).
func TestStepTimeoutThenStatus(t *testing.T) {
	ctx := ctxT(t, time.Minute)
	regs := registries(t)
	svc := startService(t, Config{Registries: regs, StepTimeout: 100 * time.Millisecond})
	put := svc.srv.put
	slow := true
	svc.srv.put = func(key string, v any) error {
		if strings.Contains(key, "/step/") && slow {
			slow = false
			time.Sleep(600 * time.Millisecond) // a slow disk
		}
		return put(key, v)
	}
	c := newClient(t, []string{svc.url}, Options{ToolRetries: 3, Backoff: time.Millisecond})
	reg := family(regs, rollout.FamilyLedger)
	trajs, err := rollout.Agent{Env: c, Policy: rollout.LedgerTeacher{}, Settings: rollout.DefaultSettings(reg), Limits: fixedLimits()}.Run(ctx, attempts(reg.Train()[:1], 1, 0))
	if err != nil {
		t.Fatal(err)
	}
	cnt := c.Counters()
	if cnt.Retries[ReasonStepTimeout] < 1 || cnt.StatusExecuted < 1 {
		t.Fatalf("counters %s", cnt)
	}
	if got := value(svc.srv.met.steps.WithLabelValues(rollout.FamilyLedger)); got != 2 || !strings.Contains(trajs[0].Artifacts, `"transfers":[{"turn":0`) {
		t.Fatalf("%v actions executed; %s", got, trajs[0].Artifacts)
	}
}

// TestObservationCap: an observation over the service's cap ends the
// episode as an infrastructure failure instead of reaching the policy.
func TestObservationCap(t *testing.T) {
	ctx := ctxT(t, time.Minute)
	regs := registries(t)
	svc := startService(t, Config{Registries: regs, MaxObservationBytes: 40})
	c := newClient(t, []string{svc.url}, Options{})
	reg := family(regs, rollout.FamilyText)
	_, err := rollout.Agent{Env: c, Policy: textScript{"<tool>lookup: memo</tool>"}, Tokenizer: &faketok.Tokenizer{}, Settings: rollout.DefaultSettings(reg),
		Limits: rollout.Limits{MaxTurns: 2, MaxEpisodeTokens: 4096}}.Run(ctx, attempts(reg.Train()[:1], 1, 0))
	if !errors.Is(err, ErrInfrastructure) || !strings.Contains(err.Error(), ReasonObservation) {
		t.Fatalf("over-size observation: %v", err)
	}
	if got := value(svc.srv.met.ended.WithLabelValues(StatusInfra, ReasonObservation)); got != 1 || svc.srv.Live() != 0 {
		t.Fatalf("ended infra/observation_size %v, live %d", got, svc.srv.Live())
	}
}

// TestRenewalsFollowTheGrantedLease: a service whose --max-lease is
// shorter than the lease the client asks grants the shorter one; the
// client renews at a third of what was granted, so a live episode
// outlives many granted leases.
func TestRenewalsFollowTheGrantedLease(t *testing.T) {
	ctx := ctxT(t, time.Minute)
	regs := registries(t)
	svc := startService(t, Config{Registries: regs, MaxLease: 300 * time.Millisecond, ReapInterval: 10 * time.Millisecond})
	c := newClient(t, []string{svc.url}, Options{}) // asks 10 s
	ep, _, err := c.Reset(ctx, attempts(family(regs, rollout.FamilyLedger).Train()[3:4], 1, 0)[0])
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // 5 granted leases
	if _, err := ep.Step(ctx, 0, rollout.EnvAction{IDs: []int32{rollout.TokCall, rollout.TokKey0, rollout.TokEnd}}); err != nil {
		t.Fatalf("step after 5 granted leases: %v", err)
	}
	if _, err := ep.Close(ctx, rollout.ReasonMaxTurns); err != nil {
		t.Fatal(err)
	}
	if n := c.Counters().LeaseRenewals; n < 8 {
		t.Fatalf("%d renewals in 1.5 s of 300 ms leases", n)
	}
}

// TestAuditStore: the audit of a store counts its episodes, their ends
// and their actions, and tells an action executed twice for one turn.
func TestAuditStore(t *testing.T) {
	ctx := ctxT(t, time.Minute)
	regs := registries(t)
	st := openStore(t, t.TempDir(), false)
	defer st.Close()
	svc := startService(t, Config{Registries: regs, Store: st})
	c := newClient(t, []string{svc.url}, Options{})
	reg := family(regs, rollout.FamilyLedger)
	if _, err := (rollout.Agent{Env: c, Policy: rollout.LedgerTeacher{}, Settings: rollout.DefaultSettings(reg), Limits: fixedLimits()}).Run(ctx, attempts(reg.Train()[:5], 1, 0)); err != nil {
		t.Fatal(err)
	}
	// A controller that sends turn 1's action again as a new sequence
	// number: the service executes it (it cannot know), the audit sees it.
	r := newRaw(t, svc.url, time.Minute, nil)
	task, att := ledgerTask(t, regs, 9)
	id := r.allocate(att, "k", 10000).EpisodeID
	call := []int32{rollout.TokCall, rollout.TokKey0 + task.Key, rollout.TokEnd}
	for seq := uint64(1); seq <= 2; seq++ {
		if got := r.send(PathStep, id, r.stepReq(id, seq, fmt.Sprint("s", seq), 0, call...)); got.Outcome != Executed {
			t.Fatalf("step %d: %+v", seq, got)
		}
	}
	a, err := AuditStore(ctx, st)
	if err != nil {
		t.Fatal(err)
	}
	if a.Episodes != 6 || a.Live != 1 || a.Ended["completed/answer"] != 5 || a.Actions != 12 || a.ActionsByFamily[rollout.FamilyLedger] != 12 || a.DuplicateTurns != 1 {
		t.Fatalf("audit %+v", a)
	}
}

// TestBurstSpreadsEvenly: a burst of allocations sent at once (a group's
// episodes) spreads evenly over two services although the loads they last
// reported are as old as their last answers: b holds an episode of another
// controller, so after each burst's episodes closed a reports 0 and b 1,
// and the next burst must not all go to a.
func TestBurstSpreadsEvenly(t *testing.T) {
	ctx := ctxT(t, time.Minute)
	regs := registries(t)
	a := startService(t, Config{Registries: regs})
	b := startService(t, Config{Registries: regs})
	kv := family(regs, rollout.FamilyKV)
	other := newRaw(t, b.url, time.Minute, nil)
	if r := other.allocate(attempts(kv.Train()[200:201], 1, 0)[0], "other", 60000); r.Outcome != Executed {
		t.Fatal(r)
	}
	c := newClient(t, []string{a.url, b.url}, Options{Concurrency: 16})
	for round := 0; round < 3; round++ {
		atts := attempts(kv.Train()[16*round:16*round+16], 1, 0)
		eps := make([]rollout.Episode, len(atts))
		var wg sync.WaitGroup
		for i := range atts {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ep, _, err := c.Reset(ctx, atts[i])
				if err != nil {
					t.Error(err)
				}
				eps[i] = ep
			}()
		}
		wg.Wait()
		if la, lb := a.srv.Live(), b.srv.Live(); la+lb != 17 || la-lb > 2 || lb-la > 2 {
			t.Fatalf("round %d: live a %d, b %d (1 of another controller)", round, la, lb)
		}
		for _, ep := range eps {
			if _, err := ep.Close(ctx, rollout.ReasonAborted); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestLeaseFor: the lease a request asks for, bounded by MaxLease; asks
// past what a Duration holds get MaxLease, not a wrapped-around value.
func TestLeaseFor(t *testing.T) {
	s := &Server{cfg: Config{DefaultLease: 10 * time.Second, MaxLease: 2 * time.Minute}}
	for _, tc := range []struct {
		ms   int64
		want time.Duration
	}{
		{0, 10 * time.Second},
		{-5, 10 * time.Second},
		{1500, 1500 * time.Millisecond},
		{120_000, 2 * time.Minute},
		{120_001, 2 * time.Minute},
		{1 << 62, 2 * time.Minute},                                   // × 1e6 wraps to 0 as a Duration
		{math.MaxInt64/int64(time.Millisecond) + 7, 2 * time.Minute}, // wraps to a negative one
	} {
		if got := s.leaseFor(tc.ms); got != tc.want {
			t.Errorf("leaseFor(%d) = %v, want %v", tc.ms, got, tc.want)
		}
	}
}
