//go:build integration

package integration

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// The TestFaults* scenarios run the whole RL loop (dispatch, rollout,
// validate, reward, advantage, pack, train) as `trajflow run` processes
// against the three-node cluster of deploy/local/cluster.sh (topics with
// replication 3 and min.insync.replicas 2, --brokers listing every node)
// and inject faults into brokers and operators while it runs (`make
// test-faults`). A liveness check runs during every scenario, and each ends
// with the same checks: every round decided and trained, nothing lost or
// duplicated (internal/audit), and batches identical, bit for bit, to a
// clean run of the same seed (dispatch mode sync is deterministic:
// docs/ARCHITECTURE.md, "Pacing and what is deterministic").

// loopStages are the operators of the loop, in pipeline order.
var loopStages = []string{"dispatch", "rollout", "validate", "reward", "advantage", "pack", "train"}

// loopFleetInstances is the fleet: eight processes, two rollout instances
// sharing the four partitions of the tasks topic.
var loopFleetInstances = [][2]string{
	{"dispatch", "dispatch-0"}, {"rollout", "rollout-0"}, {"rollout", "rollout-1"}, {"validate", "validate-0"},
	{"reward", "reward-0"}, {"advantage", "advantage-0"}, {"pack", "pack-0"}, {"train", "train-0"},
}

const (
	// loopGroupsPerRound and loopGroupSize are the demo contract's
	// dispatch.groups_per_update and sampler.group_size.
	loopGroupsPerRound = 16
	loopGroupSize      = 16
	// liveDeadline: no round may stay dispatched this long without a
	// window record deciding it, and the loop may not go this long
	// without a dispatch, a window or a release.
	liveDeadline = 60 * time.Second
)

// loopMaxRounds is the number of rounds of the reference run and the
// most any scenario dispatches: a scenario starts dispatch with it and,
// once its faults are over, restarts dispatch gracefully with --rounds a
// few past the current round (finish), so that the run's length follows
// the machine's speed, not a guess. TRAJFLOW_FAULTS_ROUNDS overrides it.
func loopMaxRounds() int {
	if v, err := strconv.Atoi(os.Getenv("TRAJFLOW_FAULTS_ROUNDS")); err == nil && v > 0 {
		return v
	}
	return 320
}

// stageArgs are the flags every operator of the fleet gets: the releases
// directory, the run's rounds and the log level.
func (l *loopRun) stageArgs() []string {
	return []string{"--releases", l.releases, "--rounds", strconv.Itoa(l.rounds), "--log-level", loopLogLevel()}
}

// loopLogLevel is the fleet's --log-level: info, or TRAJFLOW_FAULTS_LOG_LEVEL
// (debug, to read a failed scenario's logs kept under TRAJFLOW_KEEP_LOGS).
func loopLogLevel() string {
	if v := os.Getenv("TRAJFLOW_FAULTS_LOG_LEVEL"); v != "" {
		return v
	}
	return "info"
}

var (
	loopRunOnce sync.Once
	loopRunName string
)

// loopRunID is the run id every scenario of this test binary uses (with
// its topics and groups deleted in between): ids, and so batches, depend
// on it, and one clean reference run serves them all.
func loopRunID() string {
	loopRunOnce.Do(func() { loopRunName = uniqueRun("faults") })
	return loopRunName
}

// reference is the clean run: `trajflow demo --no-gate` (the same loop in
// one process on the embedded broker, without the evaluation gate, as the
// scenarios' fleet has no eval or gate operator: a gated run's rollback
// would change the batches after it) with the run id, seed and rounds of
// the scenarios. Its batch hashes are the ones every scenario must produce.
type reference struct {
	done   chan struct{}
	hashes []string
	took   time.Duration
	err    error
}

var (
	refOnce sync.Once
	ref     *reference
)

