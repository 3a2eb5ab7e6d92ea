package integration

import (
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestConformanceProcesses is the runtime's conformance test on the
// embedded broker: `trajflow broker` and `trajflow run
// validate|reward|advantage|pack` as separate processes, two validate
// instances sharing a consumer group, a few thousand trajectories produced
// while stages are SIGKILLed at random moments and restarted (one advantage
// and one pack restart after deleting the state directory; 12 kills), and a third
// validate instance joining then leaving (a rebalance with records in
// flight). Nothing is lost and nothing is admitted twice; kcat lists the
// run's topics on the broker.
func TestConformanceProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes; run without -short")
	}
	start := time.Now()
	addr := startBrokerProcess(t)
	runID := uniqueRun("conf")
	path, c := runContract(t, runID, "")
	run := startRun(t, c, addr)
	checkKcat(t, addr, run.Topics.Trajectories, run.Topics.Batches, run.Topics.Quarantine)

	f := newFleet(t, addr, path)
	for _, inst := range []struct{ name, inst string }{
		{"validate", "validate-0"}, {"validate", "validate-1"}, {"reward", "reward-0"},
		{"advantage", "advantage-0"}, {"pack", "pack-0"},
	} {
		f.start(inst.name, inst.inst)
	}
	prod := startProducer(t, run, 150, 400, 10, 700*time.Millisecond)

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 6))
	pick := func(stage string) string {
		if stage == "validate" {
			return []string{"validate-0", "validate-1"}[rng.IntN(2)]
		}
		return stage + "-0"
	}
	wipe := func(round int, stage string) bool {
		return (round == 0 && stage == "advantage") || (round == 1 && stage == "pack")
	}
	// Rounds are spaced past the session timeout (10 s): the embedded
	// broker's group coordinator can wedge a group whose member dies while
	// a rebalance is still pending (real Kafka recovers; the real-Kafka
	// suite kills without spacing).
	chaos(f, rng, 3, 11*time.Second, pick, []string{"validate", "reward", "advantage", "pack"}, wipe)
	time.Sleep(11 * time.Second)

	// Rebalance: a third validate instance joins while records flow, then
	// leaves gracefully.
	f.start("validate", "validate-2")
	time.Sleep(3 * time.Second)
	f.stop("validate-2")

	ids := prod.wait()
	counts, rep := settle(t, run, ids, 120*time.Second)
	if ex := f.exited(); len(ex) > 0 {
		t.Errorf("operators exited by themselves:\n%s", strings.Join(ex, "\n"))
	}
	record(t, scenarioResult{Name: "conformance: kills + wipes + rebalance", Broker: "trajflow broker",
		Kills: f.kills, Wipes: f.wipes, Rebal: 2, Counts: counts, Reasons: reasons(rep.Quarantined), Elapsed: time.Since(start)})
	checkCounts(t, run, counts, rep)
	checkNoneRefused(t, counts, rep)
	if counts.Launched < 3000 {
		t.Errorf("launched %d trajectories, want a few thousand", counts.Launched)
	}
}

// checkKcat runs `kcat -b addr -L` and checks it lists topics. kcat is
// optional unless TRAJFLOW_REQUIRE_KCAT=1.
func checkKcat(t *testing.T, addr string, topics ...string) {
	t.Helper()
	if _, err := exec.LookPath("kcat"); err != nil {
		if os.Getenv("TRAJFLOW_REQUIRE_KCAT") == "1" {
			t.Fatal("kcat not installed and TRAJFLOW_REQUIRE_KCAT=1")
		}
		t.Log("kcat not installed: metadata listing not checked")
		return
	}
	out, err := exec.Command("kcat", "-b", addr, "-L", "-m", "10").CombinedOutput()
	if err != nil {
		t.Fatalf("kcat -L: %v\n%s", err, out)
	}
	for _, topic := range topics {
		if !strings.Contains(string(out), `topic "`+topic+`"`) {
			t.Errorf("kcat -L does not list %s:\n%s", topic, out)
		}
	}
}
