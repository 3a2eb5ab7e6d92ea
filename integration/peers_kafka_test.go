//go:build integration

package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/bench/peers"
	"github.com/trajflow/trajflow/internal/testkit"
)

// TestBenchPeersKafkaAuto runs `trajflow bench peers --kafka auto`: the
// command starts its own Apache Kafka with deploy/local/kafka.sh (a home
// of its own, free ports), warms its JVM with an unrecorded run, measures
// trajflow and the raw clients on it with the JVM's CPU counted, and
// stops the broker and deletes its data when it ends.
func TestBenchPeersKafkaAuto(t *testing.T) {
	dir := t.TempDir()
	home, err := filepath.Abs("../build/kafka-peers-test")
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "peers.json")
	cmd := exec.Command(binPath, "bench", "peers", "--systems", "trajflow-kafka", "--kafka", peers.KafkaAuto,
		"--kafka-script", "../deploy/local/kafka.sh", "--kafka-home", home, "--kafka-warmup", "2s",
		"--contract", "../testdata/contracts/bench.yaml", "--rounds", "1", "--duration", "3s", "--warmup", "1s",
		"--baseline", "1s", "--kill", "", "--corpus-groups", "16", "--out", dir, "--json-out", out)
	b, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %v\n%s", cmd.Args, err, b)
	}
	log := string(b)
	for _, want := range []string{"kafka.sh: ready", "warming up Apache Kafka's JVM", "kafka.sh: broker stopped"} {
		if !strings.Contains(log, want) {
			t.Errorf("output lacks %q:\n%s", want, log)
		}
	}
	var res peers.Result
	testkit.ReadJSON(t, out, &res)
	systems := map[string]peers.Row{}
	for _, r := range res.Rows {
		if r.Round != 1 {
			t.Errorf("row %q of round %d: only round 1 is recorded (the warm-up is not)", r.System, r.Round)
		}
		systems[r.System] = r
	}
	const where = " (Apache Kafka (its JVM's CPU counted))"
	for _, s := range []string{"trajflow", "raw kafka-go", "raw franz-go"} {
		r, ok := systems[s+where]
		if !ok {
			t.Errorf("no row %q in %v", s+where, res.Rows)
			continue
		}
		if r.MBPerS <= 0 || r.MBPerCPUS <= 0 || r.CPUCores <= 0 {
			t.Errorf("%s: MB/s %.1f, MB per CPU-s %.1f, cores %.2f", r.System, r.MBPerS, r.MBPerCPUS, r.CPUCores)
		}
	}
	if r := systems["trajflow"+where]; r.Lost != 0 || r.Launched == 0 {
		t.Errorf("trajflow on Kafka: lost %d of %d launched attempts", r.Lost, r.Launched)
	}
	if _, err := os.Stat(filepath.Join(dir, "trajflow-kafka-r0.json")); err != nil {
		t.Errorf("the warm-up run left no report: %v", err)
	}
	// The broker is gone and its data deleted; the jars stay for the next run.
	if _, err := os.Stat(filepath.Join(home, "data")); !os.IsNotExist(err) {
		t.Errorf("%s/data still there after the run (stat: %v)", home, err)
	}
	if _, err := os.Stat(filepath.Join(home, "libs")); err != nil {
		t.Errorf("the broker's jars are not cached in %s/libs: %v", home, err)
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		if c, err := os.ReadFile(p); err == nil && strings.Contains(string(c), home+"/") {
			t.Errorf("a process still runs from %s: %s", home, strings.ReplaceAll(string(c), "\x00", " "))
		}
	}
}
