package policytest

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// NewClient makes a protocol client of the server at addr with timeout
// and want.
type NewClient func(t testing.TB, addr string, timeout time.Duration, want policy.Want) policy.Client

// Exact checks that clients of protocol return, over many seeded requests,
// the samples of the in-process policy bit for bit, for a plain and a
// peaked model (log-probs near 0). toServer maps a request to the one the
// protocol carries (nil: the same; llama.cpp carries a 32-bit seed).
func Exact(t *testing.T, protocol string, newClient NewClient, o RequestOptions, toServer func(model.Request) model.Request) {
	reg := Registry(t)
	dir := t.TempDir()
	for _, v := range []int64{1, 2} {
		rel := Release(t, dir, v, v == 2)
		srv := Start(t, protocol, dir, reg, nil, v)
		c := newClient(t, srv.URL, 10*time.Second, policy.Want{Version: v})
		reqs := Requests(reg, 400, uint64(v), o)
		got, err := c.Generate(context.Background(), reqs)
		if err != nil {
			t.Fatal(err)
		}
		ref := reqs
		if toServer != nil {
			ref = make([]model.Request, len(reqs))
			for i, r := range reqs {
				ref[i] = toServer(r)
			}
		}
		want, err := Load(t, rel).Generate(context.Background(), ref)
		if err != nil {
			t.Fatal(err)
		}
		near0, tokens := 0, 0
		for i := range reqs {
			if !Equal(got[i], want[i]) {
				t.Fatalf("version %d request %d: network %+v, in process %+v", v, i, got[i], want[i])
			}
			for _, lp := range want[i].Logprobs {
				tokens++
				if lp < 0 && lp > -1e-6 {
					near0++
				}
			}
		}
		if v == 2 && near0 == 0 {
			t.Fatal("the peaked model produced no log-prob within 1e-6 of 0; the test does not probe the encoding")
		}
		t.Logf("version %d: %d requests, %d tokens bit-identical (%d log-probs in (-1e-6, 0))", v, len(reqs), tokens, near0)
		id, err := c.Identity(context.Background())
		if err != nil || id.Grammar != reg.Grammar().ID() || id.TokenizerHash != rollout.TokenizerHash || id.Vocab != rollout.VocabSize || id.Protocol != protocol {
			t.Fatalf("identity %+v, %v", id, err)
		}
		a, b := reqs[0].Settings, reqs[0].Settings
		b.MaxTokens++
		if c.SamplerID(a) == c.SamplerID(b) || c.SamplerID(a) != c.SamplerID(reqs[0].Settings) {
			t.Fatal("sampler ids do not follow the settings")
		}
	}
}

// FaultCase is a protocol-specific edit of a generation's answer and the
// reason it must fail with.
type FaultCase struct {
	Name   string
	Edit   func(m map[string]any)
	Reason string
}

