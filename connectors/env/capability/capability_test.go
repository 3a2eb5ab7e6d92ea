package capability

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// world is an issuer and a guard sharing a run key, with an executor that
// counts side effects per (episode, seq).
type world struct {
	clk     *clock
	issuer  *Issuer
	guard   *Guard
	mu      sync.Mutex
	effects map[string]int
	fail    map[uint64]bool
}

func newWorld(t *testing.T) *world {
	t.Helper()
	key, err := NewKey()
	if err != nil {
		t.Fatal(err)
	}
	w := &world{clk: &clock{t: time.Unix(1_700_000_000, 0)}, effects: map[string]int{}, fail: map[uint64]bool{}}
	if w.issuer, err = NewIssuer(key, "run-1", 30*time.Second, w.clk.now); err != nil {
		t.Fatal(err)
	}
	w.guard, err = NewGuard(key, "run-1", w.clk.now, func(_ context.Context, ep string, seq uint64, action []byte) ([]byte, error) {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.effects[fmt.Sprintf("%s/%d", ep, seq)]++
		if w.fail[seq] {
			return nil, errors.New("tool exited 1")
		}
		return append([]byte("ok:"), action...), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func (w *world) effect(ep string, seq uint64) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.effects[fmt.Sprintf("%s/%d", ep, seq)]
}

func TestGuardRefusals(t *testing.T) {
	ctx := context.Background()
	otherKey, _ := NewKey()
	forger, _ := NewIssuer(otherKey, "run-1", time.Minute, nil)
	otherRun := func(w *world) *Issuer {
		k := w.guard.key
		i, _ := NewIssuer(k, "run-2", time.Minute, w.clk.now)
		return i
	}
	tests := []struct {
		name string
		// prepare runs earlier actions; then the action under test is
		// sent with the token tok() for (episode "e", seq, action).
		prepare func(w *world)
		seq     uint64
		action  string
		tok     func(w *world) string
		want    error
	}{
		{name: "valid first action", seq: 1, action: "ls", tok: func(w *world) string { return w.issuer.Issue("e", 1, []byte("ls")) }},
		{name: "forged: signed with another key", seq: 1, action: "ls", want: ErrForged,
			tok: func(*world) string { return forger.Issue("e", 1, []byte("ls")) }},
		{name: "forged: payload altered", seq: 1, action: "ls", want: ErrForged,
			tok: func(w *world) string {
				tok := w.issuer.Issue("e", 1, []byte("ls"))
				p, m, _ := strings.Cut(tok, ".")
				raw, _ := b64.DecodeString(p)
				raw[len(raw)-1] ^= 1 // push the expiry
				return b64.EncodeToString(raw) + "." + m
			}},
		{name: "forged: signature truncated", seq: 1, action: "ls", want: ErrForged,
			tok: func(w *world) string { tok := w.issuer.Issue("e", 1, []byte("ls")); return tok[:len(tok)-4] }},
		{name: "malformed: no signature", seq: 1, action: "ls", want: ErrMalformed, tok: func(*world) string { return "abc" }},
		{name: "malformed: not base64", seq: 1, action: "ls", want: ErrMalformed, tok: func(*world) string { return "!!.??" }},
		{name: "expired", seq: 1, action: "ls", want: ErrExpired,
			tok: func(w *world) string {
				tok := w.issuer.Issue("e", 1, []byte("ls"))
				w.clk.add(31 * time.Second)
				return tok
			}},
		{name: "expires exactly at ttl", seq: 1, action: "ls", want: ErrExpired,
			tok: func(w *world) string {
				tok := w.issuer.Issue("e", 1, []byte("ls"))
				w.clk.add(30 * time.Second)
				return tok
			}},
		{name: "scope: other episode", seq: 1, action: "ls", want: ErrScope,
			tok: func(w *world) string { return w.issuer.Issue("f", 1, []byte("ls")) }},
		{name: "scope: other sequence number", seq: 1, action: "ls", want: ErrScope,
			tok: func(w *world) string { return w.issuer.Issue("e", 2, []byte("ls")) }},
		{name: "scope: other action", seq: 1, action: "rm -rf /", want: ErrScope,
			tok: func(w *world) string { return w.issuer.Issue("e", 1, []byte("ls")) }},
		{name: "scope: other run", seq: 1, action: "ls", want: ErrScope,
			tok: func(w *world) string { return otherRun(w).Issue("e", 1, []byte("ls")) }},
		{name: "replayed: same token twice", seq: 1, action: "ls", want: ErrReplayed,
			prepare: func(w *world) {
				if _, err := w.guard.Execute(ctx, w.issuer.Issue("e", 1, []byte("ls")), "e", 1, []byte("ls")); err != nil {
					t.Fatal(err)
				}
			},
			tok: func(w *world) string { return w.issuer.Issue("e", 1, []byte("ls")) }},
		{name: "out of order: seq 2 first", seq: 2, action: "ls", want: ErrOutOfOrder,
			tok: func(w *world) string { return w.issuer.Issue("e", 2, []byte("ls")) }},
		{name: "in order: seq 2 after 1", seq: 2, action: "cat", tok: func(w *world) string { return w.issuer.Issue("e", 2, []byte("cat")) },
			prepare: func(w *world) {
				if _, err := w.guard.Execute(ctx, w.issuer.Issue("e", 1, []byte("ls")), "e", 1, []byte("ls")); err != nil {
					t.Fatal(err)
				}
			}},
		{name: "closed episode", seq: 1, action: "ls", want: ErrClosed,
			prepare: func(w *world) { w.guard.Close("e") },
			tok:     func(w *world) string { return w.issuer.Issue("e", 1, []byte("ls")) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			if tc.prepare != nil {
				tc.prepare(w)
			}
			before := w.effect("e", tc.seq)
			tok := tc.tok(w)
			res, err := w.guard.Execute(ctx, tok, "e", tc.seq, []byte(tc.action))
			if tc.want == nil {
				if err != nil || !bytes.Equal(res, []byte("ok:"+tc.action)) {
					t.Fatalf("Execute = %q, %v; want ok", res, err)
				}
				if got := w.effect("e", tc.seq); got != before+1 {
					t.Fatalf("executed %d times, want %d", got, before+1)
				}
				return
			}
			if !errors.Is(err, tc.want) || !errors.Is(err, ErrRefused) {
				t.Fatalf("Execute error %v, want %v (a refusal)", err, tc.want)
			}
			if got := w.effect("e", tc.seq); got != before {
				t.Fatalf("a refused action executed (%d -> %d)", before, got)
			}
		})
	}
}

func TestTokenCarriesNoKey(t *testing.T) {
	w := newWorld(t)
	tok := w.issuer.Issue("e", 1, []byte("ls"))
	p, _, _ := strings.Cut(tok, ".")
	raw, _ := b64.DecodeString(p)
	if bytes.Contains(raw, w.guard.key) || strings.Contains(tok, b64.EncodeToString(w.guard.key)) {
		t.Fatal("token contains the run key")
	}
	c, err := parsePayload(raw)
	if err != nil || c.Episode != "e" || c.Seq != 1 || c.Run != "run-1" {
		t.Fatalf("claims %+v, %v", c, err)
	}
}

func TestKeyChecks(t *testing.T) {
	if _, err := NewIssuer(make([]byte, 16), "r", time.Second, nil); !errors.Is(err, ErrKey) {
		t.Fatalf("short key: %v", err)
	}
	if _, err := NewGuard(make([]byte, 16), "r", nil, func(context.Context, string, uint64, []byte) ([]byte, error) { return nil, nil }); !errors.Is(err, ErrKey) {
		t.Fatalf("short key: %v", err)
	}
	a, _ := NewKey()
	b, _ := NewKey()
	if bytes.Equal(a, b) {
		t.Fatal("two run keys are equal")
	}
}

// lossy wraps the guard as a remote environment whose channel loses
// requests or responses.
type lossy struct {
	g *Guard
	// dropRequest / dropResponse lose the next n requests / responses of
	// Execute (with a timeout error); slowStatus answers "running" for the
	// next n status queries by racing the execution.
	dropRequest, dropResponse, statusFail atomic.Int32
	executes, statuses                    atomic.Int32
}

var errTimeout = errors.New("i/o timeout")

func (l *lossy) Execute(ctx context.Context, tok, ep string, seq uint64, action []byte) ([]byte, error) {
	l.executes.Add(1)
	if l.dropRequest.Add(-1) >= 0 {
		return nil, errTimeout
	}
	res, err := l.g.Execute(ctx, tok, ep, seq, action)
	if l.dropResponse.Add(-1) >= 0 {
		return nil, errTimeout
	}
	return res, err
}

func (l *lossy) Status(ctx context.Context, tok, ep string, seq uint64, action []byte) (Outcome, error) {
	l.statuses.Add(1)
	if l.statusFail.Add(-1) >= 0 {
		return Outcome{}, errTimeout
	}
	return l.g.Status(ctx, tok, ep, seq, action)
}

func TestClientAmbiguousTimeout(t *testing.T) {
	tests := []struct {
		name                        string
		dropReq, dropResp, statFail int32
		failAction                  bool
		wantEffects                 int
		wantErr                     error
		wantExecutes                int32
	}{
		{name: "no loss", wantEffects: 1, wantExecutes: 1},
		{name: "response lost after execution: status says done, not re-executed", dropResp: 1, wantEffects: 1, wantExecutes: 1},
		{name: "request lost: status unknown, executed once on retry", dropReq: 1, wantEffects: 1, wantExecutes: 2},
		{name: "response lost and first status query lost", dropResp: 1, statFail: 1, wantEffects: 1, wantExecutes: 1},
		{name: "action failed, response lost: failure reported, not re-executed", dropResp: 1, failAction: true,
			wantEffects: 1, wantExecutes: 1, wantErr: &ActionError{}},
		{name: "channel down: ambiguous after every attempt", dropReq: 100, wantEffects: 0, wantExecutes: 3, wantErr: ErrAmbiguous},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			w.fail[1] = tc.failAction
			env := &lossy{g: w.guard}
			env.dropRequest.Store(tc.dropReq)
			env.dropResponse.Store(tc.dropResp)
			env.statusFail.Store(tc.statFail)
			c := &Client{Issuer: w.issuer, Env: env, Attempts: 3, Backoff: time.Millisecond}
			res, err := c.Do(context.Background(), "e", 1, []byte("send-email"))
			switch want := tc.wantErr.(type) {
			case nil:
				if err != nil || string(res) != "ok:send-email" {
					t.Fatalf("Do = %q, %v", res, err)
				}
			case *ActionError:
				var ae *ActionError
				if !errors.As(err, &ae) || !strings.Contains(ae.Msg, "tool exited 1") {
					t.Fatalf("Do error %v, want the action's failure", err)
				}
			default:
				if !errors.Is(err, want) {
					t.Fatalf("Do error %v, want %v", err, want)
				}
			}
			if got := w.effect("e", 1); got != tc.wantEffects {
				t.Fatalf("side effects %d, want %d", got, tc.wantEffects)
			}
			if got := env.executes.Load(); got != tc.wantExecutes {
				t.Fatalf("execute requests %d, want %d", got, tc.wantExecutes)
			}
			if (tc.dropResp > 0 || tc.dropReq > 0) && env.statuses.Load() == 0 {
				t.Fatal("retried without querying the action's status")
			}
		})
	}
}

