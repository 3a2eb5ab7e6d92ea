package kafka

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestPlanReplication(t *testing.T) {
	for _, tc := range []struct {
		name   string
		req    ReplicationRequest
		want   Replication
		unsafe bool   // refused with ErrUnsafeReplication (and accepted with AllowUnsafe)
		err    string // refused whatever AllowUnsafe says
		why    string // substring of the reason or the error
	}{
		{name: "3 brokers default", req: ReplicationRequest{Brokers: 3}, want: Replication{3, 2}, why: "default on 3 brokers"},
		{name: "5 brokers default", req: ReplicationRequest{Brokers: 5}, want: Replication{3, 2}, why: "one of the 5 brokers is lost"},
		{name: "1 broker default", req: ReplicationRequest{Brokers: 1}, want: Replication{1, 1}, why: "single broker"},
		{name: "2 brokers default", req: ReplicationRequest{Brokers: 2}, want: Replication{2, 1}, unsafe: true, why: "cluster of 2 live brokers"},
		{name: "factor 5 of 5", req: ReplicationRequest{Brokers: 5, Factor: 5}, want: Replication{5, 2}},
		{name: "factor 5 min 3", req: ReplicationRequest{Brokers: 5, Factor: 5, MinInsync: 3}, want: Replication{5, 3}},
		{name: "contract factor", req: ReplicationRequest{Brokers: 3, Factor: 3, FactorFrom: "contract topics.replication"}, want: Replication{3, 2}, why: "contract topics.replication"},
		{name: "factor 1 on 3", req: ReplicationRequest{Brokers: 3, Factor: 1, FactorFrom: "--replication-factor"}, want: Replication{1, 1}, unsafe: true, why: "replication factor 1 (--replication-factor)"},
		{name: "factor 2 on 3", req: ReplicationRequest{Brokers: 3, Factor: 2}, want: Replication{2, 1}, unsafe: true, why: "fewer than 3 replicas"},
		{name: "min equals factor", req: ReplicationRequest{Brokers: 3, MinInsync: 3}, want: Replication{3, 3}, unsafe: true, why: "stops every acks=all write"},
		{name: "min 1 with 3", req: ReplicationRequest{Brokers: 3, Factor: 3, MinInsync: 1}, want: Replication{3, 1}, unsafe: true, why: "one broker only"},
		{name: "factor above brokers", req: ReplicationRequest{Brokers: 3, Factor: 4, AllowUnsafe: true}, err: "exceeds the 3 live brokers"},
		{name: "factor above one broker", req: ReplicationRequest{Brokers: 1, Factor: 3, FactorFrom: "contract topics.replication"}, err: "replication factor 3 (contract topics.replication) exceeds the 1 live broker"},
		{name: "min above factor", req: ReplicationRequest{Brokers: 3, Factor: 3, MinInsync: 4, AllowUnsafe: true}, err: "no acks=all write could succeed"},
		{name: "min above one broker", req: ReplicationRequest{Brokers: 1, MinInsync: 2}, err: "min.insync.replicas 2 exceeds the replication factor 1"},
		{name: "negative", req: ReplicationRequest{Brokers: 3, Factor: -1}, err: "negative"},
		{name: "no brokers", req: ReplicationRequest{}, err: "0 live brokers"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, why, err := PlanReplication(tc.req)
			switch {
			case tc.err != "":
				if err == nil || errors.Is(err, ErrUnsafeReplication) || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want a hard error containing %q", err, tc.err)
				}
				return
			case tc.unsafe && !tc.req.AllowUnsafe:
				if !errors.Is(err, ErrUnsafeReplication) {
					t.Fatalf("err = %v, want ErrUnsafeReplication", err)
				}
				if !strings.Contains(err.Error(), "--allow-unsafe-replication") || !strings.Contains(why+err.Error(), tc.why) {
					t.Fatalf("error %q (reason %q) does not say %q and how to override", err, why, tc.why)
				}
				allowed := tc.req
				allowed.AllowUnsafe = true
				if got, why, err = PlanReplication(allowed); err != nil || !strings.Contains(why, "unsafe, allowed") {
					t.Fatalf("allowed: %v, %v (%q)", got, err, why)
				}
			case err != nil:
				t.Fatalf("err = %v", err)
			}
			if got != tc.want {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
			if !strings.Contains(why, tc.why) {
				t.Fatalf("reason %q does not say %q", why, tc.why)
			}
		})
	}
}

func TestMinInsyncReplicasSpec(t *testing.T) {
	b := startTestBroker(t, BrokerConfig{})
	cc := ClientConfig{Brokers: []string{b.Addr()}}
	ctx := testCtx(t, 15*time.Second)
	specs := []TopicSpec{{Name: "isr", Partitions: 2}, {Name: "isr-default"}}
	Replication{Factor: 1, MinInsync: 1}.Apply(specs[:1])
	if err := CreateTopics(ctx, cc, nil, specs); err != nil {
		t.Fatal(err)
	}
	got, err := ListTopics(ctx, cc, nil)
	if err != nil || len(got) != 2 {
		t.Fatalf("ListTopics = %+v, %v", got, err)
	}
	for _, s := range got {
		if s.ReplicationFactor != 1 || s.MinInsyncReplicas != 1 {
			t.Errorf("%s: replication %d, min.insync.replicas %d; want 1 and 1", s.Name, s.ReplicationFactor, s.MinInsyncReplicas)
		}
	}
	// An existing topic with another min.insync.replicas is a mismatch.
	err = CreateTopics(ctx, cc, nil, []TopicSpec{{Name: "isr", Partitions: 2, MinInsyncReplicas: 2}})
	var me *TopicMismatchError
	if !errors.As(err, &me) || !strings.Contains(err.Error(), "min.insync.replicas: have 1, want 2") {
		t.Fatalf("want a min.insync.replicas mismatch, got %v", err)
	}
	// min.insync.replicas above the factor is refused before any request.
	err = CreateTopics(ctx, cc, nil, []TopicSpec{{Name: "isr-bad", ReplicationFactor: 1, MinInsyncReplicas: 2}})
	if err == nil || !strings.Contains(err.Error(), `topic "isr-bad": min.insync.replicas 2 exceeds the replication factor 1`) {
		t.Fatalf("want the spec refused, got %v", err)
	}
}
