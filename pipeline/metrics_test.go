package pipeline

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
)

// Every metric family an operator process exposes passes promlint (unit
// suffixes, _total on counters, no camelCase), no family carries a label
// named "instance" (Prometheus sets it on every scraped series), and the
// Go, process and build-info collectors are there.
func TestMetricsPassPromlint(t *testing.T) {
	m := NewMetrics(nil)
	sm := m.forStage("pack", "host-1")
	sm.in.Inc()
	sm.inBytes.Add(10)
	sm.outBytes.Add(10)
	sm.busy.Add(0.5)
	sm.out.WithLabelValues("batches").Inc()
	sm.quarantined.WithLabelValues("bad_input").Inc()
	sm.lag.WithLabelValues("scored", "0").Set(3)
	sm.inFlight.Set(1)
	sm.commitLatency.Observe(0.01)
	sm.retries.WithLabelValues("fetch").Inc()
	sm.commits.Inc()
	sm.duplicates.Inc()
	// A second registration of the process collectors is harmless.
	RegisterProcessCollectors(m.Registry)

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
	have := map[string]bool{}
	for _, mf := range mfs {
		have[mf.GetName()] = true
		for _, met := range mf.GetMetric() {
			for _, l := range met.GetLabel() {
				if l.GetName() == "instance" {
					t.Errorf("%s has a label named instance", mf.GetName())
				}
			}
		}
		if n := mf.GetName(); strings.HasPrefix(n, "trajflow_") && strings.Contains(n, "_bytes_") && !strings.HasSuffix(n, "_bytes_total") {
			t.Errorf("%s: the unit goes last (before _total)", n)
		}
	}
	for _, want := range []string{"go_goroutines", "go_build_info", "trajflow_build_info",
		"trajflow_duplicates_dropped_total", "trajflow_consumer_lag_records", "trajflow_in_bytes_total",
		"trajflow_stage_busy_seconds_total"} {
		if !have[want] {
			t.Errorf("no %s family", want)
		}
	}
}

// named is a stage of the topology's name over a run's topics.
type named struct {
	name   string
	topics []string
}

func (n named) Name() string     { return n.name }
func (n named) Topics() []string { return n.topics }
func (named) Process(context.Context, Message) (Result, error) {
	return Result{}, nil
}

// A stateful stage waits for the topics it reads back at start (its own
// outputs), not only for its inputs: pack reads back windows and batches.
func TestInputTopicsIncludeReadBack(t *testing.T) {
	tp, err := TopicsFor("r1")
	if err != nil {
		t.Fatal(err)
	}
	op, err := NewOperator(Config{Brokers: []string{"127.0.0.1:1"}, QuarantineTopic: tp.Quarantine},
		named{"pack", []string{tp.Scored}})
	if err != nil {
		t.Fatal(err)
	}
	got := op.inputTopics()
	for _, want := range []string{tp.Scored, tp.Windows, tp.Batches} {
		if !slices.Contains(got, want) {
			t.Errorf("pack waits for %v, not %s", got, want)
		}
	}
	op, err = NewOperator(Config{Brokers: []string{"127.0.0.1:1"}, QuarantineTopic: "q"}, named{"upper", []string{"in"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := op.inputTopics(); !slices.Equal(got, []string{"in"}) {
		t.Errorf("a stage outside the topology waits for %v, want [in]", got)
	}
}

// The health line an operator prints gives its address back; other lines
// give none.
func TestHealthLineRoundTrip(t *testing.T) {
	line := HealthLine("pack", "host-7", "127.0.0.1:9400")
	if addr, ok := HealthAddrOf(line + "\n"); !ok || addr != "127.0.0.1:9400" {
		t.Fatalf("HealthAddrOf(%q) = %q, %v", line, addr, ok)
	}
	for _, other := range []string{"", "operator pack (x) health on http://", "demo metrics on http://127.0.0.1:1/metrics"} {
		if addr, ok := HealthAddrOf(other); ok {
			t.Errorf("HealthAddrOf(%q) = %q", other, addr)
		}
	}
}
