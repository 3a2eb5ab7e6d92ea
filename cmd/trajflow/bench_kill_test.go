package main

import (
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/trajflow/trajflow/bench"
	"github.com/trajflow/trajflow/internal/testkit"
)

// TestBenchKillPackLosesNothing: `trajflow bench --processes --kill pack`
// SIGKILLs the pack process half way through the window, at full rate, and
// restarts it; every attempt launched must still be decided exactly once
// after the drain. A pack killed between a closed window's record (and
// batch) and its census events used to leave a group's attempts with no
// decision (2–7 lost in every run): the restart now writes the census of
// the closed window again (pack.Stage.closedCensus).
func TestBenchKillPackLosesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the bench with operator processes for about 30 s")
	}
	dir := t.TempDir()
	out := filepath.Join(dir, "bench.json")
	cmd := exec.Command(trajflowBinary(t), "bench", "--contract", "../../testdata/contracts/bench.yaml",
		"--duration", "10s", "--warmup", "2s", "--baseline", "-1s", "--processes", "--kill", "pack", "--json-out", out)
	b, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("trajflow bench: %v\n%s", err, b)
	}
	var rep bench.Report
	testkit.ReadJSON(t, out, &rep)
	a := rep.Accounting
	if rep.Kill == nil || rep.Kill.Stage != "pack" || a.Launched == 0 {
		t.Fatalf("no kill of pack in the report (kill %+v, launched %d)\n%s", rep.Kill, a.Launched, b)
	}
	if a.Lost != 0 || a.Duplicated != 0 || a.Admitted+a.Filtered+a.Quarantined+a.Excluded != a.Launched {
		t.Fatalf("accounting after the kill: %+v\n%s", a, b)
	}
	// The stages' rows and the pipeline's bytes come from the processes'
	// /metrics and CPU times, pack's across its kill: every stage consumed,
	// produced and used CPU in the window, and the pipeline moved more than
	// its last hop.
	for _, st := range rep.Stages {
		if st.Messages == 0 || st.InMBPerS <= 0 || st.OutMBPerS <= 0 || st.BusyShare <= 0 || st.CPUCores <= 0 {
			t.Errorf("stage %s: empty row %+v", st.Name, st.InstanceReport)
		}
	}
	var last float64
	if n := len(rep.Stages); n > 0 {
		last = rep.Stages[n-1].InMBPerS
	}
	if rep.PipelineMBPerS <= last || rep.PipelineMBPerCPUS <= 0 {
		t.Errorf("pipeline %.1f MB/s (%.1f per CPU-s), pack alone reads %.1f", rep.PipelineMBPerS, rep.PipelineMBPerCPUS, last)
	}
	var opsMB, selfPSS float64
	for _, smp := range rep.RSS {
		opsMB, selfPSS = max(opsMB, smp.OperatorsMB), max(selfPSS, smp.PSSMB)
	}
	if opsMB < 10 || selfPSS < 10 {
		t.Errorf("operator processes' memory %.0f MB, the bench process's %.0f MB (proportional set sizes)", opsMB, selfPSS)
	}
}
