//go:build integration

package integration

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Scenario timing. The whole set runs in about 12 minutes on a machine of
// two cores (make test-faults); TRAJFLOW_FAULTS_DOWN shortens the broker
// outages (CI: 20 s, about 9 minutes).
const (
	warmRounds  = 8                // rounds decided before the first fault
	healthyFor  = 6 * time.Second  // healthy interval measured before and after a fault
	brokerDown  = 40 * time.Second // a killed broker stays down this long
	pauseFor    = 20 * time.Second // a paused broker: longer than every session timeout (10 s)
	finishAfter = 3                // rounds dispatched after the faults are over
	runTimeout  = 4 * time.Minute  // the run's completion after its faults
)

// downFor is d, or TRAJFLOW_FAULTS_DOWN when that is shorter.
func downFor(d time.Duration) time.Duration {
	if v, err := time.ParseDuration(os.Getenv("TRAJFLOW_FAULTS_DOWN")); err == nil && v > 0 && v < d {
		return v
	}
	return d
}

// warm waits for the first rounds and a healthy interval; it returns the
// start of that interval.
func (l *loopRun) warm() time.Time {
	l.t.Helper()
	l.waitRounds(warmRounds, 3*time.Minute)
	from := time.Now()
	l.sleep(healthyFor)
	return from
}

// TestFaultsPackKill reproduces the pack hang: rollout is frozen (SIGSTOP)
// mid-round, so that part of a round is on the scored topic and pack's
// window is open; once pack has read it and committed what it may, pack is
// SIGKILLed and started again with its state kept, and rollout resumed.
// The round must complete (pack holds every record its open window
// decided, filtered ones too, so they are redelivered to the new pack),
// and nothing of the open window may have been committed.
func TestFaultsPackKill(t *testing.T) {
	ref := cleanReference()
	l := startLoop(t, "pack SIGKILL mid-window, state kept", "trajectories", "scored")
	l.waitRounds(3, 3*time.Minute)
	scored := l.topics.Scored
	var round int64
	var onScored []int64
	for attempt := 0; ; attempt++ {
		if attempt == 20 {
			t.Fatal("rollout could not be frozen mid-round in 20 attempts")
		}
		// The next round's first trajectories freeze both rollout instances.
		round = int64(l.w.progress().dispatched)
		deadline := time.Now().Add(time.Minute)
		for {
			if offs, _, _ := l.w.located(l.topics.Trajectories, round); len(offs) > 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no trajectories of round %d after 1 minute: %+v", round, l.w.progress())
			}
			time.Sleep(2 * time.Millisecond)
		}
		l.signal("rollout-0", syscall.SIGSTOP)
		l.signal("rollout-1", syscall.SIGSTOP)
		// What rollout produced flows on to the scored topic.
		stable, prevEnd := time.Now(), int64(-1)
		for time.Since(stable) < 1500*time.Millisecond {
			if _, _, end := l.w.located(scored, round); end != prevEnd {
				stable, prevEnd = time.Now(), end
			}
			time.Sleep(50 * time.Millisecond)
		}
		var groups int
		onScored, groups, _ = l.w.located(scored, round)
		if len(onScored) > 0 && groups < loopGroupsPerRound {
			t.Logf("rollout frozen in round %d: %d of %d groups on %s (offsets %d-%d)", round, groups, loopGroupsPerRound,
				scored, onScored[0], onScored[len(onScored)-1])
			break
		}
		t.Logf("attempt %d: %d groups of round %d on the scored topic; trying the next round", attempt, groups, round)
		l.signal("rollout-0", syscall.SIGCONT)
		l.signal("rollout-1", syscall.SIGCONT)
		l.waitRounds(int(round)+1, 2*time.Minute)
	}
	// Pack has read everything on the scored topic (its lag is 0) and
	// committed what it may: its committed offset stops moving.
	addr := l.healthOf("pack-0")
	deadline := time.Now().Add(30 * time.Second)
	for lag := int64(-1); lag != 0; lag = consumerLag(t, addr, scored) {
		if time.Now().After(deadline) {
			t.Fatalf("pack's lag on %s is %d after 30 s", scored, lag)
		}
		time.Sleep(100 * time.Millisecond)
	}
	committed, since := l.w.committed(l.runID+".pack", scored, 0), time.Now()
	for time.Since(since) < 2*time.Second {
		if c := l.w.committed(l.runID+".pack", scored, 0); c != committed {
			committed, since = c, time.Now()
		}
		time.Sleep(100 * time.Millisecond)
	}
	first := onScored[0]
	t.Logf("pack committed %s/0 up to %d; the open window's records start at %d", scored, committed, first)
	if committed > first {
		t.Errorf("pack committed offset %d past the first record (%d) of its open window", committed, first)
	}
	at := time.Now()
	l.killOperator("pack-0", false)
	l.signal("rollout-0", syscall.SIGCONT)
	l.signal("rollout-1", syscall.SIGCONT)
	l.faults = append(l.faults, faultRecord{Name: fmt.Sprintf("pack SIGKILL, round %d half on scored, rollout frozen", round), At: at})
	l.waitRounds(int(round)+1, 2*time.Minute)
	t.Logf("round %d decided %s after the pack kill", round, time.Since(at).Round(time.Millisecond))
	l.finish(finishAfter, runTimeout)
	l.check(ref.wait(t))
}

