package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestWriteReportReplacesItsSection: a run of one suite replaces its own
// section of the report and keeps the other suite's.
func TestWriteReportReplacesItsSection(t *testing.T) {
	path := filepath.Join(t.TempDir(), "REPORT.md")
	old := "# Fault-injection report\n\n<!-- report:kills -->\nthe single node's table\n<!-- /report:kills -->\n\n" +
		"<!-- report:cluster -->\nan old cluster table\n<!-- /report:cluster -->\n"
	if err := os.WriteFile(path, []byte(old), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("TRAJFLOW_REPORT", path)
	reportMu.Lock()
	saved := results
	results = []scenarioResult{{Name: "a loop scenario", Loop: &loopResult{Rounds: 10, Batches: 9, SameBatches: true,
		Faults: []faultRecord{{Name: "SIGKILL node 2", Broker: true, At: time.Unix(100, 0), Restart: time.Unix(140, 0), Healed: time.Unix(150, 0),
			Node: "2", Coordinators: map[string]string{"pack": "2"}, Recovery: map[string]time.Duration{"pack": 7 * time.Second},
			HealthyRate: 2, DegradedRate: 1.5, SteadyRate: 1.8}}}}}
	reportMu.Unlock()
	defer func() { reportMu.Lock(); results = saved; reportMu.Unlock() }()
	if err := writeReport(); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	got := string(data)
	for _, want := range []string{"the single node's table", "| a loop scenario |", "yes (9)", "| SIGKILL node 2 | 40.0s | 10.0s |", " 7.0s* |", " 75% |"} {
		if !strings.Contains(got, want) {
			t.Errorf("report lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "an old cluster table") || strings.Index(got, "report:kills") > strings.Index(got, "report:cluster") {
		t.Errorf("the cluster section was not replaced in place:\n%s", got)
	}
}
