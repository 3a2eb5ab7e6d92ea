package bench

import (
	"math"
	"testing"

	"github.com/trajflow/trajflow/internal/audit"
)

func TestParseInstances(t *testing.T) {
	cases := []struct {
		in      string
		want    map[string]int
		wantErr bool
	}{
		{"", map[string]int{}, false},
		{"validate=2", map[string]int{"validate": 2}, false},
		{" validate=2, advantage=3 ", map[string]int{"validate": 2, "advantage": 3}, false},
		{"validate", nil, true},
		{"validate=x", nil, true},
	}
	for _, tc := range cases {
		got, err := ParseInstances(tc.in)
		if (err != nil) != tc.wantErr {
			t.Fatalf("%q: err %v", tc.in, err)
		}
		if len(got) != len(tc.want) {
			t.Fatalf("%q: %v, want %v", tc.in, got, tc.want)
		}
		for k, v := range tc.want {
			if got[k] != v {
				t.Fatalf("%q: %v, want %v", tc.in, got, tc.want)
			}
		}
	}
}

func TestConfigRejects(t *testing.T) {
	cases := []struct {
		name string
		inst map[string]int
	}{
		{"unknown stage", map[string]int{"train": 2}},
		{"zero instances", map[string]int{"validate": 0}},
		{"two packs", map[string]int{"pack": 2}},
	}
	for _, tc := range cases {
		c := Config{Contract: nil, Instances: tc.inst}
		if err := c.defaults(); err == nil {
			t.Errorf("%s: accepted without a contract", tc.name)
		}
	}
	c, _, _ := coreInput(t)
	for _, tc := range cases {
		cfg := Config{Contract: c, Instances: tc.inst}
		if err := cfg.defaults(); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
}

// TestHistogram: quantiles fall in the bucket of the exact quantile (5%
// wide buckets), whatever the spread of the values.
func TestHistogram(t *testing.T) {
	h := newHistogram()
	for i := 1; i <= 1000; i++ {
		h.add(float64(i)) // 1..1000 ms
	}
	cases := []struct{ q, want float64 }{{0.5, 500}, {0.9, 900}, {0.99, 990}}
	for _, tc := range cases {
		got := h.quantile(tc.q)
		if math.Abs(got-tc.want)/tc.want > 0.13 {
			t.Errorf("q%.2f = %.1f, want about %.0f", tc.q, got, tc.want)
		}
	}
	if h.quantile(1) != 1000 || h.n != 1000 {
		t.Errorf("max %v n %d", h.quantile(1), h.n)
	}
	s := h.summary()
	var sum int64
	for _, c := range s.Counts {
		sum += c
	}
	if sum != 1000 || len(s.Buckets) != len(s.Counts) {
		t.Errorf("summary counts %d over %d buckets", sum, len(s.Buckets))
	}
}

// TestLossCategories: every census reason lands in one loss of systems §4.
func TestLossCategories(t *testing.T) {
	cases := []struct {
		outcome, reason, want string
	}{
		{audit.OutcomeFiltered, "zero_variance", LossZeroVariance},
		{audit.OutcomeFiltered, "stale", LossStale},
		{audit.OutcomeFiltered, "overlong", LossOverlong},
		{audit.OutcomeFiltered, "incomplete_group", LossOther},
		{audit.OutcomeQuarantined, "infra_failure", LossInfra},
		{audit.OutcomeQuarantined, "timed_out", LossInfra},
		{audit.OutcomeQuarantined, "reward_unavailable", LossEvaluator},
		{audit.OutcomeQuarantined, "safety_incident", LossQuarantine},
		{audit.OutcomeQuarantined, "positive_logprob", LossInvalid},
	}
	for _, tc := range cases {
		if got := lossCategory(audit.Fate{Outcome: tc.outcome, Reason: tc.reason}); got != tc.want {
			t.Errorf("%s/%s -> %s, want %s", tc.outcome, tc.reason, got, tc.want)
		}
	}
}