// healthOf is the health address of an instance.
func (l *loopRun) healthOf(inst string) string {
	l.t.Helper()
	l.f.mu.Lock()
	p := l.f.procs[inst]
	l.f.mu.Unlock()
	addr, err := healthAddr(p, 30*time.Second)
	if err != nil {
		l.t.Fatal(err)
	}
	return addr
}

// consumerLag reads trajflow_consumer_lag_records of topic partition 0 from an
// operator's /metrics (-1: not reported yet).
func consumerLag(t *testing.T, addr, topic string) int64 {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "trajflow_consumer_lag_records{") && strings.Contains(line, `topic="`+topic+`"`) &&
			strings.Contains(line, `partition="0"`) {
			f := strings.Fields(line)
			v, err := strconv.ParseFloat(f[len(f)-1], 64)
			if err == nil {
				return int64(v)
			}
		}
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return -1
}

// TestFaultsKillLeader SIGKILLs the leader of the busiest partition (the
// scored topic's, which every record of the loop crosses on its way to
// pack), keeps it down and starts it again.
func TestFaultsKillLeader(t *testing.T) {
	ref := cleanReference()
	ref.wait(t) // a quiet machine for the measurements
	l := startLoop(t, "SIGKILL the scored/batches leader")
	from := l.warm()
	node := l.leaderOf(l.topics.Scored)
	name := fmt.Sprintf("SIGKILL node %s (leads scored/0", node)
	if b := l.leaderOf(l.topics.Batches); b == node {
		name += " and batches/0"
	}
	if c := strings.TrimSpace(clusterScript(t, "controller")); c == node {
		name += ", active controller"
	}
	l.brokerFault(name+")", node, "kill", downFor(brokerDown), from, nil)
	l.finish(finishAfter, runTimeout)
	l.check(ref.wait(t))
}

// TestFaultsKillController SIGKILLs the active KRaft controller (the
// quorum elects another before the dead broker is fenced).
func TestFaultsKillController(t *testing.T) {
	ref := cleanReference()
	ref.wait(t)
	l := startLoop(t, "SIGKILL the active controller")
	from := l.warm()
	node := strings.TrimSpace(clusterScript(t, "controller"))
	l.brokerFault(fmt.Sprintf("SIGKILL node %s (active controller%s)", node, l.leads(node)), node, "kill", downFor(brokerDown), from, nil)
	l.finish(finishAfter, runTimeout)
	l.check(ref.wait(t))
}

// TestFaultsKillCoordinator SIGKILLs the node coordinating the pack
// consumer group (every group of a run hashes to one __consumer_offsets
// partition or another; pack's is the one whose commits gate the round):
// the groups it coordinated find the new coordinator and commit again.
func TestFaultsKillCoordinator(t *testing.T) {
	ref := cleanReference()
	ref.wait(t)
	l := startLoop(t, "SIGKILL the groups' coordinator")
	from := l.warm()
	node := l.coordinators()["pack"]
	if node == "" {
		t.Fatal("no coordinator found for the pack group")
	}
	l.brokerFault(fmt.Sprintf("SIGKILL node %s (coordinates pack%s)", node, l.leads(node)), node, "kill", downFor(brokerDown), from, nil)
	l.finish(finishAfter, runTimeout)
	l.check(ref.wait(t))
}

// TestFaultsKillFirstBroker SIGKILLs the first broker of --brokers: every
// client path bootstraps from any of the three.
func TestFaultsKillFirstBroker(t *testing.T) {
	ref := cleanReference()
	ref.wait(t)
	l := startLoop(t, "SIGKILL the first listed broker")
	from := l.warm()
	l.brokerFault("SIGKILL node 1 (first in --brokers"+l.leads("1")+")", "1", "kill", downFor(brokerDown), from, nil)
	l.finish(finishAfter, runTimeout)
	l.check(ref.wait(t))
}