// Faults checks that every failure of the server or the network is an
// InfraError of the right reason naming the server: 500, slow past the
// timeout, a dropped connection, truncated JSON, a NaN literal, each
// protocol case, a wrong weight version, a server that is down; and that
// the caller's own deadline is not an infrastructure failure. path is the
// generation endpoint; nanAt is the JSON key whose first number the NaN
// case replaces.
func Faults(t *testing.T, protocol, path, nanAt string, newClient NewClient, cases []FaultCase) {
	reg := Registry(t)
	dir := t.TempDir()
	Release(t, dir, 1, false)
	fault := &Fault{Prefix: path}
	srv := Start(t, protocol, dir, reg, func(h http.Handler) http.Handler { fault.Next = h; return fault }, 1)
	req := []model.Request{{
		Context: []int32{rollout.TokBOS, rollout.TokTask, rollout.TokKey0, rollout.TokAct},
		Settings: model.Settings{Behavior: model.Behavior{Temperature: 1, Grammar: reg.Grammar()}, MaxTokens: 3,
			Stop: []int32{rollout.TokEnd}},
		Seed: 7, ID: "turn-7",
	}}
	expect := func(t *testing.T, c policy.Client, reason string) {
		t.Helper()
		_, err := c.Generate(context.Background(), req)
		ie, ok := policy.AsInfra(err)
		if !ok || ie.Reason != reason || ie.Addr != srv.URL {
			t.Fatalf("err %v, want an InfraError %s at %s", err, reason, srv.URL)
		}
	}
	generic := []struct {
		name, kind string
		delay      time.Duration
		edit       func([]byte) []byte
		reason     string
	}{
		{"500", FaultStatus, 0, nil, policy.ReasonServerError},
		{"slow past the timeout", FaultSlow, 3 * time.Second, nil, policy.ReasonTimeout},
		{"dropped connection", FaultDrop, 0, nil, policy.ReasonUnreachable},
		{"truncated JSON", FaultTruncate, 0, nil, policy.ReasonBadResponse},
		{"NaN literal", FaultEdit, 0, ReplaceFirstNumberAfter(nanAt, "NaN"), policy.ReasonNaNLogprob},
	}
	for _, g := range generic {
		t.Run(g.name, func(t *testing.T) {
			c := newClient(t, srv.URL, time.Second, policy.Want{})
			fault.Set(g.kind, g.delay, g.edit)
			defer fault.Set(FaultNone, 0, nil)
			expect(t, c, g.reason)
		})
	}
	for _, fc := range cases {
		t.Run(fc.Name, func(t *testing.T) {
			c := newClient(t, srv.URL, time.Second, policy.Want{})
			fault.Set(FaultEdit, 0, EditJSON(fc.Edit))
			defer fault.Set(FaultNone, 0, nil)
			expect(t, c, fc.Reason)
		})
	}
	t.Run("wrong weight version", func(t *testing.T) {
		expect(t, newClient(t, srv.URL, time.Second, policy.Want{Version: 2}), policy.ReasonVersionMismatch)
	})
	t.Run("server down", func(t *testing.T) {
		addr := ClosedAddr(t)
		_, err := newClient(t, addr, time.Second, policy.Want{}).Generate(context.Background(), req)
		if ie, ok := policy.AsInfra(err); !ok || ie.Reason != policy.ReasonUnreachable || ie.Addr != addr {
			t.Fatalf("err %v", err)
		}
	})
	t.Run("the caller's deadline", func(t *testing.T) {
		c := newClient(t, srv.URL, 10*time.Second, policy.Want{})
		if _, err := c.Identity(context.Background()); err != nil {
			t.Fatal(err)
		}
		fault.Set(FaultHang, 0, nil)
		defer fault.Set(FaultNone, 0, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		_, err := c.Generate(ctx, req)
		if policy.IsInfra(err) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("err %v: the caller's own deadline is not an infrastructure failure", err)
		}
	})
	t.Run("no failure", func(t *testing.T) {
		s, err := newClient(t, srv.URL, time.Second, policy.Want{Version: 1}).Generate(context.Background(), req)
		if err != nil || len(s) != 1 || s[0].PolicyVersion != 1 {
			t.Fatalf("%+v %v", s, err)
		}
	})
	t.Run("grammar mismatch", func(t *testing.T) {
		r := append([]model.Request(nil), req...)
		r[0].Settings.Grammar = nil
		_, err := newClient(t, srv.URL, time.Second, policy.Want{}).Generate(context.Background(), r)
		if !errors.Is(err, policy.ErrSettings) || policy.IsInfra(err) {
			t.Fatalf("err %v", err)
		}
	})
}

// ReplaceFirstNumberAfter rewrites the first number after the first
// occurrence of key (a quoted JSON key) with lit, raw bytes.
func ReplaceFirstNumberAfter(key, lit string) func([]byte) []byte {
	return func(b []byte) []byte {
		i := indexOf(b, []byte(`"`+key+`"`))
		if i < 0 {
			panic("policytest: no key " + key + " in " + string(b))
		}
		for ; i < len(b) && !(b[i] == '-' || (b[i] >= '0' && b[i] <= '9')); i++ {
		}
		j := i
		for ; j < len(b) && (b[j] == '-' || b[j] == '+' || b[j] == '.' || b[j] == 'e' || b[j] == 'E' || (b[j] >= '0' && b[j] <= '9')); j++ {
		}
		return append(append(append([]byte{}, b[:i]...), lit...), b[j:]...)
	}
}

func indexOf(b, sub []byte) int {
	for i := 0; i+len(sub) <= len(b); i++ {
		if string(b[i:i+len(sub)]) == string(sub) {
			return i
		}
	}
	return -1
}

// F is a FaultCase.
func F(name string, edit func(m map[string]any), reason string) FaultCase {
	return FaultCase{Name: name, Edit: edit, Reason: reason}
}
