package bench

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/internal/testkit"
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
		{"validate=2,,reward=1", nil, true},
		{"validate=2,", nil, true},
		{"validate=2,validate=3", nil, true},
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
		rate float64
	}{
		{"unknown stage", map[string]int{"train": 2}, 0},
		{"zero instances", map[string]int{"validate": 0}, 0},
		{"two packs", map[string]int{"pack": 2}, 0},
		{"negative baseline rate", nil, -1},
		{"NaN baseline rate", nil, math.NaN()},
	}
	for _, tc := range cases {
		c := Config{Contract: nil, Instances: tc.inst, BaselineRate: tc.rate}
		if err := c.defaults(); err == nil {
			t.Errorf("%s: accepted without a contract", tc.name)
		}
	}
	c, _, _ := coreInput(t)
	for _, tc := range cases {
		cfg := Config{Contract: c, Instances: tc.inst, BaselineRate: tc.rate}
		if err := cfg.defaults(); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
	// A data directory is the embedded broker's, and a fresh one.
	used := t.TempDir()
	if err := os.WriteFile(filepath.Join(used, "meta.json"), []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, cfg := range []Config{{Contract: c, DataDir: t.TempDir(), Brokers: []string{"127.0.0.1:9092"}}, {Contract: c, DataDir: used}} {
		if err := cfg.defaults(); err == nil || !strings.Contains(err.Error(), cfg.DataDir) {
			t.Errorf("data dir %s with brokers %v: %v, want a refusal naming the directory", cfg.DataDir, cfg.Brokers, err)
		}
	}
	if cfg := (Config{Contract: c, DataDir: filepath.Join(used, "fresh")}); cfg.defaults() != nil {
		t.Errorf("a data directory that does not exist yet refused")
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

// TestLossCategories: every census reason lands in one loss of docs/SYSTEMS.md §4.
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

// TestRetentionFollowsInFlight checks the embedded broker's retention and
// memory bound against hand-computed values for the bench contract (8
// trajectories per group, 2 partitions, 521000-token batches of 32768-token
// rows): the closed loop's unread bytes must never reach the retention.
func TestRetentionFollowsInFlight(t *testing.T) {
	t.Setenv("TRAJFLOW_BENCH_RETENTION", "")
	c := testkit.LoadContract(t, "../testdata/contracts/bench.yaml")
	batch := int64(521000+32768) * 40 // batchBytesEstimate
	cases := []struct {
		inflight  int
		mean      float64
		retention int64 // per data partition
		batches   int64 // batches the batches topic keeps
	}{
		// 4 * 256 groups * 8 * 1000 tokens * 9 bytes / 2 partitions = 36,864,000 + 2 MiB (above
		// the 24 MiB floor); 256*8*1000 = 2.05 M tokens = 3.9 batches -> 2 * 4 = 8.
		{256, 1000, 36864000 + 2<<20, 8},
		// 4 * 1024 * 8 * 1000 * 9 / 2 = 147,456,000 + 2 MiB; 8.19 M tokens = 15.7 batches -> 32.
		{1024, 1000, 147456000 + 2<<20, 32},
		// short trajectories: the floor and the minimum of four batches.
		{16, 400, 24 << 20, 4},
	}
	for _, tc := range cases {
		r := &run{cfg: Config{Contract: c, InFlightGroups: tc.inflight}}
		r.cfg.Synth.MeanTokens = tc.mean
		if got := r.retentionBytes(); got != tc.retention {
			t.Errorf("inflight %d: retention %d, want %d", tc.inflight, got, tc.retention)
		}
		if got := r.batchesRetention(); got != tc.batches*batch {
			t.Errorf("inflight %d: batches retention %d (%d batches), want %d batches", tc.inflight, got, got/batch, tc.batches)
		}
		// four data topics of two partitions, the batches, 14 MiB of low-rate topics
		want := 4*2*(tc.retention+segmentBytes) + tc.batches*batch + 14<<20
		if got := r.brokerBound(tc.retention); got != want {
			t.Errorf("inflight %d: broker bound %d, want %d", tc.inflight, got, want)
		}
		if got := r.segmentSize(); got != 2<<20 {
			t.Errorf("inflight %d: segment %d bytes, want 2 MiB", tc.inflight, got)
		}
		// A log on disk keeps eight times as much of every topic, in segments
		// eight times as large.
		r.cfg.DataDir = t.TempDir()
		if got := r.retentionBytes(); got != 8*tc.retention {
			t.Errorf("inflight %d on disk: retention %d, want %d", tc.inflight, got, 8*tc.retention)
		}
		if got := r.batchesRetention(); got != 8*tc.batches*batch {
			t.Errorf("inflight %d on disk: batches retention %d, want %d", tc.inflight, got, 8*tc.batches*batch)
		}
		if got := r.segmentSize(); got != 16<<20 {
			t.Errorf("inflight %d on disk: segment %d bytes, want 16 MiB", tc.inflight, got)
		}
		if got := r.lowRateRetention()[0].bytes; got != 64<<20 {
			t.Errorf("inflight %d on disk: census retention %d, want 64 MiB", tc.inflight, got)
		}
	}
}
