package integration

import (
	"net"
	"strings"
	"testing"
	"time"
)

// TestOperatorsWaitForBroker starts the four operators before their broker
// exists: each fails to connect, restarts in place with backoff (`trajflow
// run --restarts`), and once `trajflow broker` comes up on the address the
// run completes with nothing lost or duplicated.
func TestOperatorsWaitForBroker(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes; run without -short")
	}
	start := time.Now()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	addr := ln.Addr().String()
	path, c := runContract(t, uniqueRun("late"), "")
	f := newFleet(t, addr, path)
	for _, n := range []string{"validate", "reward", "advantage", "pack"} {
		f.start(n, n+"-0")
	}
	time.Sleep(3 * time.Second)
	if !strings.Contains(f.logs(), "operator failed; restarting") {
		t.Fatalf("no operator reported a failed connection and a restart:\n%s", f.logs())
	}
	if got := startBrokerProcessOn(t, port); got != addr {
		t.Fatalf("broker on %s, want %s", got, addr)
	}
	run := startRun(t, c, addr)
	ids := run.Produce(t, synthFor(run, 120), 0, 30)
	counts, rep := settle(t, run, ids, 60*time.Second)
	if ex := f.exited(); len(ex) > 0 {
		t.Errorf("operators exited:\n%s", strings.Join(ex, "\n"))
	}
	record(t, scenarioResult{Name: "operators started before the broker (reconnect)", Broker: "trajflow broker",
		Counts: counts, Reasons: reasons(rep.Quarantined), Elapsed: time.Since(start)})
	checkCounts(t, run, counts, rep)
	checkNoneRefused(t, counts, rep)
}
