//go:build integration

package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/pipeline"
)

// The TestCluster* scenarios run against the three-node cluster of
// deploy/local/cluster.sh (`make cluster-up`, then `make test-cluster`,
// which passes TRAJFLOW_KAFKA_CLUSTER); `make test-integration` runs
// against the single node and skips them by name.

// realCluster returns the cluster's bootstrap addresses.
func realCluster(t *testing.T) []string {
	t.Helper()
	v := os.Getenv("TRAJFLOW_KAFKA_CLUSTER")
	if v == "" {
		t.Fatal("TRAJFLOW_KAFKA_CLUSTER is not set: run `make cluster-up` and `make test-cluster`")
	}
	addrs := strings.Split(v, ",")
	if len(addrs) != 3 {
		t.Fatalf("TRAJFLOW_KAFKA_CLUSTER=%q: want the three addresses of deploy/local/cluster.sh", v)
	}
	return addrs
}

// clusterScript runs deploy/local/cluster.sh with the suite's home dir and
// returns its standard output.
func clusterScript(t *testing.T, args ...string) string {
	t.Helper()
	cmd := clusterCommand(context.Background(), args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("cluster.sh %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr.String())
	}
	return string(out)
}

// clusterCommand is deploy/local/cluster.sh with args, on the cluster home
// of TRAJFLOW_KAFKA_CLUSTER_HOME when set, killed when ctx ends.
func clusterCommand(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "../deploy/local/cluster.sh", args...)
	cmd.Env = os.Environ()
	if h := os.Getenv("TRAJFLOW_KAFKA_CLUSTER_HOME"); h != "" {
		cmd.Env = append(cmd.Env, "KAFKA_CLUSTER_HOME="+h)
	}
	return cmd
}

// healCluster brings every node back and waits until all three serve.
func healCluster(t *testing.T) {
	t.Helper()
	for _, n := range []string{"1", "2", "3"} {
		_ = clusterCommand(context.Background(), "resume", n).Run() // not paused (or not running): nothing to resume
	}
	clusterScript(t, "up")
}

func topicsCreate(args ...string) (string, error) {
	out, err := exec.Command(binPath, append([]string{"topics", "create"}, args...)...).CombinedOutput()
	return string(out), err
}

// runTopics reads back the run's topics from the broker: partitions and
// replicas from metadata, min.insync.replicas from DescribeConfigs.
func runTopics(t *testing.T, ctx context.Context, brokers []string, run string) map[string]kafka.TopicSpec {
	t.Helper()
	all, err := kafka.ListTopics(ctx, kafka.ClientConfig{}, brokers)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]kafka.TopicSpec{}
	for _, s := range all {
		if strings.HasPrefix(s.Name, run+".") {
			out[s.Name] = s
		}
	}
	return out
}

