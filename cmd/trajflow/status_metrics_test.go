package main

import (
	"strings"
	"testing"
)

// twoStages is an operator process's /metrics page with two stages (the
// labels status sums over), in Prometheus's text format.
const twoStages = `# HELP trajflow_records_in_total Records consumed.
# TYPE trajflow_records_in_total counter
trajflow_records_in_total{replica="h-1",stage="validate"} 120
trajflow_records_in_total{replica="h-1",stage="reward"} 80
# TYPE trajflow_records_out_total counter
trajflow_records_out_total{replica="h-1",stage="validate",topic="valid"} 110
trajflow_records_out_total{replica="h-1",stage="validate",topic="quarantine"} 10
trajflow_records_out_total{replica="h-1",stage="reward",topic="rewarded"} 79
# TYPE trajflow_in_flight_records gauge
trajflow_in_flight_records{replica="h-1",stage="validate"} 3
trajflow_in_flight_records{replica="h-1",stage="reward"} 1
# TYPE trajflow_consumer_lag_records gauge
trajflow_consumer_lag_records{partition="0",replica="h-1",stage="validate",topic="trajectories"} 7
trajflow_consumer_lag_records{partition="1",replica="h-1",stage="validate",topic="trajectories"} 5
# TYPE trajflow_stage_busy_seconds_total counter
trajflow_stage_busy_seconds_total{replica="h-1",stage="validate"} 1.25
trajflow_stage_busy_seconds_total{replica="h-1",stage="reward"} 0.5
# TYPE trajflow_backpressure_seconds_total counter
trajflow_backpressure_seconds_total{replica="h-1",stage="validate"} 0.75
# TYPE trajflow_records_quarantined_total counter
trajflow_records_quarantined_total{reason="bad_input",replica="h-1",stage="validate"} 6
trajflow_records_quarantined_total{reason="nan_logprob",replica="h-1",stage="validate"} 4
# TYPE go_goroutines gauge
go_goroutines 42
`

func TestParseOperatorMetrics(t *testing.T) {
	for _, tc := range []struct {
		name, page string
		want       operatorMetrics
		err        string
	}{
		{name: "two stages", page: twoStages, want: operatorMetrics{in: 200, out: 199, inFlight: 4, lag: 12, busy: 1.75, backpressure: 0.75, quarantined: 10}},
		{name: "nothing in yet", page: "# TYPE trajflow_records_in_total counter\ntrajflow_records_in_total{stage=\"pack\"} 0\n"},
		{name: "not an operator", page: "# TYPE go_goroutines gauge\ngo_goroutines 3\n", err: "no trajflow_records_in_total"},
		{name: "an HTML page", page: "<html><body>404</body></html>\n", err: "not Prometheus's text format"},
		{name: "empty", page: "", err: "no trajflow_records_in_total"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseOperatorMetrics(strings.NewReader(tc.page))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("error %v, want one saying %q", err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
	m, _ := parseOperatorMetrics(strings.NewReader(twoStages))
	const line = "records in 200, out 199, in flight 4, consumer lag 12, busy 1.8 s, backpressure 0.8 s, quarantined 10"
	if m.String() != line {
		t.Errorf("line %q, want %q", m.String(), line)
	}
}

// FuzzParseOperatorMetrics: any page gives metrics or an error, never a
// panic.
func FuzzParseOperatorMetrics(f *testing.F) {
	f.Add(twoStages)
	f.Add("trajflow_records_in_total 1e400\n")
	f.Add("# TYPE trajflow_records_in_total histogram\ntrajflow_records_in_total_bucket{le=\"+Inf\"} 1\n")
	f.Fuzz(func(t *testing.T, page string) {
		if _, err := parseOperatorMetrics(strings.NewReader(page)); err != nil && err.Error() == "" {
			t.Fatal("an error without a message")
		}
	})
}
