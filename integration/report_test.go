package integration

import (
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/internal/audit"
)

// scenarioResult is one line of the fault-injection report.
type scenarioResult struct {
	Name     string
	Broker   string
	Kills    int
	Wipes    int
	Restarts int // broker restarts (loop scenarios: broker faults)
	Rebal    int // instances added or removed
	Counts   audit.Counts
	Reasons  map[string]int // quarantine reasons of launched attempts (census)
	Elapsed  time.Duration
	Loop     *loopResult // the RL loop scenarios on the cluster (TestFaults*)
}

// loopResult is what a loop scenario adds to its report line.
type loopResult struct {
	Rounds      int
	Batches     int           // distinct batch ids
	Copies      int           // identical extra copies of batch messages (producer retries)
	SameBatches bool          // batches identical to the clean run's
	Rate        float64       // rounds/s over the whole run
	MaxRound    time.Duration // longest dispatch-to-decision of a round
	MaxLiveness time.Duration // worst liveness measure seen
	Restarts    int           // in-place operator restarts ("operator failed; restarting")
	Faults      []faultRecord
	Watch       string // the watch's own failed polls
	Load        string // the machine's load average at the start and at the end
}

// faultRecord is one fault of a loop scenario and what it did to the loop.
type faultRecord struct {
	Name string
	// At: injected; Restart: the node's start (or SIGCONT) issued;
	// Healed: the node serves again.
	At, Restart, Healed time.Time
	HealthyFrom         time.Time // start of the healthy interval before it
	// HealthyAfter and HealthyUntil bound the healthy interval after it
	// (zero: none).
	HealthyAfter, HealthyUntil time.Time
	Broker                     bool   // a broker fault (rates measured)
	Node                       string // the broker's node id
	// Coordinators are the nodes coordinating each stage's consumer group
	// just before the fault.
	Coordinators map[string]string
	// Measured after the run.
	Recovery     map[string]time.Duration // stage -> first new committed offset of its group after At
	HealthyRate  float64                  // rounds decided per second in the healthy intervals (their mean)
	DegradedRate float64                  // rounds decided per second while the node was down, in [At, Restart)
	SteadyRate   float64                  // the same from the last group's recovery on
	RestartRate  float64                  // rounds decided per second while the node started, in [Restart, Healed)
	Restarts     int                      // in-place operator restarts in [At, next fault)
	ISRFull      time.Duration            // from Healed until every ISR was full again
}

var (
	reportMu sync.Mutex
	results  []scenarioResult
	// referenceNote describes the clean reference run of the loop
	// scenarios (set by them).
	referenceNote string
)

// record prints a scenario's counts and keeps them for the report.
func record(t testing.TB, r scenarioResult) {
	t.Helper()
	t.Logf("scenario %s [%s]: kills=%d wiped=%d broker_restarts=%d rebalances=%d launched=%d admitted=%d filtered=%d quarantined=%d lost=%d duplicated=%d (%s)",
		r.Name, r.Broker, r.Kills, r.Wipes, r.Restarts, r.Rebal, r.Counts.Launched, r.Counts.Admitted,
		r.Counts.Filtered, r.Counts.Quarantined, r.Counts.Lost, r.Counts.Duplicated, r.Elapsed.Round(time.Second))
	reportMu.Lock()
	results = append(results, r)
	reportMu.Unlock()
}

// The report has one section per suite, between markers: a run of one
// suite (make test-integration, make test-faults) replaces its section and
// keeps the others.
const (
	sectionKills   = "kills"
	sectionCluster = "cluster"
)

var sectionRe = regexp.MustCompile(`(?s)<!-- report:(\w+) -->\n(.*?)<!-- /report:(\w+) -->\n`)