// cleanReference starts the reference run (once) and returns it; wait
// blocks until it is done.
func cleanReference() *reference {
	refOnce.Do(func() {
		ref = &reference{done: make(chan struct{})}
		go func() {
			defer close(ref.done)
			dir, err := os.MkdirTemp("", "trajflow-ref-")
			if err != nil {
				ref.err = err
				return
			}
			defer os.RemoveAll(dir)
			start := time.Now()
			out, err := exec.Command(binPath, "demo", "--updates", strconv.Itoa(loopMaxRounds()), "--run", loopRunID(),
				"--seed", "1", "--no-gate", "--out", dir).CombinedOutput()
			ref.took = time.Since(start)
			if err != nil {
				ref.err = fmt.Errorf("trajflow demo: %v\n%s", err, out)
				return
			}
			var sum struct {
				BatchHashes []string `json:"batch_hashes"`
				Lost        int      `json:"lost"`
				Duplicates  int      `json:"duplicates_admitted"`
			}
			data, err := os.ReadFile(filepath.Join(dir, "summary.json"))
			if err == nil {
				err = json.Unmarshal(data, &sum)
			}
			if err != nil {
				ref.err = fmt.Errorf("reference summary: %w", err)
				return
			}
			if sum.Lost != 0 || sum.Duplicates != 0 || len(sum.BatchHashes) == 0 {
				ref.err = fmt.Errorf("reference run: lost %d, duplicates %d, %d batches", sum.Lost, sum.Duplicates, len(sum.BatchHashes))
			}
			ref.hashes = sum.BatchHashes
		}()
	})
	return ref
}

func (r *reference) wait(t *testing.T) []string {
	t.Helper()
	<-r.done
	if r.err != nil {
		t.Fatal(r.err)
	}
	reportMu.Lock()
	referenceNote = fmt.Sprintf("Clean reference: `trajflow demo --updates %d --run <id> --seed 1 --no-gate` (embedded broker, one process): %d batches in %s.",
		loopMaxRounds(), len(r.hashes), r.took.Round(time.Second))
	reportMu.Unlock()
	return r.hashes
}

// loopRun is one run of the loop on the cluster.
type loopRun struct {
	t        *testing.T
	name     string
	brokers  []string
	runID    string
	topics   pipeline.Topics
	f        *fleet
	w        *loopWatch
	adm      *kgo.Client
	releases string
	rounds   int // rounds dispatch was last started with
	began    time.Time
	load     string // load average when it began

	faults  []faultRecord
	kills   int
	wipes   int
	liveMu  sync.Mutex
	liveErr string
	maxLive time.Duration // worst liveness measure seen
	stopLiv chan struct{}
	livDone chan struct{}
}

// startLoop deletes whatever the run id left on the cluster, creates its
// topics (replication 3, min.insync.replicas 2), starts the watch and the
// fleet and the liveness check. data are the short names ("scored") of the
// data-plane topics whose records the watch locates by round
// (loopWatch.located).
func startLoop(t *testing.T, name string, data ...string) *loopRun {
	t.Helper()
	brokers := realCluster(t)
	l := &loopRun{t: t, name: name, brokers: brokers, runID: loopRunID(), rounds: loopMaxRounds(), began: time.Now(), load: loadAvg(),
		stopLiv: make(chan struct{}), livDone: make(chan struct{})}
	var err error
	if l.adm, err = adminClient(brokers); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	healCluster(t)
	if took, err := waitFullISR(ctx, l.adm, 90*time.Second); err != nil {
		t.Fatal(err)
	} else if took > time.Second {
		t.Logf("cluster ISRs full after %s", took.Round(time.Millisecond))
	}
	if err := deleteRun(ctx, l.adm, l.runID, loopStages); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := deleteRun(ctx, l.adm, l.runID, loopStages); err != nil {
			t.Logf("cleanup: %v", err)
		}
		l.adm.Close()
	})
	src, err := os.ReadFile("../testdata/contracts/demo.yaml")
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Replace(string(src), "\nrun_id: demo\n", "\nrun_id: "+l.runID+"\n", 1)
	if !strings.Contains(s, "\nrun_id: "+l.runID+"\n") {
		t.Fatal("demo contract has no run_id line")
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "contract.yaml")
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	list := strings.Join(brokers, ",")
	// The demo contract writes topics.replication: 1 (it is part of the
	// contract's hash, which every record carries): the flags win over it.
	out, err := exec.Command(binPath, "topics", "create", "--brokers", list, "--contract", path,
		"--replication-factor", "3", "--min-insync-replicas", "2").CombinedOutput()
	if err != nil {
		t.Fatalf("topics create: %v\n%s", err, out)
	}
	if l.topics, err = pipeline.TopicsFor(l.runID); err != nil {
		t.Fatal(err)
	}
	if err := topicsServed(ctx, l.adm, l.topics.All()); err != nil {
		t.Fatal(err)
	}
	for i := range data {
		data[i] = l.runID + "." + data[i]
	}
	if l.w, err = watchLoop(brokers, l.topics, l.runID, loopStages, loopGroupsPerRound, data); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.w.close)
	l.releases = filepath.Join(dir, "releases")
	t.Cleanup(l.keepLogs) // after the fleet's own cleanup has stopped it
	l.f = newFleet(t, list, path)
	l.f.stageArgs = l.stageArgs()
	for _, si := range loopFleetInstances {
		l.f.start(si[0], si[1])
	}
	go l.liveness()
	t.Cleanup(l.stopLiveness)
	return l
}

