package operators

import (
	"bytes"
	"os"
	"testing"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/pipeline/contract"
)

func TestReplicationRequest(t *testing.T) {
	load := func(path string) *contract.Contract {
		t.Helper()
		c, err := contract.Load(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Resolve(); err != nil {
			t.Fatal(err)
		}
		return c
	}
	demo := load("../testdata/contracts/demo.yaml") // as the built-in contract: topics.replication unwritten
	unwritten := load("../testdata/contracts/conformance.yaml")
	b, err := os.ReadFile("../testdata/contracts/demo.yaml")
	if err != nil {
		t.Fatal(err)
	}
	written, err := contract.Parse(bytes.Replace(b, []byte("topics:\n"), []byte("topics:\n  replication: 1\n"), 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := written.Resolve(); err != nil || !written.Written("topics.replication") {
		t.Fatalf("demo.yaml with replication 1 written: %v, written %v", err, written.Written("topics.replication"))
	}
	for _, tc := range []struct {
		name      string
		c         *contract.Contract
		factor    int
		want      kafka.ReplicationRequest
		plan      kafka.Replication
		planError bool
	}{
		{"contract silent: cluster decides", unwritten, 0,
			kafka.ReplicationRequest{Brokers: 3}, kafka.Replication{Factor: 3, MinInsync: 2}, false},
		{"default contract: cluster decides", contract.Default(), 0,
			kafka.ReplicationRequest{Brokers: 3}, kafka.Replication{Factor: 3, MinInsync: 2}, false},
		{"demo.yaml, the built-in contract's file: cluster decides", demo, 0,
			kafka.ReplicationRequest{Brokers: 3}, kafka.Replication{Factor: 3, MinInsync: 2}, false},
		{"contract writes 1: refused on 3 brokers", written, 0,
			kafka.ReplicationRequest{Brokers: 3, Factor: 1, FactorFrom: "contract topics.replication"}, kafka.Replication{}, true},
		{"flag wins over the contract", written, 3,
			kafka.ReplicationRequest{Brokers: 3, Factor: 3, FactorFrom: "--replication-factor"}, kafka.Replication{Factor: 3, MinInsync: 2}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ReplicationRequest(tc.c, 3, tc.factor, 0, false)
			if got != tc.want {
				t.Fatalf("request %+v, want %+v", got, tc.want)
			}
			r, why, err := kafka.PlanReplication(got)
			if tc.planError {
				if err == nil {
					t.Fatalf("planned %+v (%s), want a refusal", r, why)
				}
				t.Logf("refused: %v", err)
				return
			}
			if err != nil || r != tc.plan {
				t.Fatalf("plan %+v, %v; want %+v", r, err, tc.plan)
			}
		})
	}
}
