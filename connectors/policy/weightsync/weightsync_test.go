package weightsync_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/llamacpp"
	"github.com/trajflow/trajflow/connectors/policy/serve"
	"github.com/trajflow/trajflow/connectors/policy/sglang"
	"github.com/trajflow/trajflow/connectors/policy/vllm"
	"github.com/trajflow/trajflow/connectors/policy/weightsync"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

func client(t *testing.T, protocol, addr string, want policy.Want) policy.Client {
	t.Helper()
	cc := policy.ClientConfig{Addr: addr, Timeout: time.Minute, Want: want}
	var (
		c   policy.Client
		err error
	)
	switch protocol {
	case policy.LlamaCpp:
		c, err = llamacpp.New(llamacpp.Config{ClientConfig: cc, Router: true})
	case policy.SGLang:
		c, err = sglang.New(sglang.Config{ClientConfig: cc})
	case policy.VLLM:
		c, err = vllm.New(vllm.Config{ClientConfig: cc})
	}
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// longRequest takes the built-in policy a while: an unbounded action
// stream (no stop ids) of many tokens.
func longRequest(reg *rollout.Registry, n int) model.Request {
	return model.Request{
		Context:  []int32{rollout.TokBOS, rollout.TokTask, rollout.TokKey0, rollout.TokAct},
		Settings: model.Settings{Behavior: model.Behavior{Temperature: 1, Grammar: reg.Grammar()}, MaxTokens: n},
		Seed:     99, ID: "long",
	}
}

// TestLoadAndSwitch, for each protocol: load release 1 into an empty
// server and verify it is served (samples equal the in-process release's);
// then load release 2 while a long request runs on 1: the request
// finishes on version 1, later ones get 2.
func TestLoadAndSwitch(t *testing.T) {
	for _, proto := range []string{policy.LlamaCpp, policy.SGLang, policy.VLLM} {
		t.Run(proto, func(t *testing.T) {
			reg := policytest.Registry(t)
			dir := t.TempDir()
			rels := map[int64]schemas.PolicyRelease{}
			pols := map[int64]*model.Policy{}
			for _, v := range []int64{1, 2, 3} {
				rels[v] = policytest.Release(t, dir, v, false)
				pols[v] = policytest.Load(t, rels[v])
			}
			// Nothing loaded; no end-of-generation id, so that the long
			// request below runs to its length.
			srv := policytest.StartWith(t, serve.Config{Protocol: proto, Releases: dir, Grammar: reg.Grammar(), EOG: []int32{}}, nil)
			rep := weightsync.Replica{Protocol: proto, Addr: srv.URL}
			ctx := context.Background()
			ack, err := weightsync.Load(ctx, rep, rels[1])
			if err != nil {
				t.Fatal(err)
			}
			if ack.Version != 1 || ack.Checksum != rels[1].CheckpointHash || ack.Protocol != proto || ack.Addr != srv.URL {
				t.Fatalf("ack %+v", ack)
			}
			reqs := policytest.Requests(reg, 30, 1, policytest.RequestOptions{})
			if proto == policy.LlamaCpp {
				for i := range reqs {
					reqs[i].Seed = uint64(llamacpp.Seed32(reqs[i].Seed))
				}
			}
			check := func(v int64) {
				t.Helper()
				got, err := client(t, proto, srv.URL, policy.Want{Version: v}).Generate(ctx, reqs)
				if err != nil {
					t.Fatal(err)
				}
				want, _ := pols[v].Generate(ctx, reqs)
				for i := range reqs {
					if !policytest.Equal(got[i], want[i]) {
						t.Fatalf("version %d request %d: served %+v, release %+v", v, i, got[i], want[i])
					}
				}
			}
			check(1)

			// A long request on version 1 while version 2 is loaded.
			long := longRequest(reg, 30000)
			type result struct {
				s   []model.Sample
				err error
			}
			res := make(chan result, 1)
			go func() {
				if proto != policy.VLLM {
					s, err := client(t, proto, srv.URL, policy.Want{Version: 1}).Generate(ctx, []model.Request{long})
					res <- result{s, err}
					return
				}
				// vLLM answers carry no version: read the raw answer.
				body, _ := json.Marshal(map[string]any{"request_id": long.ID, "token_ids": long.Context, "sampling_params": map[string]any{
					"max_tokens": long.Settings.MaxTokens, "temperature": 1, "seed": long.Seed, "logprobs": 0}})
				code, out, err := policytest.Post(ctx, srv.URL+"/inference/v1/generate", string(body))
				var resp struct {
					Choices []struct {
						TokenIDs []int32 `json:"token_ids"`
						Logprobs struct {
							Content []struct {
								Logprob float64 `json:"logprob"`
							} `json:"content"`
						} `json:"logprobs"`
						FinishReason string `json:"finish_reason"`
					} `json:"choices"`
				}
				if err == nil && code != 200 {
					err = errors.New(out)
				}
				if err == nil {
					err = json.Unmarshal([]byte(out), &resp)
				}
				var smp model.Sample
				if err == nil && len(resp.Choices) == 1 {
					ch := resp.Choices[0]
					smp = model.Sample{Tokens: ch.TokenIDs, Finish: ch.FinishReason, PolicyVersion: 1}
					for _, c := range ch.Logprobs.Content {
						smp.Logprobs = append(smp.Logprobs, float32(c.Logprob))
					}
				}
				res <- result{[]model.Sample{smp}, err}
			}()
			for deadline := time.Now().Add(time.Minute); srv.InFlight() == 0; {
				if time.Now().After(deadline) {
					t.Fatal("the long request never reached the server")
				}
				time.Sleep(time.Millisecond)
			}
			ack, err = weightsync.Load(ctx, rep, rels[2])
			stillRunning := srv.InFlight() > 0
			if err != nil || ack.Version != 2 || ack.Checksum != rels[2].CheckpointHash {
				t.Fatalf("second load: %+v %v", ack, err)
			}
			r := <-res
			want, _ := pols[1].Generate(ctx, []model.Request{long})
			if r.err != nil || !policytest.Equal(r.s[0], want[0]) {
				t.Fatalf("request in flight during the switch: %v (%d tokens, version %d): not version 1's sample", r.err, len(r.s[0].Tokens), r.s[0].PolicyVersion)
			}
			// SGLang and llama.cpp switch while the request runs; vLLM's
			// pause (mode wait) lets it finish first.
			if proto != policy.VLLM && !stillRunning {
				t.Fatalf("the long request (%d tokens) ended before the switch: make it longer", long.Settings.MaxTokens)
			}
			if proto == policy.VLLM && stillRunning {
				t.Fatal("the vLLM load returned while a request was still running (pause mode wait)")
			}
			check(2)

			if proto == policy.LlamaCpp {
				ack, err = weightsync.Load(ctx, rep, rels[3])
				if err != nil || !slices.Equal(ack.Unloaded, []int64{1}) {
					t.Fatalf("third load: %+v %v (version 1 should go, 2 stay for its requests)", ack, err)
				}
				if vs := srv.Versions(); !slices.Equal(vs, []int64{2, 3}) {
					t.Fatalf("loaded %v", vs)
				}
				check(3)
			}
		})
	}
}

// TestLoadFailures: a tampered checkpoint is refused and the served
// version stays; a vLLM replica is resumed after a failed update; a
// server that is down is an InfraError.
func TestLoadFailures(t *testing.T) {
	for _, proto := range []string{policy.LlamaCpp, policy.SGLang, policy.VLLM} {
		t.Run(proto, func(t *testing.T) {
			reg := policytest.Registry(t)
			dir := t.TempDir()
			r1 := policytest.Release(t, dir, 1, false)
			r2 := policytest.Release(t, dir, 2, false)
			path := strings.TrimPrefix(r2.CheckpointURI, "file://")
			b, _ := os.ReadFile(path)
			b[len(b)-1] ^= 1
			if err := os.WriteFile(path, b, 0o644); err != nil {
				t.Fatal(err)
			}
			srv := policytest.Start(t, proto, dir, reg, nil)
			rep := weightsync.Replica{Protocol: proto, Addr: srv.URL}
			ctx := context.Background()
			if _, err := weightsync.Load(ctx, rep, r1); err != nil {
				t.Fatal(err)
			}
			_, err := weightsync.Load(ctx, rep, r2)
			if ie, ok := policy.AsInfra(err); !ok || ie.Reason != policy.ReasonRejected || !strings.Contains(err.Error(), "hash") {
				t.Fatalf("tampered checkpoint: %v", err)
			}
			if vs := srv.Versions(); !slices.Equal(vs, []int64{1}) {
				t.Fatalf("after a refused load the server serves %v", vs)
			}
			if proto == policy.VLLM {
				code, body, err := policytest.Get(ctx, srv.URL+"/is_paused")
				if err != nil || code != 200 || !strings.Contains(body, "false") {
					t.Fatalf("after a failed update: %d %s %v", code, body, err)
				}
			}
			// The release says something the replica does not serve.
			wrong := r1
			wrong.CheckpointHash = "sha256:" + strings.Repeat("0", 64)
			if _, err := weightsync.Load(ctx, rep, wrong); !errors.Is(err, weightsync.ErrVerify) {
				t.Fatalf("checkpoint hash mismatch: %v", err)
			}
			down := weightsync.Replica{Protocol: proto, Addr: policytest.ClosedAddr(t), Timeout: time.Second}
			if _, err := weightsync.Load(ctx, down, r1); !policy.IsInfra(err) {
				t.Fatalf("server down: %v", err)
			}
		})
	}
}

// TestLoadInitial, for each protocol: release 0 — the initial policy, the
// first release a trainer publishes — loads and is served as version 0,
// and a request that wants exactly version 0 gets its samples; one that
// wants version 1 is a version mismatch.
func TestLoadInitial(t *testing.T) {
	for _, proto := range []string{policy.LlamaCpp, policy.SGLang, policy.VLLM} {
		t.Run(proto, func(t *testing.T) {
			reg := policytest.Registry(t)
			dir := t.TempDir()
			rel := policytest.Release(t, dir, 0, false)
			srv := policytest.Start(t, proto, dir, reg, nil)
			ctx := context.Background()
			ack, err := weightsync.Load(ctx, weightsync.Replica{Protocol: proto, Addr: srv.URL}, rel)
			if err != nil || ack.Version != 0 || ack.Checksum != rel.CheckpointHash {
				t.Fatalf("load release 0: %+v %v", ack, err)
			}
			reqs := policytest.Requests(reg, 10, 3, policytest.RequestOptions{StopEnd: proto == policy.LlamaCpp})
			got, err := client(t, proto, srv.URL, policy.Exactly(0)).Generate(ctx, reqs)
			if err != nil {
				t.Fatal(err)
			}
			want, _ := policytest.Load(t, rel).Generate(ctx, reqs)
			for i := range reqs {
				if !policytest.Equal(got[i], want[i]) || got[i].PolicyVersion != 0 {
					t.Fatalf("request %d: served %+v, release 0 %+v", i, got[i], want[i])
				}
			}
			_, err = client(t, proto, srv.URL, policy.Exactly(1)).Generate(ctx, reqs[:1])
			if ie, ok := policy.AsInfra(err); !ok || (ie.Reason != policy.ReasonVersionMismatch && ie.Reason != policy.ReasonRejected) {
				t.Fatalf("wanting version 1 of a server at 0: %v", err)
			}
		})
	}
}