// keepLogs copies the fleet's logs of a failed scenario to
// $TRAJFLOW_KEEP_LOGS/<test> (make test-faults: build/faults-logs).
func (l *loopRun) keepLogs() {
	root := os.Getenv("TRAJFLOW_KEEP_LOGS")
	if (!l.t.Failed() && os.Getenv("TRAJFLOW_KEEP_ALL_LOGS") == "") || root == "" || l.f == nil {
		return
	}
	dst := filepath.Join(root, l.t.Name())
	if err := os.MkdirAll(dst, 0o755); err != nil {
		l.t.Logf("keep logs: %v", err)
		return
	}
	paths, _ := filepath.Glob(filepath.Join(l.f.dir, "*.log"))
	for _, p := range paths {
		if data, err := os.ReadFile(p); err == nil {
			_ = os.WriteFile(filepath.Join(dst, filepath.Base(p)), data, 0o644)
		}
	}
	l.t.Logf("fleet logs kept in %s", dst)
}

// liveness checks every second that no round is older than liveDeadline
// without a window record deciding it, and that the loop never idles that
// long before it is complete.
func (l *loopRun) liveness() {
	defer close(l.livDone)
	tk := time.NewTicker(time.Second)
	defer tk.Stop()
	for {
		select {
		case <-l.stopLiv:
			return
		case now := <-tk.C:
			d, what := l.w.stall(now, l.rounds)
			l.liveMu.Lock()
			l.maxLive = max(l.maxLive, d)
			first := d > liveDeadline && l.liveErr == ""
			l.liveMu.Unlock()
			if first {
				// What the cluster said at that moment (one line: the
				// failure message is what a CI log keeps) tells a stall
				// of Kafka's (no live leader) from one of the loop's.
				msg := fmt.Sprintf("liveness: %s (deadline %s, at %s); cluster then: %s", what, liveDeadline,
					now.Format("15:04:05"), l.clusterState())
				l.liveMu.Lock()
				l.liveErr = msg
				l.liveMu.Unlock()
			}
		}
	}
}

// clusterState is cluster.sh's status of every node and its leaders and
// ISRs of the scored and batches topics, on one line, each question
// bounded to 10 s (a paused node must not hang the liveness check).
func (l *loopRun) clusterState() string {
	var parts []string
	for _, args := range [][]string{{"status"}, {"describe", l.topics.Scored}, {"describe", l.topics.Batches}} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		out, err := clusterCommand(ctx, args...).CombinedOutput() // status exits 1 while a node is down
		cancel()
		text := strings.Join(strings.Fields(strings.ReplaceAll(string(out), "\n", " | ")), " ")
		if err != nil && args[0] != "status" {
			text += " (" + err.Error() + ")"
		}
		parts = append(parts, strings.Join(args, " ")+": "+text)
	}
	parts = append(parts, fmt.Sprintf("group coordinators: %v", l.coordinators()))
	parts = append(parts, "groups: "+l.groupsState())
	return strings.Join(parts, "; ")
}

