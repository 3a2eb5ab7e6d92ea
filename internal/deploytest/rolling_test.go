package deploytest

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/internal/testkit"
)

// TestRollingRestart is an upgrade of a running fleet: every operator of
// the loop, started with the arguments of deploy/k8s/base, is restarted
// once, one after the other, the way its manifest's update strategy does it
// (surge for validate, reward and rollout; stop first for dispatch and the
// StatefulSets), each new instance waited for on /readyz before the next
// restart, and each old one stopped with SIGTERM within its grace period.
// Rounds go on throughout; afterwards nothing is lost or admitted twice and
// the batches are those of the uninterrupted in-process demo, bit for bit.
// It runs on `trajflow broker`, or on the replicated cluster named by
// TRAJFLOW_KAFKA_CLUSTER (make cluster-up; make test-rolling).
func TestRollingRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("a fleet of 10 processes for 1-3 minutes")
	}
	bin := buildBinary(t)
	brokers := clusterBrokers(t)
	onCluster := brokers != ""
	if !onCluster {
		brokers = testkit.StartBrokerProcess(t, bin, 0)
	}
	runID := uniqueRun("rolling")
	cdir := filepath.Join(t.TempDir(), "contract")
	writeContract(t, cdir, runID)
	l := processLauncher{bin: bin, contractDir: cdir, releases: filepath.Join(t.TempDir(), "releases")}
	f := newFleet(t, l, baseManifests(t), brokers)
	rollingScenario(t, f, runID, func() {
		args := []string{"topics", "create", "--brokers", brokers, "--contract", filepath.Join(cdir, "contract.yaml")}
		if onCluster {
			// The demo contract writes replication 1; the cluster's topics get 3.
			args = append(args, "--replication-factor", "3", "--min-insync-replicas", "2")
		}
		out, err := exec.Command(bin, args...).CombinedOutput()
		if err != nil {
			t.Fatalf("topics create: %v\n%s", err, out)
		}
		t.Logf("topics create on %s: %s", brokers, strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0]))
	})
}
