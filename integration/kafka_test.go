//go:build integration

package integration

import (
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// realKafka returns the address of the real Kafka broker (TRAJFLOW_KAFKA,
// started by `make kafka-up`); the integration build fails without one.
func realKafka(t *testing.T) string {
	t.Helper()
	addr := os.Getenv("TRAJFLOW_KAFKA")
	if addr == "" {
		t.Fatal("TRAJFLOW_KAFKA is not set: run `make kafka-up` and `make test-integration`")
	}
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatalf("Kafka at %s unreachable (make kafka-up): %v", addr, err)
	}
	c.Close()
	return addr
}

// kafkaScript runs deploy/local/kafka.sh with the suite's KAFKA_HOME.
func kafkaScript(t *testing.T, arg string) {
	t.Helper()
	cmd := exec.Command("../deploy/local/kafka.sh", arg)
	cmd.Env = os.Environ()
	if h := os.Getenv("TRAJFLOW_KAFKA_HOME"); h != "" {
		cmd.Env = append(cmd.Env, "KAFKA_HOME="+h)
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("kafka.sh %s: %v\n%s", arg, err, out)
	}
}

func standardFleet(t *testing.T, addr, path string, validates int) *fleet {
	f := newFleet(t, addr, path)
	for i := 0; i < validates; i++ {
		f.start("validate", "validate-"+string(rune('0'+i)))
	}
	for _, n := range []string{"reward", "advantage", "pack"} {
		f.start(n, n+"-0")
	}
	return f
}

// TestKafkaKills SIGKILLs every stage at random moments against real
// Kafka: 5 rounds of 4 kills (20), no spacing, one of two validate
// instances picked at random, the state directory of advantage, pack and
// reward deleted before some restarts.
func TestKafkaKills(t *testing.T) {
	start := time.Now()
	addr := realKafka(t)
	path, c := runContract(t, uniqueRun("kills"), "")
	run := startRun(t, c, addr)
	f := standardFleet(t, addr, path, 2)
	prod := startProducer(t, run, 150, 400, 10, 600*time.Millisecond)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 20))
	pick := func(stage string) string {
		if stage == "validate" {
			return []string{"validate-0", "validate-1"}[rng.IntN(2)]
		}
		return stage + "-0"
	}
	wipe := func(round int, stage string) bool {
		return (round == 1 && stage == "advantage") || (round == 2 && stage == "pack") || (round == 3 && stage == "reward") ||
			(round == 4 && stage == "advantage")
	}
	chaos(f, rng, 5, 0, pick, []string{"validate", "reward", "advantage", "pack"}, wipe)
	ids := prod.wait()
	counts, rep := settle(t, run, ids, 180*time.Second)
	if ex := f.exited(); len(ex) > 0 {
		t.Errorf("operators exited by themselves:\n%s", strings.Join(ex, "\n"))
	}
	record(t, scenarioResult{Name: "kill -9 every stage, random moments", Broker: "Apache Kafka 4.1",
		Kills: f.kills, Wipes: f.wipes, Counts: counts, Reasons: reasons(rep.Quarantined), Elapsed: time.Since(start)})
	if f.kills < 20 {
		t.Errorf("%d kills, want >= 20", f.kills)
	}
	checkCounts(t, run, counts, rep)
	checkNoneRefused(t, counts, rep)
}

// TestKafkaBrokerRestart stops the broker mid-run (SIGTERM, controlled
// shutdown), keeps it down a few seconds and starts it again: the
// operators reconnect (restarting in place after their fatal errors) and
// the run completes.
func TestKafkaBrokerRestart(t *testing.T) {
	start := time.Now()
	addr := realKafka(t)
	path, c := runContract(t, uniqueRun("brestart"), "")
	run := startRun(t, c, addr)
	f := standardFleet(t, addr, path, 1)
	s := synthFor(run, 150)
	ids := run.Produce(t, s, 0, 300)
	time.Sleep(time.Second) // records in flight in every stage when the broker stops
	kafkaScript(t, "down")
	time.Sleep(3 * time.Second)
	kafkaScript(t, "up")
	ids = append(ids, run.Produce(t, s, 300, 400)...)
	counts, rep := settle(t, run, ids, 180*time.Second)
	if ex := f.exited(); len(ex) > 0 {
		t.Errorf("operators exited by themselves:\n%s", strings.Join(ex, "\n"))
	}
	record(t, scenarioResult{Name: "broker stop + restart mid-run", Broker: "Apache Kafka 4.1",
		Restarts: 1, Counts: counts, Reasons: reasons(rep.Quarantined), Elapsed: time.Since(start)})
	checkCounts(t, run, counts, rep)
	checkNoneRefused(t, counts, rep)
	if !strings.Contains(f.logs(), "operator failed; restarting") {
		t.Log("no operator needed an in-place restart (the client retried through the outage)")
	}
}

// TestKafkaRebalance adds instances of validate and reward while records
// flow, then removes them (one gracefully, one by SIGKILL).
func TestKafkaRebalance(t *testing.T) {
	start := time.Now()
	addr := realKafka(t)
	path, c := runContract(t, uniqueRun("rebal"), "")
	run := startRun(t, c, addr)
	f := standardFleet(t, addr, path, 1)
	prod := startProducer(t, run, 150, 300, 10, 500*time.Millisecond)
	time.Sleep(2 * time.Second)
	f.start("validate", "validate-1")
	f.start("reward", "reward-1")
	time.Sleep(4 * time.Second)
	f.start("validate", "validate-2")
	time.Sleep(3 * time.Second)
	f.stop("validate-1")
	f.kill("reward-1")
	f.mu.Lock()
	delete(f.procs, "reward-1")
	f.mu.Unlock()
	time.Sleep(2 * time.Second)
	f.stop("validate-2")
	ids := prod.wait()
	counts, rep := settle(t, run, ids, 120*time.Second)
	if ex := f.exited(); len(ex) > 0 {
		t.Errorf("operators exited by themselves:\n%s", strings.Join(ex, "\n"))
	}
	record(t, scenarioResult{Name: "rebalance: 3 joins, 3 leaves (1 by SIGKILL)", Broker: "Apache Kafka 4.1",
		Kills: f.kills, Rebal: 6, Counts: counts, Reasons: reasons(rep.Quarantined), Elapsed: time.Since(start)})
	checkCounts(t, run, counts, rep)
	checkNoneRefused(t, counts, rep)
}

// kafkaHome is where deploy/local/kafka.sh keeps keys and credentials.
func kafkaHome(t *testing.T) string {
	t.Helper()
	h := os.Getenv("TRAJFLOW_KAFKA_HOME")
	if h == "" {
		h = "../build/kafka"
	}
	abs, err := filepath.Abs(h)
	if err != nil {
		t.Fatal(err)
	}
	return abs
}