// TestClientWaitsWhileRunning: a status query during a slow execution says
// "running"; the client waits instead of executing again.
func TestClientWaitsWhileRunning(t *testing.T) {
	key, _ := NewKey()
	iss, _ := NewIssuer(key, "r", time.Minute, nil)
	release := make(chan struct{})
	var effects atomic.Int32
	g, _ := NewGuard(key, "r", nil, func(context.Context, string, uint64, []byte) ([]byte, error) {
		effects.Add(1)
		<-release
		return []byte("done"), nil
	})
	env := &timeoutEnv{g: g, started: make(chan struct{})}
	c := &Client{Issuer: iss, Env: env, Attempts: 50, Backoff: time.Millisecond}
	go func() {
		<-env.started
		time.Sleep(20 * time.Millisecond)
		close(release)
	}()
	res, err := c.Do(context.Background(), "e", 1, []byte("pay"))
	if err != nil || string(res) != "done" {
		t.Fatalf("Do = %q, %v", res, err)
	}
	if effects.Load() != 1 {
		t.Fatalf("executed %d times", effects.Load())
	}
	if env.running.Load() == 0 {
		t.Fatal("no status query saw the action running")
	}
}

// timeoutEnv gives up on Execute immediately (the action keeps running in
// the environment) — the ambiguous timeout of docs/SYSTEMS.md §12.
type timeoutEnv struct {
	g       *Guard
	started chan struct{}
	once    sync.Once
	running atomic.Int32
}

