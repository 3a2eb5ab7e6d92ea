//go:build llama

package loop_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/llamatest"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// BenchmarkLlamaRollout: the text tool task's agent loop (the rollout
// stage's RunEpisodes on the policy server through the gateway, as the
// stage runs a group) on SmolLM2-135M in llama-server (-np 1, -t 2), one
// group of 2 attempts of at most 2 turns of 24 tokens per operation:
// action tokens sampled per second of wall time (a group that fails for
// a reason of the infrastructure is counted in failed-groups). Then, in
// the same run, trajflow's per-request overhead: the llama.cpp client's
// call of one short request (8 prompt ids of a rollout turn, 4 sampled)
// alternated with a raw net/http POST of the same body to the same server
// (read, not decoded).
//
//	go test -tags llama -run '^$' -bench LlamaRollout -benchtime 4x ./internal/loop/
func BenchmarkLlamaRollout(b *testing.B) {
	srv := llamatest.Start(b, llamatest.Options{Slots: 1, Ctx: 1024})
	p, err := loop.ParsePolicy("llamacpp://"+strings.TrimPrefix(srv.URL, "http://"), "")
	if err != nil {
		b.Fatal(err)
	}
	c, err := loop.Contract(loop.Options{Seed: 9, Policy: p, Tasks: loop.TasksText, StopTokenIDs: []int32{2, 0}, Edit: smallText})
	if err != nil {
		b.Fatal(err)
	}
	deps, err := operators.BuiltinDeps(c)
	if err != nil {
		b.Fatal(err)
	}
	reg, settings, limits := deps.Tasks, operators.RolloutSettings(c, deps.Tasks), operators.RolloutLimits(c)
	g, err := operators.PolicyServer(c, 49152, "", nil)
	if err != nil {
		b.Fatal(err)
	}
	defer g.Close()
	ctx := context.Background()
	if err := g.Prepare(ctx); err != nil {
		b.Fatal(err)
	}
	if err := g.SetReady(operators.PolicyEndpoints(c)[0], 0); err != nil {
		b.Fatal(err)
	}
	pol := rollout.ServedPolicy(g, 0, false)
	// One group first (untimed): the request benchmark sends its first turn.
	var last schemas.Trajectory
	for i := 0; last.RecordID == "" && i < 4; i++ {
		atts := rollout.Attempts(c.RunID, reg.Train()[100+i], 100, int32(c.Sampler.GroupSize), c.Seed, 0, c.Hash())
		if trajs, err := reg.RunEpisodes(ctx, pol, atts, settings, limits); err == nil {
			last = trajs[0]
		} else if rollout.InfraReason(err) == "" {
			b.Fatal(err)
		}
	}
	b.Run("rollout", func(b *testing.B) {
		tokens, requests, failed := 0, 0, 0
		for i := 0; i < b.N; i++ {
			atts := rollout.Attempts(c.RunID, reg.Train()[i%len(reg.Train())], int64(i), int32(c.Sampler.GroupSize), c.Seed, 0, c.Hash())
			trajs, err := reg.RunEpisodes(ctx, pol, atts, settings, limits)
			if r := rollout.InfraReason(err); r != "" {
				// An infrastructure failure (the rollout stage would run the
				// group again): counted, not timed away.
				b.Logf("group %d: %v", i, err)
				failed++
				continue
			}
			if err != nil {
				b.Fatal(err)
			}
			for _, tr := range trajs {
				for _, t := range tr.Turns {
					tokens += len(t.ActionIDs)
					requests++
				}
			}
		}
		b.ReportMetric(float64(tokens)/b.Elapsed().Seconds(), "tokens/s")
		b.ReportMetric(float64(requests)/float64(b.N), "requests/op")
		b.ReportMetric(float64(failed), "failed-groups")
	})
	if last.RecordID == "" {
		b.Fatal("no group completed")
	}
	var body []byte
	capture := func(method, path string, req []byte, status int, resp []byte) {
		if strings.HasPrefix(path, "/completion") && body == nil {
			body = append([]byte(nil), req...)
		}
	}
	cl, err := operators.PolicyClient(c, operators.PolicyEndpoints(c)[0], capture)
	if err != nil {
		b.Fatal(err)
	}
	// A short request (the prompt's first 8 ids, 4 ids sampled), so that
	// the server's share of the time stays small beside the client's.
	tid := schemas.TurnID(last.RecordID, 0)
	short := settings
	short.MaxTokens = 4
	req := []model.Request{{Context: last.Turns[0].PromptIDs[:8], Settings: short, Seed: schemas.SeedFor(c.Seed, tid, "sample"), ID: tid}}
	if _, err := cl.Generate(ctx, req); err != nil {
		b.Fatal(err)
	}
	hc := &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
	b.Run("request", func(b *testing.B) {
		var tc, tr time.Duration
		diffs := make([]time.Duration, 0, b.N)
		for i := 0; i < b.N; i++ {
			t0 := time.Now()
			if _, err := cl.Generate(ctx, req); err != nil {
				b.Fatal(err)
			}
			t1 := time.Now()
			res, err := hc.Post(srv.URL+"/completion", "application/json", bytes.NewReader(body))
			if err != nil {
				b.Fatal(err)
			}
			if _, err := io.Copy(io.Discard, res.Body); err != nil || res.StatusCode != 200 {
				b.Fatal(res.Status, err)
			}
			res.Body.Close()
			c, r := t1.Sub(t0), time.Since(t1)
			tc, tr = tc+c, tr+r
			diffs = append(diffs, c-r)
		}
		n := float64(b.N)
		slices.Sort(diffs)
		b.ReportMetric(float64(diffs[len(diffs)/2].Microseconds()), "overhead-median-us")
		b.ReportMetric(float64(len(req[0].Context)), "prompt-ids")
		b.ReportMetric(float64(tc.Microseconds())/n, "client-us/op")
		b.ReportMetric(float64(tr.Microseconds())/n, "raw-us/op")
		b.ReportMetric(float64((tc-tr).Microseconds())/n, "overhead-us/op")
	})
}
