package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
)

func startBroker(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := kafka.StartBroker(ctx, kafka.BrokerConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b.Addr()
}

// topics create on one broker chooses replication 1 and min.insync.replicas
// 1 and says so; a factor the cluster cannot hold is refused.
func TestTopicsCreateReplication(t *testing.T) {
	addr := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out, errb bytes.Buffer
	if code := run(ctx, []string{"topics", "create", "--brokers", addr}, &out, &errb); code != 0 {
		t.Fatalf("topics create: exit %d: %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "replication: replication factor 1 (default on 1 broker), min.insync.replicas 1") ||
		!strings.Contains(out.String(), "replication=1 min.insync.replicas=1") {
		t.Fatalf("topics create did not print the chosen replication:\n%s", out.String())
	}
	topics, err := kafka.ListTopics(ctx, kafka.ClientConfig{}, []string{addr})
	if err != nil || len(topics) == 0 {
		t.Fatalf("ListTopics: %v, %v", topics, err)
	}
	for _, s := range topics {
		if s.ReplicationFactor != 1 || s.MinInsyncReplicas != 1 {
			t.Errorf("%s: replication %d, min.insync.replicas %d", s.Name, s.ReplicationFactor, s.MinInsyncReplicas)
		}
	}
	out.Reset()
	errb.Reset()
	code := run(ctx, []string{"topics", "create", "--brokers", addr, "--replication-factor", "3", "--allow-unsafe-replication"}, &out, &errb)
	if code != 1 || !strings.Contains(errb.String(), "replication factor 3 (--replication-factor) exceeds the 1 live broker") {
		t.Fatalf("replication 3 on one broker: exit %d: %s", code, errb.String())
	}
}