func (e *timeoutEnv) Execute(ctx context.Context, tok, ep string, seq uint64, action []byte) ([]byte, error) {
	go func() { _, _ = e.g.Execute(context.Background(), tok, ep, seq, action) }()
	time.Sleep(5 * time.Millisecond)
	e.once.Do(func() { close(e.started) })
	return nil, errTimeout
}

func (e *timeoutEnv) Status(ctx context.Context, tok, ep string, seq uint64, action []byte) (Outcome, error) {
	o, err := e.g.Status(ctx, tok, ep, seq, action)
	if o.Status == StatusRunning {
		e.running.Add(1)
	}
	return o, err
}

func TestStatusNeedsScopedToken(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	if _, err := w.guard.Execute(ctx, w.issuer.Issue("e", 1, []byte("a")), "e", 1, []byte("a")); err != nil {
		t.Fatal(err)
	}
	if _, err := w.guard.Status(ctx, w.issuer.Issue("other", 1, []byte("a")), "e", 1, []byte("a")); !errors.Is(err, ErrScope) {
		t.Fatalf("status with another episode's token: %v", err)
	}
	o, err := w.guard.Status(ctx, w.issuer.Issue("e", 1, []byte("a")), "e", 1, []byte("a"))
	if err != nil || o.Status != StatusDone || string(o.Result) != "ok:a" {
		t.Fatalf("status %+v, %v", o, err)
	}
	o, err = w.guard.Status(ctx, w.issuer.Issue("e", 2, []byte("b")), "e", 2, []byte("b"))
	if err != nil || o.Status != StatusUnknown {
		t.Fatalf("status of an unsent action %+v, %v", o, err)
	}
}

