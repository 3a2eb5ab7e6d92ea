package kafka

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
)

// requireKcatEnv makes a missing kcat a failure (CI installs it).
const requireKcatEnv = "TRAJFLOW_REQUIRE_KCAT"

// TestKcatSeesBroker checks the embedded broker with librdkafka's kcat:
// metadata (-L) lists a created topic with its partitions, and a consumer
// reads back a message written by kafka-go. Without kcat on PATH the test
// fails when TRAJFLOW_REQUIRE_KCAT=1 and otherwise only logs that it did
// not run.
func TestKcatSeesBroker(t *testing.T) {
	kcat, err := exec.LookPath("kcat")
	if err != nil {
		if os.Getenv(requireKcatEnv) == "1" {
			t.Fatalf("kcat not found on PATH but %s=1: install kcat (apt-get install -y kcat): %v", requireKcatEnv, err)
		}
		t.Logf("kcat not found on PATH; librdkafka check not run (set %s=1 to require it)", requireKcatEnv)
		return
	}
	b := startTestBroker(t, BrokerConfig{})
	createTopics(t, b.Addr(), TopicSpec{Name: "kcat-topic", Partitions: 3})
	run := func(args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, kcat, append([]string{"-b", b.Addr()}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("kcat %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	md := run("-L")
	if !strings.Contains(md, `topic "kcat-topic" with 3 partitions`) {
		t.Fatalf("kcat -L does not list the topic:\n%s", md)
	}

	w := newWriter(t, ClientConfig{Brokers: []string{b.Addr()}}, "kcat-topic", 0)
	if err := w.WriteMessages(testCtx(t, 10*time.Second), kafkago.Message{Key: []byte("g1"), Value: []byte("hello-librdkafka")}); err != nil {
		t.Fatal(err)
	}
	got := run("-C", "-t", "kcat-topic", "-o", "beginning", "-e", "-q", "-f", "%k=%s\n")
	if strings.TrimSpace(got) != "g1=hello-librdkafka" {
		t.Fatalf("kcat consumed %q", got)
	}
}