// groupsState is each stage's consumer group as its coordinator describes
// it (state, members by client id with their partitions) and the offsets
// the watch last saw it commit (and the ends of the data topics it follows):
// whether a stalled stage has a member, an assignment and records to read.
func (l *loopRun) groupsState() string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req := kmsg.NewPtrDescribeGroupsRequest()
	for _, s := range loopStages {
		req.Groups = append(req.Groups, l.runID+"."+s)
	}
	var parts []string
	for _, sh := range l.adm.RequestSharded(ctx, req) {
		if sh.Err != nil {
			parts = append(parts, fmt.Sprintf("node %d: %v", sh.Meta.NodeID, sh.Err))
			continue
		}
		for _, g := range sh.Resp.(*kmsg.DescribeGroupsResponse).Groups {
			var members []string
			for _, m := range g.Members {
				var a kmsg.ConsumerMemberAssignment
				var tps []string
				if err := a.ReadFrom(m.MemberAssignment); err != nil {
					tps = append(tps, "undecodable assignment")
				}
				for _, t := range a.Topics {
					for _, p := range t.Partitions {
						tps = append(tps, fmt.Sprintf("%s/%d", t.Topic, p))
					}
				}
				members = append(members, fmt.Sprintf("%s[%s]", m.ClientID, strings.Join(tps, " ")))
			}
			parts = append(parts, fmt.Sprintf("%s on node %d: %s, %d members %s", g.Group, sh.Meta.NodeID, g.State,
				len(g.Members), strings.Join(members, " ")))
		}
	}
	l.w.mu.Lock()
	parts = append(parts, fmt.Sprintf("committed %v", l.w.offsets))
	if len(l.w.ends) > 0 { // only the data topics the scenario follows
		parts = append(parts, fmt.Sprintf("topic ends seen %v", l.w.ends))
	}
	l.w.mu.Unlock()
	return strings.Join(parts, " | ")
}

func (l *loopRun) stopLiveness() {
	select {
	case <-l.stopLiv:
	default:
		close(l.stopLiv)
	}
	<-l.livDone
}

// live returns the liveness failure, if any.
func (l *loopRun) live() string {
	l.liveMu.Lock()
	defer l.liveMu.Unlock()
	return l.liveErr
}