// TestClusterTopicsReplication: `trajflow topics create` on three brokers
// chooses replication 3 and min.insync.replicas 2, refuses settings that
// cannot survive the loss of a broker unless told otherwise, and the
// broker reports what was asked.
func TestClusterTopicsReplication(t *testing.T) {
	brokers := realCluster(t)
	list := strings.Join(brokers, ",")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	want := len(pipeline.Topics{}.All())

	run := uniqueRun("repl")
	path, _ := runContract(t, run, "")
	out, err := topicsCreate("--brokers", list, "--contract", path)
	if err != nil {
		t.Fatalf("topics create: %v\n%s", err, out)
	}
	if !strings.Contains(out, "replication factor 3 (default on 3 brokers), min.insync.replicas 2") {
		t.Fatalf("topics create did not say what it chose:\n%s", out)
	}
	got := runTopics(t, ctx, brokers, run)
	if len(got) != want {
		t.Fatalf("%d topics of run %s, want %d: %v", len(got), run, want, got)
	}
	for name, s := range got {
		if s.ReplicationFactor != 3 || s.MinInsyncReplicas != 2 {
			t.Errorf("%s: replication %d, min.insync.replicas %d; want 3 and 2", name, s.ReplicationFactor, s.MinInsyncReplicas)
		}
	}

	// Refused: nothing is created, and the error says why.
	for _, args := range [][]string{
		{"--replication-factor", "2"},
		{"--min-insync-replicas", "3"},
		{"--min-insync-replicas", "1"},
	} {
		run := uniqueRun("unsafe")
		path, _ := runContract(t, run, "")
		out, err := topicsCreate(append([]string{"--brokers", list, "--contract", path}, args...)...)
		if err == nil || !strings.Contains(out, "cannot survive the loss of one broker") || !strings.Contains(out, "--allow-unsafe-replication") {
			t.Fatalf("topics create %v: %v, want a refusal that says why:\n%s", args, err, out)
		}
		if n := len(runTopics(t, ctx, brokers, run)); n != 0 {
			t.Fatalf("topics create %v was refused but created %d topics", args, n)
		}
		t.Logf("topics create %v refused: %s", args, strings.TrimSpace(out))
	}
	// The contract's topics.replication, written, is the default; the flag
	// wins over it; --allow-unsafe-replication accepts what it says.
	run = uniqueRun("contract")
	path, _ = runContract(t, run, "")
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	src = []byte(strings.Replace(string(src), "topics: {partitions: 4,", "topics: {partitions: 4, replication: 2,", 1))
	if err := os.WriteFile(path, src, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := topicsCreate("--brokers", list, "--contract", path); err == nil || !strings.Contains(out, "replication factor 2 (contract topics.replication)") {
		t.Fatalf("contract replication 2: %v, want a refusal naming the contract:\n%s", err, out)
	}
	out, err = topicsCreate("--brokers", list, "--contract", path, "--allow-unsafe-replication")
	if err != nil {
		t.Fatalf("topics create --allow-unsafe-replication: %v\n%s", err, out)
	}
	for name, s := range runTopics(t, ctx, brokers, run) {
		if s.ReplicationFactor != 2 || s.MinInsyncReplicas != 1 {
			t.Errorf("%s: replication %d, min.insync.replicas %d; want 2 and 1", name, s.ReplicationFactor, s.MinInsyncReplicas)
		}
	}
	run2 := uniqueRun("flag")
	path2, _ := runContract(t, run2, "")
	src2 := strings.Replace(string(src), "run_id: "+run, "run_id: "+run2, 1)
	if err := os.WriteFile(path2, []byte(src2), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := topicsCreate("--brokers", list, "--contract", path2, "--replication-factor", "3"); err != nil {
		t.Fatalf("--replication-factor 3 over the contract's 2: %v\n%s", err, out)
	}
	for name, s := range runTopics(t, ctx, brokers, run2) {
		if s.ReplicationFactor != 3 || s.MinInsyncReplicas != 2 {
			t.Errorf("%s: replication %d, min.insync.replicas %d; want 3 and 2", name, s.ReplicationFactor, s.MinInsyncReplicas)
		}
	}
}

// TestClusterFirstBrokerDown: with the first listed broker killed, and then
// paused, the admin paths and `trajflow topics create` reach the others.
func TestClusterFirstBrokerDown(t *testing.T) {
	brokers := realCluster(t)
	list := strings.Join(brokers, ",")
	t.Cleanup(func() { healCluster(t) })
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cc := kafka.ClientConfig{DialTimeout: 2 * time.Second}
	// The command line gets the same 2 s bound per address.
	cfgPath := t.TempDir() + "/client.yaml"
	if err := os.WriteFile(cfgPath, []byte("brokers: ["+list+"]\ndial_timeout: 2s\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	for fault, done := range map[string]string{"kill": "killed", "pause": "paused"} {
		clusterScript(t, fault, "1")
		start := time.Now()
		spec := kafka.TopicSpec{Name: uniqueRun("down-" + fault), Partitions: 2, ReplicationFactor: 2, MinInsyncReplicas: 1}
		if err := kafka.CreateTopics(ctx, cc, brokers, []kafka.TopicSpec{spec}); err != nil {
			t.Fatalf("CreateTopics with node 1 %s: %v", done, err)
		}
		if _, err := kafka.ListTopics(ctx, cc, brokers); err != nil {
			t.Fatalf("ListTopics with node 1 %s: %v", done, err)
		}
		t.Logf("node 1 %s: CreateTopics and ListTopics took %s (2 s bound per address)", done, time.Since(start).Round(time.Millisecond))

		run := uniqueRun("down" + fault)
		path, _ := runContract(t, run, "")
		start = time.Now()
		out, err := topicsCreate("--client-config", cfgPath, "--contract", path, "--replication-factor", "2", "--allow-unsafe-replication")
		if err != nil {
			t.Fatalf("topics create with node 1 %s: %v\n%s", done, err, out)
		}
		t.Logf("node 1 %s: trajflow topics create took %s", done, time.Since(start).Round(time.Millisecond))
		if fault == "kill" {
			clusterScript(t, "start", "1")
		} else {
			clusterScript(t, "resume", "1")
		}
		healCluster(t)
	}
}

// TestClusterLeaderKilled: SIGKILL of a partition's leader moves the
// leadership to another replica; acks=all writes then succeed with two of
// three replicas (min.insync.replicas 2) and nothing written before is
// lost.
func TestClusterLeaderKilled(t *testing.T) {
	brokers := realCluster(t)
	t.Cleanup(func() { healCluster(t) })
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	topic := uniqueRun("failover")
	if err := kafka.CreateTopics(ctx, kafka.ClientConfig{}, brokers, []kafka.TopicSpec{{Name: topic, ReplicationFactor: 3, MinInsyncReplicas: 2}}); err != nil {
		t.Fatal(err)
	}
	tr := &kafkago.Transport{DialTimeout: 2 * time.Second}
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{
		Addr: kafkago.TCP(brokers...), Topic: topic, RequiredAcks: kafkago.RequireAll,
		BatchTimeout: 5 * time.Millisecond, MaxAttempts: 20, WriteBackoffMin: 100 * time.Millisecond, WriteBackoffMax: time.Second,
		Transport: tr,
	}
	defer w.Close()
	// kafka-go's writer does not retry "topic partition has no leader"
	// (its cached metadata, refreshed every 6 s, may say so right after
	// the move): the write is retried here, as an operator would.
	transient := 0
	write := func(from, to int) {
		t.Helper()
		for i := from; i < to; i++ {
			for deadline := time.Now().Add(30 * time.Second); ; {
				err := w.WriteMessages(ctx, kafkago.Message{Value: []byte(strconv.Itoa(i))})
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("write %d: %v", i, err)
				}
				if transient++; transient == 1 {
					t.Logf("write %d failed, retrying: %v", i, err)
				}
				time.Sleep(200 * time.Millisecond)
			}
		}
	}
	write(0, 50)
	before := strings.TrimSpace(clusterScript(t, "describe", topic))
	leader := strings.TrimSpace(clusterScript(t, "leader", topic, "0"))
	t.Logf("before: %s", before)
	clusterScript(t, "kill", leader)
	killed := time.Now()
	var now string
	for {
		now = strings.TrimSpace(clusterScript(t, "leader", topic, "0"))
		if now != leader && now != "-1" {
			break
		}
		if time.Since(killed) > 60*time.Second {
			t.Fatalf("leader still %s 60 s after SIGKILL of node %s", now, leader)
		}
		time.Sleep(100 * time.Millisecond)
	}
	moved := time.Since(killed)
	t.Logf("after %s: %s", moved.Round(10*time.Millisecond), strings.TrimSpace(clusterScript(t, "describe", topic)))
	write(50, 100)
	t.Logf("%d writes failed and were retried after the move", transient)
	clusterScript(t, "start", leader)

	r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: brokers, Topic: topic, Partition: 0, MaxWait: 500 * time.Millisecond})
	defer r.Close()
	seen := map[string]bool{}
	for len(seen) < 100 {
		m, err := r.ReadMessage(ctx)
		if err != nil {
			t.Fatalf("read back after %d of 100: %v", len(seen), err)
		}
		seen[string(m.Value)] = true
	}
	for i := range 100 {
		if !seen[fmt.Sprint(i)] {
			t.Fatalf("record %d lost", i)
		}
	}
}