// FuzzVerify: arbitrary tokens never panic and are never accepted unless
// they verify.
func FuzzVerify(f *testing.F) {
	key := bytes.Repeat([]byte{7}, KeySize)
	iss, _ := NewIssuer(key, "r", time.Hour, nil)
	f.Add(iss.Issue("e", 1, []byte("x")))
	f.Add("")
	f.Add(".")
	f.Add("AQ.AA")
	f.Fuzz(func(t *testing.T, tok string) {
		c, err := verify(key, tok, time.Now())
		if err == nil {
			p, m, _ := strings.Cut(tok, ".")
			raw, _ := b64.DecodeString(p)
			sig, _ := b64.DecodeString(m)
			if !bytes.Equal(sig, mac(key, raw)) || c.Run != "r" {
				t.Fatalf("accepted a token that does not verify: %q", tok)
			}
		}
	})
}

func BenchmarkIssueVerify(b *testing.B) {
	key, _ := NewKey()
	iss, _ := NewIssuer(key, "run", time.Minute, nil)
	action := bytes.Repeat([]byte("a"), 256)
	b.ReportAllocs()
	for b.Loop() {
		tok := iss.Issue("episode-123", 42, action)
		if _, err := verify(key, tok, time.Now()); err != nil {
			b.Fatal(err)
		}
	}
}