// waitRounds waits until n rounds are decided (or the liveness check or
// timeout fails the test).
func (l *loopRun) waitRounds(n int, timeout time.Duration) {
	l.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		p := l.w.progress()
		if p.done >= n {
			return
		}
		if e := l.live(); e != "" {
			l.t.Fatalf("%s (waiting for %d rounds: %+v)", e, n, p)
		}
		if ex := l.f.exited(); len(ex) > 0 {
			l.t.Fatalf("operators exited by themselves:\n%s", strings.Join(ex, "\n"))
		}
		if time.Now().After(deadline) {
			l.t.Fatalf("%d rounds not decided after %s: %+v", n, timeout, p)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// sleep waits d, failing early if the liveness check fails.
func (l *loopRun) sleep(d time.Duration) {
	l.t.Helper()
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		if e := l.live(); e != "" {
			l.t.Fatal(e)
		}
		time.Sleep(min(200*time.Millisecond, time.Until(end)))
	}
}

// signal sends sig to instance inst.
func (l *loopRun) signal(inst string, sig syscall.Signal) {
	l.f.mu.Lock()
	p := l.f.procs[inst]
	l.f.mu.Unlock()
	if p == nil {
		l.t.Fatalf("no instance %s", inst)
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		l.t.Fatalf("signal %v to %s: %v", sig, inst, err)
	}
}

// killOperator SIGKILLs inst and starts it again, its state directory
// deleted first when wipe.
func (l *loopRun) killOperator(inst string, wipe bool) {
	l.f.kill(inst)
	l.f.restart(inst, wipe)
	l.kills++
	if wipe {
		l.wipes++
	}
}

// brokerFault injects a broker fault: how is "kill" (SIGKILL, then
// `start` after down), "pause" (SIGSTOP, then SIGCONT) or "stop"
// (controlled shutdown, then start). It returns once the node serves
// again, every ISR is full and a healthy interval was measured after it;
// the result is the start of that interval. during, when not nil, runs
// right after the fault is injected (operator kills of the combined
// scenarios).
func (l *loopRun) brokerFault(name string, node string, how string, down time.Duration, healthyFrom time.Time, during func()) time.Time {
	l.t.Helper()
	coord := l.coordinators()
	at := time.Now()
	switch how {
	case "kill", "pause", "stop":
		clusterScript(l.t, how, node)
	default:
		l.t.Fatalf("fault %q", how)
	}
	l.t.Logf("%s: %s node %s at %s", name, how, node, at.Format("15:04:05.000"))
	if during != nil {
		during()
	}
	l.sleep(down - time.Since(at))
	restart := time.Now()
	if how == "pause" {
		clusterScript(l.t, "resume", node)
	} else {
		clusterScript(l.t, "start", node)
	}
	healed := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	isr, err := waitFullISR(ctx, l.adm, 90*time.Second)
	if err != nil {
		l.t.Fatalf("%s: %v", name, err)
	}
	l.t.Logf("%s: node %s back after %s, ISRs full %s later; %+v", name, node, healed.Sub(at).Round(time.Millisecond),
		isr.Round(time.Millisecond), l.w.progress())
	after := time.Now()
	l.sleep(healthyFor)
	l.faults = append(l.faults, faultRecord{Name: name, At: at, Restart: restart, Healed: healed, HealthyFrom: healthyFrom, Broker: true, ISRFull: isr,
		Node: node, Coordinators: coord, HealthyAfter: after, HealthyUntil: time.Now()})
	return after
}

// coordinators returns the node coordinating each stage's consumer group.
func (l *loopRun) coordinators() map[string]string {
	out := map[string]string{}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, s := range loopStages {
		req := kmsg.NewPtrFindCoordinatorRequest()
		req.CoordinatorKey = l.runID + "." + s
		req.CoordinatorKeys = []string{req.CoordinatorKey}
		resp, err := req.RequestWith(ctx, l.adm)
		if err != nil {
			continue
		}
		if len(resp.Coordinators) > 0 {
			out[s] = strconv.Itoa(int(resp.Coordinators[0].NodeID))
		} else {
			out[s] = strconv.Itoa(int(resp.NodeID))
		}
	}
	return out
}

// leaderOf is the node leading partition 0 of topic.
func (l *loopRun) leaderOf(topic string) string {
	l.t.Helper()
	for range 50 {
		n := strings.TrimSpace(clusterScript(l.t, "leader", topic, "0"))
		if n != "-1" && n != "" {
			return n
		}
		time.Sleep(200 * time.Millisecond)
	}
	l.t.Fatalf("%s/0 has no leader", topic)
	return ""
}

// finish ends the run a few rounds after the current one: dispatch is
// stopped gracefully and started again with --rounds set there (it
// rebuilds its state from the topics and neither repeats nor skips a
// round). Then it waits for the run to complete.
func (l *loopRun) finish(extra int, timeout time.Duration) {
	l.t.Helper()
	p := l.w.progress()
	if target := p.dispatched + extra; target < l.rounds {
		l.f.stop("dispatch-0")
		l.rounds = l.w.progress().dispatched + extra
		l.f.stageArgs = l.stageArgs()
		l.f.start("dispatch", "dispatch-0")
	} else {
		l.t.Logf("the run reached %d of %d rounds before its faults were over", p.dispatched, l.rounds)
	}
	deadline := time.Now().Add(timeout)
	for !l.w.progress().complete(l.rounds) {
		if e := l.live(); e != "" {
			l.t.Fatalf("%s; %+v", e, l.w.progress())
		}
		if ex := l.f.exited(); len(ex) > 0 {
			l.t.Fatalf("operators exited by themselves:\n%s", strings.Join(ex, "\n"))
		}
		if time.Now().After(deadline) {
			l.t.Fatalf("run of %d rounds not complete after %s: %+v", l.rounds, timeout, l.w.progress())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// restartLine matches the log line of an operator restarting in place.
var restartLine = regexp.MustCompile(`time=(\S+) level=WARN msg="operator failed; restarting".* err="((?:[^"\\]|\\.)*)"`)

// restarts returns the times and errors of in-place operator restarts in
// every log of the fleet.
func (l *loopRun) restarts() (times []time.Time, errs []string) {
	paths, _ := filepath.Glob(filepath.Join(l.f.dir, "*.log"))
	sort.Strings(paths)
	for _, p := range paths {
		fh, err := os.Open(p)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(fh)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			m := restartLine.FindStringSubmatch(sc.Text())
			if m == nil {
				continue
			}
			at, _ := time.Parse(time.RFC3339Nano, m[1])
			times = append(times, at)
			errs = append(errs, strings.TrimSuffix(filepath.Base(p), ".log")+": "+m[2])
		}
		fh.Close()
	}
	return times, errs
}

// check stops the fleet and runs the final checks: complete, nothing lost,
// duplicated or quarantined, batches equal to the reference, no operator
// exited by itself, the liveness check never failed. It fills and records
// the scenario's report line.
func (l *loopRun) check(ref []string) {
	t := l.t
	t.Helper()
	l.stopLiveness()
	// dispatch, restarted with the final --rounds by finish, exits 0 once
	// the run is done and drained; the others run with more rounds.
	if ex := l.f.exitedFailing(); len(ex) > 0 {
		t.Errorf("operators exited by themselves:\n%s", strings.Join(ex, "\n"))
	}
	var wg sync.WaitGroup
	for _, si := range loopFleetInstances {
		wg.Add(1)
		go func() { defer wg.Done(); l.f.stop(si[1]) }()
	}
	wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := &pipeline.Config{Brokers: l.brokers, MaxMessageBytes: 64 << 20}
	// The batches as the trainer takes them: the first copy of each batch
	// id (a copy is a producer's retry of a write whose acknowledgement was
	// lost with a broker; the trainer skips it by id).
	var hashes []string
	seen := map[string]bool{}
	err := pipeline.ScanTail(ctx, cfg, l.topics.Batches, 0, func(m pipeline.Message) error {
		b, err := schemas.PackedBatches.Decode(nil, m.Value)
		if err != nil {
			return fmt.Errorf("batch at %s: %w", m.Ref, err)
		}
		if !seen[b.BatchID] {
			seen[b.BatchID] = true
			h := sha256.Sum256(m.Value)
			hashes = append(hashes, hex.EncodeToString(h[:]))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := audit.Collect(ctx, cfg, l.topics)
	if err != nil {
		t.Fatal(err)
	}
	launched := l.w.launched()
	counts := rep.AccountDistinct(launched)
	p := l.w.progress()
	if rep.Copies > 0 {
		t.Logf("%d identical copies of batch messages on the batches topic (producer retries; skipped by the trainer)", rep.Copies)
	}
	if want := l.rounds * loopGroupsPerRound * loopGroupSize; counts.Launched != want {
		t.Errorf("%d attempts launched in %d rounds, want %d", counts.Launched, l.rounds, want)
	}
	if counts.Lost != 0 || counts.Duplicated != 0 || counts.Quarantined != 0 {
		t.Errorf("lost %d, duplicated %d, quarantined %d (%v); quarantine reasons %v", counts.Lost, counts.Duplicated,
			counts.Quarantined, counts, reasons(rep.Quarantined))
	}
	if !p.complete(l.rounds) {
		t.Errorf("run not complete: %+v", p)
	}
	same := len(hashes) <= len(ref) && slices.Equal(hashes, ref[:len(hashes)]) && len(hashes) == p.batches
	if !same {
		first := -1
		for i := range min(len(hashes), len(ref)) {
			if hashes[i] != ref[i] {
				first = i
				break
			}
		}
		t.Errorf("batches differ from the clean run of the same seed: %d batches (windows name %d), reference %d, first difference at %d",
			len(hashes), p.batches, len(ref), first)
	}
	if e := l.live(); e != "" {
		t.Error(e)
	}
	times, errs := l.restarts()
	for i := range l.faults {
		fr := &l.faults[i]
		end := time.Now()
		if i+1 < len(l.faults) {
			end = l.faults[i+1].At
		}
		for _, at := range times {
			if !at.Before(fr.At) && at.Before(end) {
				fr.Restarts++
			}
		}
		fr.Recovery = map[string]time.Duration{}
		var last time.Duration
		for g, d := range l.w.firstCommitAfter(fr.At) {
			fr.Recovery[stageOf(g)] = d
			last = max(last, d)
		}
		if fr.Broker {
			rate := func(from, to time.Time) float64 {
				if !to.After(from) {
					return 0
				}
				return float64(l.w.roundsDoneIn(from, to)) / to.Sub(from).Seconds()
			}
			// Rounds get cheaper as the policy learns (more groups are
			// zero-variance and filtered, fewer are trained), so the healthy
			// rate is the mean of the intervals before and after the fault.
			before, after := rate(fr.HealthyFrom, fr.At), rate(fr.HealthyAfter, fr.HealthyUntil)
			fr.HealthyRate = before
			if after > 0 {
				fr.HealthyRate = (before + after) / 2
			}
			// While one broker is down: until it is started again (its
			// start, a JVM's, competes for the machine's two cores), or,
			// for a restart that follows its stop at once, until it serves.
			end := fr.Restart
			if end.Sub(fr.At) < 10*time.Second {
				end = fr.Healed
			}
			fr.DegradedRate = rate(fr.At, end)
			fr.SteadyRate = rate(fr.At.Add(last), end)
			fr.RestartRate = rate(fr.Restart, fr.Healed)
		}
	}
	// A broker fault must never restart an operator (kills of operators
	// are SIGKILLs by the scenario, not in-place restarts).
	for _, e := range errs {
		t.Errorf("operator restarted in place: %s", e)
	}
	lr := &loopResult{Rounds: l.rounds, Batches: len(hashes), Copies: rep.Copies, SameBatches: same, Faults: l.faults,
		MaxLiveness: l.maxLive, Restarts: len(times), Watch: l.w.errorsSeen(), Load: l.load + " -> " + loadAvg()}
	dispatched, done := l.w.roundTimes()
	for i := range done {
		lr.MaxRound = max(lr.MaxRound, done[i].Sub(dispatched[i]))
	}
	if len(done) > 1 {
		lr.Rate = float64(len(done)-1) / done[len(done)-1].Sub(done[0]).Seconds()
	}
	record(t, scenarioResult{Name: l.name, Broker: "Apache Kafka 4.1, 3 nodes", Kills: l.kills, Wipes: l.wipes,
		Restarts: countBroker(l.faults), Counts: counts, Reasons: reasons(rep.Quarantined), Elapsed: time.Since(l.began), Loop: lr})
	for _, fr := range l.faults {
		t.Logf("fault %q: coordinators %v; recovery %v; rounds/s healthy %.2f, degraded %.2f (steady %.2f); restarts %d; ISR full %s after the restart",
			fr.Name, fr.Coordinators, fmtRecovery(fr.Recovery), fr.HealthyRate, fr.DegradedRate, fr.SteadyRate, fr.Restarts, fr.ISRFull.Round(100*time.Millisecond))
	}
	t.Logf("watch errors: %s", lr.Watch)
}

// loadAvg is the machine's one-minute load average.
func loadAvg() string {
	data, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(data)); err == nil && len(f) > 0 {
		return f[0]
	}
	return "?"
}

func countBroker(fs []faultRecord) int {
	n := 0
	for _, f := range fs {
		if f.Broker {
			n++
		}
	}
	return n
}

// fmtRecovery prints recovery times in pipeline order ("-": no commit
// seen after the fault).
func fmtRecovery(m map[string]time.Duration) string {
	var parts []string
	for _, s := range loopStages {
		if d, ok := m[s]; ok {
			parts = append(parts, fmt.Sprintf("%s %.1fs", s, d.Seconds()))
		} else {
			parts = append(parts, s+" -")
		}
	}
	return strings.Join(parts, ", ")
}
