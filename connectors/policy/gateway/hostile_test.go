package gateway_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/gateway"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/sglang"
)

// retries is trajflow_policy_retries_total{replica}.
func retries(t *testing.T, g *gateway.Gateway, replica string) float64 {
	t.Helper()
	mfs, err := g.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "trajflow_policy_retries_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, p := range m.GetLabel() {
				if p.GetName() == "replica" && p.GetValue() == replica {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestHostileReplica: with one replica misbehaving in each way of
// policytest.HostileCases (and with NaN log-probs and ids outside the
// vocabulary), every request of a batch is served exactly by the other
// replica; the hostile one's failures are counted by reason, retried
// (trajflow_policy_retries_total) and held against its breaker, and its
// redirect target is never asked.
func TestHostileReplica(t *testing.T) {
	f := newFixture(t, 3)
	bad, good, target := f.reps[0], f.reps[1], f.reps[2]
	cases := policytest.HostileCases(target.srv.URL)
	cases = append(cases,
		policytest.HostileCase{Name: "NaN log-prob", Reason: policy.ReasonNaNLogprob, Timeout: time.Second,
			Serve: func(w http.ResponseWriter, r *http.Request, next http.Handler) {
				fault := &policytest.Fault{Next: next}
				fault.Set(policytest.FaultEdit, 0, policytest.ReplaceFirstNumberAfter("output_token_logprobs", "NaN"))
				fault.ServeHTTP(w, r)
			}},
		policytest.HostileCase{Name: "id outside the vocabulary", Reason: policy.ReasonTokenRange, Timeout: time.Second,
			Serve: func(w http.ResponseWriter, r *http.Request, next http.Handler) {
				fault := &policytest.Fault{Next: next}
				fault.Set(policytest.FaultEdit, 0, policytest.EditJSON(func(m map[string]any) {
					m["output_ids"].([]any)[0] = 1 << 20
					m["meta_info"].(map[string]any)["output_token_logprobs"].([]any)[0].([]any)[1] = 1 << 20
				}))
				fault.ServeHTTP(w, r)
			}},
	)
	for _, hc := range cases {
		t.Run(hc.Name, func(t *testing.T) {
			cfg := gateway.Config{HealthInterval: -1, BreakerFailures: 100, BreakerCooldown: time.Hour}
			for _, r := range []*rep{bad, good} {
				c, err := sglang.New(sglang.Config{ClientConfig: policy.ClientConfig{Addr: r.srv.URL, Timeout: hc.Timeout}})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(c.Close)
				cfg.Replicas = append(cfg.Replicas, gateway.Replica{Name: r.name, Client: c})
			}
			g, err := gateway.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(g.Close)
			bad.fault.SetFunc(hc.Serve)
			defer bad.fault.Set(policytest.FaultNone, 0, nil)
			before := target.calls.Load()
			reqs := policytest.Requests(f.reg, 6, 3, policytest.RequestOptions{})
			for i := range reqs {
				reqs[i].Affinity = "" // least outstanding: both replicas get some
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*hc.Timeout+20*time.Second)
			defer cancel()
			got, err := g.Generate(ctx, reqs)
			if err != nil {
				t.Fatal(err)
			}
			f.check(t, reqs, got, 1)
			n := requests(t, g, bad.name, hc.Reason)
			if n == 0 || retries(t, g, bad.name) != n || requests(t, g, good.name, "ok") != float64(len(reqs)) {
				t.Fatalf("%s: %v failures, %v retries on the hostile replica, %v served by the other; states %+v",
					hc.Reason, n, retries(t, g, bad.name), requests(t, g, good.name, "ok"), g.States())
			}
			if s := g.States()[0]; s.Failures != int(n) {
				t.Fatalf("the hostile replica's breaker counted %d failures of %v", s.Failures, n)
			}
			if target.calls.Load() != before {
				t.Fatal("the redirect was followed")
			}
		})
	}
}
