package integration

import (
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestOperatorsWaitForBroker starts the four operators before their broker
// exists: each reports the unreachable address and keeps retrying in place
// (no restart). Once `trajflow broker` comes up on the address, the
// operators reach it before the run's topics exist (every operator waits
// for its input topics rather than join its group with nothing to consume
// or scan a topic that is not there); the topics are created, and the run
// completes with nothing lost or duplicated.
func TestOperatorsWaitForBroker(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes; run without -short")
	}
	start := time.Now()
	port := portBelowEphemeral(t)
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	path, c := runContract(t, uniqueRun("late"), "")
	f := newFleet(t, addr, path)
	for _, n := range []string{"validate", "reward", "advantage", "pack"} {
		f.start(n, n+"-0")
	}
	time.Sleep(3 * time.Second)
	logs := f.logs()
	if strings.Count(logs, "brokers unreachable; retrying") < 4 || !strings.Contains(logs, addr+": failed to dial") {
		t.Fatalf("not every operator reported the unreachable broker by address:\n%s", logs)
	}
	if strings.Contains(logs, "operator failed; restarting") {
		t.Fatalf("an operator restarted instead of waiting:\n%s", logs)
	}
	if got := startBrokerProcessOn(t, port); got != addr {
		t.Fatalf("broker on %s, want %s", got, addr)
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, stage := range []string{"validate", "reward", "advantage", "pack"} {
		for !strings.Contains(f.logs(), "waiting for topics to be created (trajflow topics create)\" run="+c.RunID+" stage="+stage) {
			if time.Now().After(deadline) {
				t.Fatalf("%s did not wait for its input topic:\n%s", stage, f.logs())
			}
			time.Sleep(100 * time.Millisecond)
		}
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

// portBelowEphemeral returns a free port below Linux's ephemeral range
// (32768 and up), so that no listener on port 0 elsewhere in a parallel
// test run can take it in the seconds before the broker binds it.
func portBelowEphemeral(t *testing.T) int {
	t.Helper()
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(os.Getpid())))
	for range 200 {
		port := 21000 + r.IntN(11000)
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err == nil {
			ln.Close()
			return port
		}
	}
	t.Fatal("no free port in 21000-31999")
	return 0
}