// leads names what node leads among the loop's busiest partitions.
func (l *loopRun) leads(node string) string {
	var out []string
	for _, tp := range []string{l.topics.Scored, l.topics.Batches} {
		if l.leaderOf(tp) == node {
			out = append(out, strings.TrimPrefix(tp, l.runID+".")+"/0")
		}
	}
	if len(out) == 0 {
		return ""
	}
	return ", leads " + strings.Join(out, " and ")
}

// TestFaultsPauseBroker SIGSTOPs the scored leader longer than every
// session timeout (a hung broker: its sockets stay open, nothing answers)
// and resumes it.
func TestFaultsPauseBroker(t *testing.T) {
	ref := cleanReference()
	ref.wait(t)
	l := startLoop(t, "SIGSTOP the scored leader 20 s")
	from := l.warm()
	node := l.leaderOf(l.topics.Scored)
	l.brokerFault(fmt.Sprintf("SIGSTOP node %s (%s)", node, strings.TrimPrefix(l.leads(node), ", ")), node, "pause", downFor(pauseFor), from, nil)
	l.finish(finishAfter, runTimeout)
	l.check(ref.wait(t))
}

// rolling restarts the three brokers one after the other (controlled
// shutdown, start, full ISRs), running during(node) right after each stop.
func (l *loopRun) rolling(from time.Time, during func(node string)) {
	for _, node := range []string{"1", "2", "3"} {
		var d func()
		if during != nil {
			d = func() { during(node) }
		}
		from = l.brokerFault(fmt.Sprintf("rolling restart: stop node %s%s", node, l.leads(node)), node, "stop", 0, from, d)
	}
}

// TestFaultsRollingRestart restarts the three brokers one after the other
// while the loop runs.
func TestFaultsRollingRestart(t *testing.T) {
	ref := cleanReference()
	ref.wait(t)
	l := startLoop(t, "rolling restart of the three brokers")
	l.rolling(l.warm(), nil)
	l.finish(finishAfter, runTimeout)
	l.check(ref.wait(t))
}

// TestFaultsKillLeaderAndOperators: the scored leader SIGKILLed and, while
// it is down, pack (state kept), advantage (state wiped) and a rollout
// instance SIGKILLed and restarted.
func TestFaultsKillLeaderAndOperators(t *testing.T) {
	ref := cleanReference()
	l := startLoop(t, "SIGKILL the scored leader + 3 operator kills")
	from := l.warm()
	node := l.leaderOf(l.topics.Scored)
	l.brokerFault(fmt.Sprintf("SIGKILL node %s%s + pack, advantage (wiped), rollout", node, l.leads(node)), node, "kill",
		downFor(brokerDown)*3/4, from, func() {
			l.sleep(2 * time.Second)
			l.killOperator("pack-0", false)
			l.sleep(4 * time.Second)
			l.killOperator("advantage-0", true)
			l.sleep(4 * time.Second)
			l.killOperator("rollout-1", false)
		})
	l.finish(finishAfter, runTimeout)
	l.check(ref.wait(t))
}

// TestFaultsPauseBrokerAndOperators: the scored leader SIGSTOPped and,
// meanwhile, reward and train (state wiped) SIGKILLed and restarted.
func TestFaultsPauseBrokerAndOperators(t *testing.T) {
	ref := cleanReference()
	l := startLoop(t, "SIGSTOP the scored leader + 2 operator kills")
	from := l.warm()
	node := l.leaderOf(l.topics.Scored)
	l.brokerFault(fmt.Sprintf("SIGSTOP node %s%s + reward, train (wiped)", node, l.leads(node)), node, "pause",
		downFor(pauseFor), from, func() {
			l.sleep(3 * time.Second)
			l.killOperator("reward-0", false)
			l.sleep(5 * time.Second)
			l.killOperator("train-0", true)
		})
	l.finish(finishAfter, runTimeout)
	l.check(ref.wait(t))
}

// TestFaultsRollingRestartAndOperators: a rolling restart with an operator
// SIGKILLed during each broker's restart: validate, dispatch (wiped), pack
// (wiped).
func TestFaultsRollingRestartAndOperators(t *testing.T) {
	ref := cleanReference()
	l := startLoop(t, "rolling restart + 3 operator kills")
	victims := map[string][2]string{"1": {"validate-0", ""}, "2": {"dispatch-0", "wipe"}, "3": {"pack-0", "wipe"}}
	l.rolling(l.warm(), func(node string) {
		v := victims[node]
		l.sleep(time.Second)
		l.killOperator(v[0], v[1] == "wipe")
	})
	l.finish(finishAfter, runTimeout)
	l.check(ref.wait(t))
}