// writeReport writes the scenarios' results to $TRAJFLOW_REPORT (markdown)
// when that variable is set (make test-integration and make test-faults
// set it).
func writeReport() error {
	path := os.Getenv("TRAJFLOW_REPORT")
	if path == "" || len(results) == 0 {
		return nil
	}
	sections := map[string]string{}
	if old, err := os.ReadFile(path); err == nil {
		for _, m := range sectionRe.FindAllStringSubmatch(string(old), -1) {
			if m[1] == m[3] {
				sections[m[1]] = m[2]
			}
		}
	}
	var kills, cluster []scenarioResult
	for _, r := range results {
		if r.Loop != nil {
			cluster = append(cluster, r)
		} else {
			kills = append(kills, r)
		}
	}
	now := time.Now().UTC().Format(time.RFC3339)
	if len(kills) > 0 {
		sections[sectionKills] = killsSection(kills, now)
	}
	if len(cluster) > 0 {
		sections[sectionCluster] = clusterSection(cluster, now)
	}
	var b strings.Builder
	b.WriteString("# Fault-injection report\n\n")
	b.WriteString("Written by the integration suites (integration/): `make test-integration` (embedded broker and one Apache\n")
	b.WriteString("Kafka node) writes the first section, `make test-faults` (the RL loop on a three-node Apache Kafka cluster)\n")
	b.WriteString("the second; each run replaces its own section.\n\n")
	for _, name := range []string{sectionKills, sectionCluster} {
		if s, ok := sections[name]; ok {
			fmt.Fprintf(&b, "<!-- report:%s -->\n%s<!-- /report:%s -->\n\n", name, s, name)
		}
	}
	return os.WriteFile(path, []byte(strings.TrimRight(b.String(), "\n")+"\n"), 0o644)
}

func killsSection(rs []scenarioResult, now string) string {
	var b strings.Builder
	b.WriteString("## Operators killed, brokers restarted, bad input (make test-integration)\n\n")
	b.WriteString("Operators run as separate `trajflow run` processes; kills are SIGKILL at random moments, \"wiped\" restarts\n")
	b.WriteString("delete the operator's Badger state directory first. lost = launched attempts neither admitted, filtered nor\n")
	b.WriteString("quarantined; duplicated = extra admissions of a trajectory plus repeated batch ids.\n\n")
	fmt.Fprintf(&b, "Generated %s.\n\n", now)
	b.WriteString("| scenario | broker | kills | wiped | broker restarts | rebalances | launched | admitted | filtered | quarantined | lost | duplicated | time | quarantine reasons |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	for _, r := range rs {
		fmt.Fprintf(&b, "| %s | %s | %d | %d | %d | %d | %d | %d | %d | %d | %d | %d | %s | %s |\n", r.Name, r.Broker, r.Kills, r.Wipes,
			r.Restarts, r.Rebal, r.Counts.Launched, r.Counts.Admitted, r.Counts.Filtered, r.Counts.Quarantined,
			r.Counts.Lost, r.Counts.Duplicated, r.Elapsed.Round(time.Second), reasonList(r.Reasons))
	}
	return b.String()
}

func reasonList(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, fmt.Sprintf("%s %d", k, m[k]))
	}
	sort.Strings(keys)
	return strings.Join(keys, ", ")
}

// reportStages are the consumer groups of the loop, in pipeline order.
var reportStages = []string{"dispatch", "rollout", "validate", "reward", "advantage", "pack", "train"}

