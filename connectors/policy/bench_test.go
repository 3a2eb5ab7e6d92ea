package policy_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/gateway"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/llamacpp"
	"github.com/trajflow/trajflow/connectors/policy/sglang"
	"github.com/trajflow/trajflow/connectors/policy/vllm"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

var generatePath = map[string]string{
	policy.LlamaCpp: "/completion?autoload=false",
	policy.SGLang:   "/generate",
	policy.VLLM:     "/inference/v1/generate",
}

func newBenchClient(b *testing.B, proto, addr string, trace func(string, string, []byte, int, []byte)) policy.Client {
	cc := policy.ClientConfig{Addr: addr, Timeout: 10 * time.Second, Concurrency: 64, Trace: trace, Want: policy.Want{Version: 1}}
	var (
		c   policy.Client
		err error
	)
	switch proto {
	case policy.LlamaCpp:
		c, err = llamacpp.New(llamacpp.Config{ClientConfig: cc, Router: true})
	case policy.SGLang:
		c, err = sglang.New(sglang.Config{ClientConfig: cc})
	case policy.VLLM:
		c, err = vllm.New(vllm.Config{ClientConfig: cc})
	}
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(c.(interface{ Close() }).Close)
	return c
}

func benchRequest(reg *rollout.Registry) model.Request {
	return model.Request{
		Context:  []int32{rollout.TokBOS, rollout.TokTask, rollout.TokKey0 + 2, rollout.TokAct},
		Settings: model.Settings{Behavior: model.Behavior{Temperature: 1, Grammar: reg.Grammar()}, MaxTokens: 3, Stop: []int32{rollout.TokEnd}},
		Seed:     42, ID: "bench",
	}
}

// BenchmarkClientOverhead: one 3-token generation per operation through
// each protocol client against its built-in server, and, in the same run,
// the same request body POSTed with plain net/http (the body read, not
// decoded): the difference is the client's own cost (encoding, decoding,
// validation, for vLLM the two weight_info reads that bracket a batch).
func BenchmarkClientOverhead(b *testing.B) {
	reg := policytest.Registry(b)
	dir := b.TempDir()
	policytest.Release(b, dir, 1, false)
	for _, proto := range []string{policy.LlamaCpp, policy.SGLang, policy.VLLM} {
		srv := policytest.Start(b, proto, dir, reg, nil, 1)
		var body []byte
		capture := func(method, path string, req []byte, status int, resp []byte) {
			if method == "POST" && body == nil {
				body = append([]byte(nil), req...)
			}
		}
		c := newBenchClient(b, proto, srv.URL, capture)
		req := []model.Request{benchRequest(reg)}
		ctx := context.Background()
		if _, err := c.Generate(ctx, req); err != nil {
			b.Fatal(err)
		}
		hc := &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
		raw := func() {
			res, err := hc.Post(srv.URL+generatePath[proto], "application/json", bytes.NewReader(body))
			if err != nil {
				b.Fatal(err)
			}
			if _, err := io.Copy(io.Discard, res.Body); err != nil || res.StatusCode != 200 {
				b.Fatal(res.Status, err)
			}
			res.Body.Close()
		}
		// Client and raw calls alternate, so that both see the same load
		// on a shared machine; each is timed on its own.
		b.Run(proto, func(b *testing.B) {
			var tc, tr time.Duration
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				if _, err := c.Generate(ctx, req); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				raw()
				tc, tr = tc+t1.Sub(t0), tr+time.Since(t1)
			}
			n := float64(b.N)
			b.ReportMetric(float64(tc.Microseconds())/n, "client-us/op")
			b.ReportMetric(float64(tr.Microseconds())/n, "raw-us/op")
			b.ReportMetric(float64((tc-tr).Microseconds())/n, "overhead-us/op")
		})
	}
}

// BenchmarkBatch32: 32 concurrent requests per operation through one
// client to one server, and through a gateway over 3 replicas.
func BenchmarkBatch32(b *testing.B) {
	reg := policytest.Registry(b)
	dir := b.TempDir()
	policytest.Release(b, dir, 1, false)
	reqs := make([]model.Request, 32)
	for i := range reqs {
		reqs[i] = benchRequest(reg)
		reqs[i].Seed = uint64(i)
		reqs[i].ID = fmt.Sprintf("r%d", i)
		reqs[i].Affinity = fmt.Sprintf("g%d", i/8)
	}
	ctx := context.Background()
	for _, proto := range []string{policy.LlamaCpp, policy.SGLang, policy.VLLM} {
		var reps []gateway.Replica
		for k := 0; k < 3; k++ {
			srv := policytest.Start(b, proto, dir, reg, nil, 1)
			reps = append(reps, gateway.Replica{Name: fmt.Sprint(k), Client: newBenchClient(b, proto, srv.URL, nil)})
		}
		one := reps[0].Client
		b.Run(proto+"/client", func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if _, err := one.Generate(ctx, reqs); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N*len(reqs)), "us/request")
		})
		g, err := gateway.New(gateway.Config{Replicas: reps, HealthInterval: -1, Want: policy.Want{Version: 1}})
		if err != nil {
			b.Fatal(err)
		}
		for _, r := range reps {
			g.SetReady(r.Name, 1)
		}
		b.Run(proto+"/gateway3", func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if _, err := g.Generate(ctx, reqs); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N*len(reqs)), "us/request")
		})
	}
}
