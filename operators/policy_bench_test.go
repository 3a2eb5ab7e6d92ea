package operators_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"testing"

	"github.com/trajflow/trajflow/connectors/policy/serve"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// BenchmarkServedRollout: the demo's rollout of one group (16 attempts of
// the kv task, at most 4 turns of 3 tokens, one batched request per live
// episode per turn) with the initial policy: in process, and on the
// gateway over 1 and 3 `serve` replicas of the built-in policy (SGLang
// protocol, httptest servers in this process: on a machine with few cores
// the replicas share them with the client, so more replicas add
// parallelism only where cores are free). Reports attempts and generation
// requests per second.
//
//	go test ./operators/ -run '^$' -bench ServedRollout -benchtime 20x
func BenchmarkServedRollout(b *testing.B) {
	c := contract.Default()
	if err := c.Resolve(); err != nil {
		b.Fatal(err)
	}
	d, err := operators.BuiltinDeps(c)
	if err != nil {
		b.Fatal(err)
	}
	reg := d.Tasks
	settings, limits := operators.RolloutSettings(c, reg), operators.RolloutLimits(c)
	dir := b.TempDir()
	files, err := pipeline.NewDirReleases(dir)
	if err != nil {
		b.Fatal(err)
	}
	mc, seed := operators.ModelConfig(c)
	m0, err := gpu.InitialModel(mc, seed)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := gpu.ReleaseModel(files, m0, 0, 0, gpu.ReleaseMeta{TokenizerHash: rollout.TokenizerHash}); err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	run := func(b *testing.B, pol rollout.Policy) {
		requests := 0
		for i := 0; i < b.N; i++ {
			atts := rollout.Attempts(c.RunID, reg.Train()[i%len(reg.Train())], int64(i), int32(c.Sampler.GroupSize), c.Seed, 0, c.Hash())
			trajs, err := reg.RunEpisodes(ctx, pol, atts, settings, limits)
			if err != nil {
				b.Fatal(err)
			}
			for _, tr := range trajs {
				requests += len(tr.Turns)
			}
		}
		s := b.Elapsed().Seconds()
		b.ReportMetric(float64(b.N*c.Sampler.GroupSize)/s, "attempts/s")
		b.ReportMetric(float64(requests)/s, "requests/s")
	}
	b.Run("in-process", func(b *testing.B) { run(b, model.NewPolicy(m0, 0)) })
	for _, n := range []int{1, 3} {
		sc := c.Clone()
		sc.Policy.Protocol = contract.PolicySGLang
		for range n {
			srv, err := serve.New(serve.Config{Protocol: contract.PolicySGLang, Releases: dir, Grammar: reg.Grammar()})
			if err != nil {
				b.Fatal(err)
			}
			if err := srv.Load(0); err != nil {
				b.Fatal(err)
			}
			hs := httptest.NewServer(srv)
			b.Cleanup(hs.Close)
			sc.Policy.Endpoints = append(sc.Policy.Endpoints, hs.URL)
		}
		if err := sc.Resolve(); err != nil {
			b.Fatal(err)
		}
		g, err := operators.PolicyServer(sc, rollout.VocabSize, rollout.TokenizerHash, nil)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(g.Close)
		if err := g.Prepare(ctx); err != nil {
			b.Fatal(err)
		}
		for _, e := range operators.PolicyEndpoints(sc) {
			if err := g.SetReady(e, 0); err != nil {
				b.Fatal(err)
			}
		}
		b.Run(fmt.Sprintf("gateway-%d-replicas", n), func(b *testing.B) { run(b, rollout.ServedPolicy(g, 0, false)) })
	}
}
