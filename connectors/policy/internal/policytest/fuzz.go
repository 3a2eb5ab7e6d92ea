package policytest

import (
	"context"
	"errors"
	"math"
	"net/http"
	"regexp"
	"slices"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// FuzzGenerate fuzzes the body a protocol's server answers a generation
// with (path is the generation endpoint): whatever the body, the client
// returns either a sample that holds every invariant a trajectory needs
// (as many log-probs as ids, ids in the vocabulary, log-probs finite and
// at most 0 as float32, nothing after a stop id, a finish reason that
// agrees with the ids, the wanted version) or an InfraError that names the
// server, or — for a request the server cannot honour as sent — an error
// wrapping policy.ErrSettings. It never panics. The seeds are the real
// server's answers to a few requests, and corruptions of them.
func FuzzGenerate(f *testing.F, protocol, path string, newClient NewClient) {
	reg := Registry(f)
	dir := f.TempDir()
	Release(f, dir, 1, false)
	fault := &Fault{Prefix: path}
	srv := Start(f, protocol, dir, reg, func(h http.Handler) http.Handler { fault.Next = h; return fault }, 1)
	c := newClient(f, srv.URL, 2*time.Second, policy.Want{Version: 1})
	settings := model.Settings{Behavior: model.Behavior{Temperature: 1, Grammar: reg.Grammar()}, MaxTokens: 4,
		Stop: []int32{rollout.TokEnd}}
	req := func(seed uint64) []model.Request {
		return []model.Request{{
			Context:  []int32{rollout.TokBOS, rollout.TokTask, rollout.TokKey0, rollout.TokAct},
			Settings: settings, Seed: seed, ID: "turn-7",
		}}
	}
	ctx := context.Background()
	var seeds [][]byte
	fault.Set(FaultEdit, 0, func(b []byte) []byte { seeds = append(seeds, slices.Clone(b)); return b })
	for seed := range uint64(4) {
		if _, err := c.Generate(ctx, req(seed)); err != nil {
			f.Fatalf("the real server's answer to seed %d: %v", seed, err)
		}
	}
	if len(seeds) != 4 {
		f.Fatalf("%d answers recorded, want 4", len(seeds))
	}
	for _, b := range seeds {
		f.Add(b)
		f.Add(b[:len(b)/2])
		flipped := slices.Clone(b)
		for i := 5; i < len(flipped); i += 41 {
			flipped[i] ^= 0x0c
		}
		f.Add(flipped)
		// Numbers a byte flip rarely makes: a log-prob below float32's
		// range, and one of exactly 0.
		f.Add(negative.ReplaceAll(b, []byte("-1e300")))
		f.Add(negative.ReplaceAll(b, []byte("-0")))
	}
	f.Add([]byte(`{}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, body []byte) {
		fault.Set(FaultEdit, 0, func([]byte) []byte { return body })
		got, err := c.Generate(ctx, req(1))
		if err != nil {
			if ie, ok := policy.AsInfra(err); ok {
				if ie.Addr != srv.URL || ie.Reason == "" {
					t.Fatalf("%v: an InfraError of reason %q at %q, want one naming %s", err, ie.Reason, ie.Addr, srv.URL)
				}
				return
			}
			if errors.Is(err, policy.ErrSettings) {
				return
			}
			t.Fatalf("%v: neither an infrastructure failure nor a settings error", err)
		}
		if len(got) != 1 {
			t.Fatalf("%d samples for one request", len(got))
		}
		if msg := sampleFault(got[0], settings, rollout.VocabSize, 1); msg != "" {
			t.Fatalf("accepted %s: %s", body, msg)
		}
	})
}

// negative matches a negative decimal number in a JSON body.
var negative = regexp.MustCompile(`-[0-9]+\.[0-9]+(e-?[0-9]+)?`)

// sampleFault says what is wrong with a sample a client returned for a
// request of settings s to a policy of vocab ids at version, or "".
func sampleFault(x model.Sample, s model.Settings, vocab int, version int64) string {
	n := len(x.Tokens)
	switch {
	case n != len(x.Logprobs):
		return "ids and log-probs of different lengths"
	case n == 0 || n > s.MaxTokens:
		return "no ids, or more than max_tokens"
	case x.PolicyVersion != version:
		return "another policy version"
	}
	for i, t := range x.Tokens {
		lp := float64(x.Logprobs[i])
		switch {
		case t < 0 || int(t) >= vocab:
			return "an id outside the vocabulary"
		case math.IsNaN(lp) || math.IsInf(lp, 0) || lp > 0:
			return "a log-prob that is not finite and at most 0"
		case i < n-1 && slices.Contains(s.Stop, t):
			return "an id after a stop id"
		}
	}
	last := x.Tokens[n-1]
	switch x.Finish {
	case model.FinishStop:
		if !slices.Contains(s.Stop, last) {
			return "finish stop without a stop id last"
		}
	case model.FinishLength:
		if n != s.MaxTokens || slices.Contains(s.Stop, last) {
			return "finish length before max_tokens, or at a stop id"
		}
	default:
		return "finish reason " + x.Finish
	}
	return ""
}
