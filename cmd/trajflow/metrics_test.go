package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"

	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/pipeline"
)

// The operators of a demo run report the domain metrics: the trainer's
// updates, version, loss, KL, entropy and clip fractions, one reward
// observation per scored trajectory and component, the packing
// efficiency and the lag of every admitted trajectory, the filter
// reasons, the served version; and the whole exposition passes promlint.
func TestDemoDomainMetrics(t *testing.T) {
	m := pipeline.NewMetrics(nil)
	out := t.TempDir()
	// Zero-variance groups dropped, so the filtered counter has series.
	s := testkit.Demo(t, loop.Options{Updates: 2, Seed: 1, Metrics: m, Out: out, Edit: testkit.DropZeroVariance})
	// The trainer logs every update with its statistics.
	lb, err := os.ReadFile(filepath.Join(out, "demo.log"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(lb), `msg="policy updated"`); n != s.Updates || !strings.Contains(string(lb), "approx_kl=") {
		t.Errorf("demo.log has %d policy updated lines, want %d", n, s.Updates)
	}
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	problems, err := promlint.NewWithMetricFamilies(mfs).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}
	fam := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		fam[mf.GetName()] = mf
	}
	// value sums a counter or gauge family's series whose labels include
	// want; count sums a histogram family's sample counts.
	match := func(met *dto.Metric, want map[string]string) bool {
		n := 0
		for _, l := range met.GetLabel() {
			if v, ok := want[l.GetName()]; ok && v == l.GetValue() {
				n++
			}
		}
		return n == len(want)
	}
	value := func(name string, want map[string]string) (float64, bool) {
		mf, ok := fam[name]
		if !ok {
			return 0, false
		}
		v := 0.0
		for _, met := range mf.GetMetric() {
			if match(met, want) {
				v += met.GetCounter().GetValue() + met.GetGauge().GetValue()
			}
		}
		return v, true
	}
	count := func(name string, want map[string]string) uint64 {
		var n uint64
		for _, met := range fam[name].GetMetric() {
			if match(met, want) {
				n += met.GetHistogram().GetSampleCount()
			}
		}
		return n
	}
	checks := []struct {
		name string
		want map[string]string
		ok   func(float64) bool
		what string
	}{
		{"trajflow_train_updates_total", map[string]string{"stage": "train"}, func(v float64) bool { return v == float64(s.Updates) }, "the updates"},
		{"trajflow_policy_version", map[string]string{"stage": "train", "role": "trained"}, func(v float64) bool { return v == float64(s.Updates) }, "the last version"},
		{"trajflow_policy_version", map[string]string{"stage": "rollout", "role": "served"}, func(v float64) bool { return v >= 1 }, "a served version past 0"},
		{"trajflow_train_approx_kl", map[string]string{"stage": "train"}, func(v float64) bool { return v >= 0 }, "a KL"},
		{"trajflow_train_entropy_nats", map[string]string{"stage": "train"}, func(v float64) bool { return v > 0 }, "an entropy"},
		{"trajflow_train_clip_ratio", map[string]string{"stage": "train", "sign": "positive"}, func(v float64) bool { return v >= 0 && v <= 1 }, "a fraction"},
		{"trajflow_train_loss", map[string]string{"stage": "train", "term": "total"}, func(v float64) bool { return v != 0 }, "a loss"},
		{"trajflow_train_loss", map[string]string{"stage": "train", "term": "kl"}, func(v float64) bool { return v == 0 }, "no KL term (kl_placement none)"},
		{"trajflow_pack_efficiency_ratio", map[string]string{"stage": "pack"}, func(v float64) bool { return v > 0 && v <= 1 }, "an efficiency"},
		{"trajflow_trajectories_rewarded_total", map[string]string{"stage": "reward"}, func(v float64) bool { return v == float64(s.AttemptsLaunched) }, "every launched attempt"},
		{"trajflow_trajectories_filtered_total", map[string]string{"stage": "pack"}, func(v float64) bool { return v == float64(s.TrajectoriesFiltered) }, "the filtered"},
		{"trajflow_stage_busy_seconds_total", map[string]string{"stage": "reward"}, func(v float64) bool { return v > 0 }, "time in reward's code"},
		{"trajflow_stage_busy_seconds_total", map[string]string{"stage": "train"}, func(v float64) bool { return v > 0 }, "time in the trainer's code"},
	}
	for _, c := range checks {
		v, ok := value(c.name, c.want)
		if !ok || !c.ok(v) {
			t.Errorf("%s%v = %v (present %v), want %s", c.name, c.want, v, ok, c.what)
		}
	}
	if n := count("trajflow_reward", map[string]string{"stage": "reward", "component": "total"}); n != uint64(s.AttemptsLaunched) {
		t.Errorf("trajflow_reward{component=total}: %d observations, want %d", n, s.AttemptsLaunched)
	}
	if n := count("trajflow_admitted_policy_lag_versions", map[string]string{"stage": "pack"}); n != uint64(s.TrajectoriesAdmitted) {
		t.Errorf("trajflow_admitted_policy_lag_versions: %d observations, want %d admitted", n, s.TrajectoriesAdmitted)
	}
	if n := count("trajflow_train_update_duration_seconds", map[string]string{"stage": "train"}); n != uint64(s.Updates) {
		t.Errorf("trajflow_train_update_duration_seconds: %d observations, want %d", n, s.Updates)
	}
}
