package deploytest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// BenchmarkStages measures what each data-plane stage costs as its own
// process, as deploy/k8s runs it: validate, reward, advantage and pack
// (`trajflow run` with the arguments of deploy/k8s/base, the bench
// contract testdata/contracts/bench.yaml) are fed STAGE_GROUPS (default
// 3000) groups of the bench's synthetic source (synth.Bench: 8 trajectories
// of ~870 tokens per message, ~58 KB) as fast as the producer writes them;
// once every attempt is accounted for, each process reports its CPU time
// per input message, its rate over the busy window, and its peak RSS. On
// `trajflow broker`, or on TRAJFLOW_KAFKA_CLUSTER (topics replicated 3).
//
//	go test ./internal/deploytest -run '^$' -bench Stages -benchtime 1x
func BenchmarkStages(b *testing.B) {
	groups := int64(3000)
	if s := os.Getenv("STAGE_GROUPS"); s != "" {
		fmt.Sscan(s, &groups)
	}
	bin := buildBinary(b)
	brokers := clusterBrokers(b)
	onCluster := brokers != ""
	if !onCluster {
		brokers = testkit.StartBrokerProcess(b, bin, 0)
	}
	runID := uniqueRun("stages")
	cdir := filepath.Join(b.TempDir(), "contract")
	src, err := os.ReadFile("../../testdata/contracts/bench.yaml")
	if err != nil {
		b.Fatal(err)
	}
	text := strings.Replace(string(src), "run_id: bench", "run_id: "+runID, 1)
	if err := os.MkdirAll(cdir, 0o755); err != nil {
		b.Fatal(err)
	}
	cpath := filepath.Join(cdir, "contract.yaml")
	if err := os.WriteFile(cpath, []byte(text), 0o644); err != nil {
		b.Fatal(err)
	}
	c, err := contract.Load(cpath)
	if err == nil {
		err = c.Resolve()
	}
	if err != nil || c.RunID != runID {
		b.Fatalf("contract: %v (run %q)", err, c.RunID)
	}
	args := []string{"topics", "create", "--brokers", brokers, "--contract", cpath}
	if onCluster {
		args = append(args, "--replication-factor", "3", "--min-insync-replicas", "2")
	}
	if out, err := exec.Command(bin, args...).CombinedOutput(); err != nil {
		b.Fatalf("topics create: %v\n%s", err, out)
	}
	l := processLauncher{bin: bin, contractDir: cdir, releases: filepath.Join(b.TempDir(), "releases")}
	f := newFleet(b, l, baseManifests(b), brokers)
	// The last window closes without a next record (the fleet's pack waits
	// for a full window, as a live loop fills it).
	f.extra["pack"] = []string{"--window-max-wait", "2s"}
	stages := []string{"validate", "reward", "advantage", "pack"}
	var insts []*instance
	for _, st := range stages {
		in := f.start(st, st+"-0")
		insts = append(insts, in)
	}
	for _, in := range insts {
		if err := f.waitReady(in, 90*time.Second); err != nil {
			b.Fatal(err)
		}
	}
	run := &testkit.Run{Contract: c, Topics: mustTopics(b, runID), Addr: strings.Split(brokers, ",")[0]}
	s := synth.Bench()
	s.RunID, s.ContractHash, s.GroupSize, s.MaxTurns = runID, c.Hash(), c.Sampler.GroupSize, c.Sampler.MaxTurns
	s.Vocab = rollout.VocabSize // the vocabulary `trajflow run` validates against
	s.PolicyVersion, s.MeanLag = 0, 0

	before := map[string]usage{}
	for _, in := range insts {
		before[in.name] = f.sample(in)
	}
	start := time.Now()
	var ids []string
	for from := int64(0); from < groups; from += 100 {
		ids = append(ids, run.Produce(b, s, from, min(from+100, groups))...)
	}
	produced := time.Since(start)
	counts := run.WaitAccounted(b, ids, 5*time.Minute)
	elapsed := time.Since(start)
	if counts.Lost != 0 || counts.Duplicated != 0 {
		b.Fatalf("accounting: %v", counts)
	}
	tokens := int64(0)
	for g := int64(0); g < groups; g++ {
		for _, tr := range s.Group(g) {
			for _, turn := range tr.Turns {
				tokens += int64(len(turn.PromptIDs) + len(turn.ActionIDs) + len(turn.ObservationIDs))
			}
		}
	}
	b.Logf("%s: %d groups (%d trajectories, %.1f M tokens) produced in %s, all accounted for after %s: %v",
		map[bool]string{true: "cluster " + brokers, false: "trajflow broker"}[onCluster],
		groups, len(ids), float64(tokens)/1e6, produced.Round(time.Millisecond), elapsed.Round(time.Millisecond), counts)
	for _, in := range insts {
		u := f.sample(in)
		cpu := u.cpu - before[in.name].cpu
		perMsg := cpu / time.Duration(groups)
		b.Logf("stage %-9s CPU %6.2f s = %4.0f µs per message (%.2f cores over %s); at 1 core: %5.0f messages/s = %5.1f M tokens/s; peak RSS %4d MB",
			in.stage, cpu.Seconds(), float64(perMsg.Microseconds()), cpu.Seconds()/elapsed.Seconds(), elapsed.Round(time.Second),
			float64(time.Second)/float64(perMsg), float64(tokens)/cpu.Seconds()/1e6, u.peakKB/1024)
		b.ReportMetric(float64(perMsg.Microseconds()), in.stage+"-cpu-µs/msg")
		b.ReportMetric(float64(u.peakKB/1024), in.stage+"-peak-MB")
	}
	for _, in := range insts {
		if err := f.stop(in); err != nil {
			b.Error(err)
		}
	}
}

func mustTopics(t testing.TB, run string) pipeline.Topics {
	t.Helper()
	topics, err := pipeline.TopicsFor(run)
	if err != nil {
		t.Fatal(err)
	}
	return topics
}
