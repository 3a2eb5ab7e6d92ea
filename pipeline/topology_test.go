package pipeline

import (
	"bytes"
	"flag"
	"os"
	"testing"
)

var updateTopologyDoc = flag.Bool("update", false, "rewrite docs/TOPOLOGY.md from the topology table")

const topologyDocPath = "../docs/TOPOLOGY.md"

// TestTopologyDoc fails when docs/TOPOLOGY.md is not what WriteTopologyDoc
// writes for the current topology table; `go test ./pipeline -run
// TestTopologyDoc -update` rewrites it.
func TestTopologyDoc(t *testing.T) {
	var want bytes.Buffer
	if err := WriteTopologyDoc(&want); err != nil {
		t.Fatal(err)
	}
	if *updateTopologyDoc {
		if err := os.WriteFile(topologyDocPath, want.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	got, err := os.ReadFile(topologyDocPath)
	if err != nil {
		t.Fatalf("%v (generate it: go test ./pipeline -run TestTopologyDoc -update)", err)
	}
	if !bytes.Equal(got, want.Bytes()) {
		t.Fatalf("%s is stale: the topology table changed; regenerate it with\n\tgo test ./pipeline -run TestTopologyDoc -update", topologyDocPath)
	}
}