func clusterSection(rs []scenarioResult, now string) string {
	var b strings.Builder
	b.WriteString("## The RL loop on a three-node cluster (make test-faults)\n\n")
	b.WriteString("The whole loop (dispatch, two rollout instances, validate, reward, advantage, pack, train: eight `trajflow run`\n")
	b.WriteString("processes, `--brokers` listing all three nodes) in sync mode against deploy/local/cluster.sh (Apache Kafka\n")
	b.WriteString("4.1.1, KRaft, topics with replication 3 and min.insync.replicas 2). Every scenario ends with the same checks:\n")
	b.WriteString("every round decided and trained, lost 0, duplicated 0, quarantined 0, and batches identical to the clean\n")
	b.WriteString("reference run of the same seed (`trajflow demo --no-gate`, same run id); during the run a liveness check fails the\n")
	b.WriteString("scenario when a round stays dispatched 60 s without a window record deciding it, or the loop idles 60 s.\n")
	b.WriteString("Operator kills are SIGKILL with a restart (\"wiped\": its state directory deleted first); operator restarts\n")
	b.WriteString("count the in-place restarts an operator made by itself after a fatal error (\"operator failed; restarting\").\n\n")
	fmt.Fprintf(&b, "Generated %s.", now)
	reportMu.Lock()
	if referenceNote != "" {
		fmt.Fprintf(&b, " %s", referenceNote)
	}
	reportMu.Unlock()
	b.WriteString("\n\n")
	b.WriteString("| scenario | broker faults | operator kills | wiped | rounds | batches = reference | batch copies | rounds/s | longest round | worst liveness | operator restarts | launched | admitted | filtered | lost | duplicated | time | load |\n")
	b.WriteString("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	for _, r := range rs {
		l := r.Loop
		same := "no"
		if l.SameBatches {
			same = fmt.Sprintf("yes (%d)", l.Batches)
		}
		fmt.Fprintf(&b, "| %s | %d | %d | %d | %d | %s | %d | %.2f | %.1fs | %.1fs | %d | %d | %d | %d | %d | %d | %s | %s |\n",
			r.Name, r.Restarts, r.Kills, r.Wipes, l.Rounds, same, l.Copies, l.Rate, l.MaxRound.Seconds(), l.MaxLiveness.Seconds(),
			l.Restarts, r.Counts.Launched, r.Counts.Admitted, r.Counts.Filtered, r.Counts.Lost, r.Counts.Duplicated,
			r.Elapsed.Round(time.Second), l.Load)
	}
	b.WriteString("\nPer fault: recovery is the time from the fault to the first poll (every 300 ms) that saw the consumer\n")
	b.WriteString("group's committed offsets move past what the first poll after the fault saw (\"-\": none before the run\n")
	b.WriteString("ended); * marks a group whose coordinator was the faulted node. The loop is synchronous, so a group waiting\n")
	b.WriteString("for its input recovers when the slowest stage upstream does. Rates are rounds decided per second: healthy\n")
	b.WriteString("is the mean of the intervals just before the fault and after the node's ISRs were full again (rounds get\n")
	b.WriteString("cheaper as the policy learns); degraded while the node was down (until its start was issued; for a\n")
	b.WriteString("rolling restart, until it served again) and, steady, from the slowest group's recovery on; restarting while\n")
	b.WriteString("the node's JVM started. Restarts are in-place operator restarts from the fault to the next one. In the\n")
	b.WriteString("scenarios with operator kills the kills fall inside the broker's outage, so their degraded rate also\n")
	b.WriteString("counts the killed operators' restarts and the rebalances they cause; the broker's own cost is in the\n")
	b.WriteString("scenarios without them. Committed offsets are asked of each group's coordinator directly, every broker\n")
	b.WriteString("asked at once which node that is, so a hung node delays only the polls of the groups it coordinates.\n\n")
	b.WriteString("| scenario | fault | down | starting | " + strings.Join(reportStages, " | ") + " | slowest | healthy r/s | degraded r/s | degraded / healthy | steady / healthy | restarting r/s | operator restarts | ISR full after |\n")
	b.WriteString("|---|---|---:|---:|" + strings.Repeat("---:|", len(reportStages)) + "---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rs {
		for _, f := range r.Loop.Faults {
			fmt.Fprintf(&b, "| %s | %s | ", r.Name, f.Name)
			if f.Broker {
				fmt.Fprintf(&b, "%.1fs | %.1fs |", f.Restart.Sub(f.At).Seconds(), f.Healed.Sub(f.Restart).Seconds())
			} else {
				b.WriteString("- | - |")
			}
			var slowest time.Duration
			for _, s := range reportStages {
				mark := ""
				if f.Node != "" && f.Coordinators[s] == f.Node {
					mark = "*"
				}
				if d, ok := f.Recovery[s]; ok {
					fmt.Fprintf(&b, " %.1fs%s |", d.Seconds(), mark)
					slowest = max(slowest, d)
				} else {
					b.WriteString(" - |")
				}
			}
			fmt.Fprintf(&b, " %.1fs |", slowest.Seconds())
			if f.Broker && f.HealthyRate > 0 {
				fmt.Fprintf(&b, " %.2f | %.2f | %.0f%% | %.0f%% | %.2f | %d | %.1fs |\n", f.HealthyRate, f.DegradedRate,
					100*f.DegradedRate/f.HealthyRate, 100*f.SteadyRate/f.HealthyRate, f.RestartRate, f.Restarts, f.ISRFull.Seconds())
			} else {
				fmt.Fprintf(&b, " - | - | - | - | - | %d | - |\n", f.Restarts)
			}
		}
	}
	return b.String()
}
