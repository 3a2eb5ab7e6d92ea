package deploytest

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/deploy/k8s"
	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Paths inside the containers of deploy/k8s (and of the image).
const (
	contractPath = "/etc/trajflow/contract/contract.yaml"
	dataDir      = "/var/lib/trajflow"
	releasesDir  = "/var/lib/trajflow/releases"
)

// proc is one running operator: a process or a container.
type proc struct {
	pid  func() int   // the operator's pid (0 when gone)
	term func() error // SIGTERM (graceful stop)
	kill func()
	done chan struct{} // closed on exit
	err  error         // the exit status, after done
}

// launcher starts `trajflow ARGS...` for an instance whose data directory
// (the manifests' /var/lib/trajflow) is dir and whose releases directory is
// shared by the fleet.
type launcher interface {
	start(t testing.TB, name string, args []string, dir, logPath string) (*proc, error)
	// path maps a path of the manifests to the one the launched operator sees.
	path(p, dir string) string
}

// processLauncher runs operators as processes of a locally built binary.
type processLauncher struct {
	bin, contractDir, releases string
}

func (l processLauncher) path(p, dir string) string {
	switch {
	case p == contractPath:
		return filepath.Join(l.contractDir, "contract.yaml")
	case strings.HasPrefix(p, releasesDir):
		return l.releases + strings.TrimPrefix(p, releasesDir)
	case strings.HasPrefix(p, dataDir):
		return dir + strings.TrimPrefix(p, dataDir)
	}
	return p
}

func (l processLauncher) start(t testing.TB, name string, args []string, dir, logPath string) (*proc, error) {
	lf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(l.bin, args...)
	cmd.Stdout, cmd.Stderr = lf, lf
	if err := cmd.Start(); err != nil {
		lf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{done: make(chan struct{})}
	p.pid = func() int { return cmd.Process.Pid }
	p.term = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	p.kill = func() { _ = cmd.Process.Kill() }
	go func() {
		p.err = cmd.Wait()
		lf.Close()
		close(p.done)
	}()
	return p, nil
}

// buildBinary builds cmd/trajflow into a temporary directory.
func buildBinary(t testing.TB) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "trajflow")
	out, err := exec.Command("go", "build", "-o", bin, "../../cmd/trajflow").CombinedOutput()
	if err != nil {
		t.Fatalf("build trajflow: %v\n%s", err, out)
	}
	return bin
}

// manifest is what the fleet takes from the base manifests of deploy/k8s
// for one stage: the container's arguments and how a rolling update
// replaces its pods.
type manifest struct {
	stage string
	args  []string
	surge bool          // start the new instance before stopping the old
	grace time.Duration // terminationGracePeriodSeconds
}

// baseManifests renders deploy/k8s/base and returns every stage's manifest.
func baseManifests(t testing.TB) map[string]manifest {
	t.Helper()
	data, err := k8s.Render("../../deploy/k8s/base")
	if err != nil {
		t.Fatal(err)
	}
	set, err := k8s.Decode(data, nil)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]manifest{}
	for _, w := range set.Workloads() {
		c := w.Pod.Spec.Containers[0]
		st := k8s.StageOf(c)
		g := 30 * time.Second
		if p := w.Pod.Spec.TerminationGracePeriodSeconds; p != nil {
			g = time.Duration(*p) * time.Second
		}
		out[st] = manifest{stage: st, args: c.Args, surge: w.Surge, grace: g}
	}
	return out
}

// instance is one operator of the fleet.
type instance struct {
	stage, name, dir string
	health           string // host:port of /healthz, /readyz, /metrics
	log              string
	p                *proc
	started          time.Time
}

// usage is what an instance used over its life (from /proc).
type usage struct {
	cpu    time.Duration // user + system
	life   time.Duration
	peakKB int64 // VmHWM
}

// fleet runs the operators of one run.
type fleet struct {
	t         testing.TB
	l         launcher
	man       map[string]manifest
	brokers   string
	dir       string
	extra     map[string][]string // extra arguments per stage
	mu        sync.Mutex
	insts     map[string]*instance
	seq       int
	usage     map[string][]usage // by stage
	gracefuls int
}

func newFleet(t testing.TB, l launcher, man map[string]manifest, brokers string) *fleet {
	f := &fleet{t: t, l: l, man: man, brokers: brokers, dir: t.TempDir(), extra: map[string][]string{},
		insts: map[string]*instance{}, usage: map[string][]usage{}}
	t.Cleanup(f.stopAll)
	return f
}

// freePort returns a port of 127.0.0.1 that is free now.
func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// args turns the manifest's container arguments into this instance's:
// $(KAFKA_BROKERS) and $(POD_NAME) expanded as the kubelet expands them,
// the health address on a free port of 127.0.0.1 (every instance shares
// the host's network), paths mapped by the launcher.
func (f *fleet) args(m manifest, name, dir, health string) []string {
	out := make([]string, 0, len(m.args)+4)
	for i := 0; i < len(m.args); i++ {
		a := m.args[i]
		a = strings.ReplaceAll(a, "$(KAFKA_BROKERS)", f.brokers)
		a = strings.ReplaceAll(a, "$(POD_NAME)", name)
		if i > 0 && m.args[i-1] == "--health" {
			a = health
		}
		if strings.HasPrefix(a, "/") {
			a = f.l.path(a, dir)
		}
		out = append(out, a)
	}
	return append(out, f.extra[m.stage]...)
}

// start launches stage as instance name with its data directory dir
// (created when missing; kept across restarts for a StatefulSet's pod).
func (f *fleet) start(stage, name string) *instance {
	f.t.Helper()
	m, ok := f.man[stage]
	if !ok {
		f.t.Fatalf("no manifest runs %s", stage)
	}
	dir := filepath.Join(f.dir, "data", name)
	if err := os.MkdirAll(dir, 0o777); err != nil {
		f.t.Fatal(err)
	}
	_ = os.Chmod(dir, 0o777) // a container's user (65532) writes here
	f.mu.Lock()
	f.seq++
	n := f.seq
	f.mu.Unlock()
	health := fmt.Sprintf("127.0.0.1:%d", freePort(f.t))
	in := &instance{stage: stage, name: name, dir: dir, health: health,
		log: filepath.Join(f.dir, fmt.Sprintf("%02d-%s.log", n, name)), started: time.Now()}
	p, err := f.l.start(f.t, name, f.args(m, name, dir, health), dir, in.log)
	if err != nil {
		f.t.Fatal(err)
	}
	in.p = p
	f.mu.Lock()
	f.insts[name] = in
	f.mu.Unlock()
	return in
}

// probe GETs path on the instance's health address.
func probe(in *instance, path string) (int, string) {
	cl := http.Client{Timeout: 3 * time.Second}
	resp, err := cl.Get("http://" + in.health + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b))
}

// waitReady waits until /readyz answers 200 (the readiness probe) and
// /healthz answers 200 (the liveness probe).
func (f *fleet) waitReady(in *instance, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	last := ""
	for time.Now().Before(deadline) {
		select {
		case <-in.p.done:
			return fmt.Errorf("%s exited before it was ready: %v\n%s", in.name, in.p.err, tail(in.log, 20))
		default:
		}
		code, body := probe(in, "/readyz")
		if code == http.StatusOK {
			if hc, hb := probe(in, "/healthz"); hc != http.StatusOK {
				return fmt.Errorf("%s: ready but /healthz = %d %q", in.name, hc, hb)
			}
			return nil
		}
		last = fmt.Sprintf("%d %s", code, body)
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("%s: /readyz not 200 after %s (last: %s)\n%s", in.name, timeout, last, tail(in.log, 20))
}

// stop ends an instance as the kubelet does: SIGTERM, then SIGKILL after
// the grace period. It fails unless the operator exited by itself, with
// status 0, within the grace period.
func (f *fleet) stop(in *instance) error {
	grace := f.man[in.stage].grace
	f.mu.Lock()
	delete(f.insts, in.name)
	f.mu.Unlock()
	u := f.sample(in)
	if err := in.p.term(); err != nil {
		return fmt.Errorf("SIGTERM %s: %w", in.name, err)
	}
	t0 := time.Now()
	select {
	case <-in.p.done:
	case <-time.After(grace):
		in.p.kill()
		<-in.p.done
		return fmt.Errorf("%s did not exit within its grace period %s after SIGTERM\n%s", in.name, grace, tail(in.log, 20))
	}
	f.mu.Lock()
	f.usage[in.stage] = append(f.usage[in.stage], u)
	f.gracefuls++
	f.mu.Unlock()
	if in.p.err != nil {
		return fmt.Errorf("%s exited with %v after SIGTERM\n%s", in.name, in.p.err, tail(in.log, 20))
	}
	f.t.Logf("%s stopped in %s (exit 0)", in.name, time.Since(t0).Round(time.Millisecond))
	return nil
}

// sample reads the instance's CPU time and peak RSS from /proc.
func (f *fleet) sample(in *instance) usage {
	u := usage{life: time.Since(in.started)}
	pid := in.p.pid()
	if pid <= 0 {
		return u
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil {
		// Fields after the command (in parentheses): utime and stime are
		// fields 14 and 15 of the line, in clock ticks (100 Hz on Linux).
		s := string(b)
		if i := strings.LastIndexByte(s, ')'); i > 0 {
			fs := strings.Fields(s[i+1:])
			if len(fs) > 13 {
				ut, _ := strconv.ParseInt(fs[11], 10, 64)
				st, _ := strconv.ParseInt(fs[12], 10, 64)
				u.cpu = time.Duration(ut+st) * 10 * time.Millisecond
			}
		}
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
				u.peakKB, _ = strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			}
		}
	}
	return u
}

// stopAll stops whatever still runs (after a failure), without judging it.
func (f *fleet) stopAll() {
	f.mu.Lock()
	var all []*instance
	for _, in := range f.insts {
		all = append(all, in)
	}
	f.insts = map[string]*instance{}
	f.mu.Unlock()
	for _, in := range all {
		_ = in.p.term()
	}
	for _, in := range all {
		select {
		case <-in.p.done:
		case <-time.After(60 * time.Second):
			in.p.kill()
			<-in.p.done
		}
	}
	if f.t.Failed() {
		logs, _ := filepath.Glob(filepath.Join(f.dir, "*.log"))
		for _, l := range logs {
			f.t.Logf("--- %s\n%s", filepath.Base(l), tail(l, 15))
		}
	}
}

// exited lists instances that ended by themselves.
func (f *fleet) exited() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, in := range f.insts {
		select {
		case <-in.p.done:
			out = append(out, fmt.Sprintf("%s exited: %v\n%s", in.name, in.p.err, tail(in.log, 15)))
		default:
		}
	}
	return out
}

// rollingRestart replaces inst the way its manifest's update strategy
// does: a Deployment with surge starts a new pod (a new name, a fresh data
// directory), waits for its readiness and then stops the old one; Recreate
// and a StatefulSet stop the old pod first and start its successor with the
// same name and data directory (the pod's volume claim).
func (f *fleet) rollingRestart(in *instance, newName string, ready time.Duration) (*instance, error) {
	if f.man[in.stage].surge {
		next := f.start(in.stage, newName)
		if err := f.waitReady(next, ready); err != nil {
			return next, err
		}
		return next, f.stop(in)
	}
	if err := f.stop(in); err != nil {
		return nil, err
	}
	next := f.start(in.stage, in.name)
	return next, f.waitReady(next, ready)
}

func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// runProgress is how far a run got: groups decided by pack (window
// records), batches made, the newest released policy version, and the
// distinct groups dispatched (tasks topic, keyed by group id).
type runProgress struct {
	decided, batches, dispatched int
	version                      int64
}

func progress(ctx context.Context, cfg *pipeline.Config, topics pipeline.Topics) (runProgress, error) {
	p := runProgress{version: -1}
	// Counted as sets: a window record can reach the topic twice (a
	// producer's retry after a lost acknowledgement; a restarted pack
	// deciding again a window whose batch it had not written), and the
	// stages downstream take the second copy as the duplicate it is.
	decided, batches := map[string]bool{}, map[string]bool{}
	err := pipeline.ScanTail(ctx, cfg, topics.Windows, 0, func(m pipeline.Message) error {
		w, err := schemas.DecodeWindow(m.Value)
		if err != nil {
			return err
		}
		for _, g := range w.Groups {
			decided[g] = true
		}
		if w.BatchID != "" {
			batches[w.BatchID] = true
		}
		return nil
	})
	p.decided, p.batches = len(decided), len(batches)
	if err != nil {
		return p, err
	}
	err = pipeline.ScanTail(ctx, cfg, topics.Policy, 0, func(m pipeline.Message) error {
		if rel, err := schemas.DecodeRelease(m.Value); err == nil {
			p.version = max(p.version, rel.PolicyVersion)
		}
		return nil
	})
	if err != nil {
		return p, err
	}
	groups := map[string]bool{}
	err = pipeline.ScanTail(ctx, cfg, topics.Tasks, 0, func(m pipeline.Message) error {
		groups[string(m.Key)] = true
		return nil
	})
	p.dispatched = len(groups)
	return p, err
}

// uniqueRun names a run uniquely (a real cluster keeps topics between runs).
func uniqueRun(prefix string) string {
	return fmt.Sprintf("%s-%d-%04d", prefix, time.Now().Unix()%1_000_000, rand.IntN(10000))
}

// writeContract writes testdata/contracts/demo.yaml with run_id runID into
// dir/contract.yaml: the in-process demo with RunID runID runs the same
// contract (same hash, same batches).
func writeContract(t testing.TB, dir, runID string) {
	t.Helper()
	src, err := os.ReadFile("../../testdata/contracts/demo.yaml")
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Replace(string(src), "\nrun_id: demo\n", "\nrun_id: "+runID+"\n", 1)
	if !strings.Contains(s, "run_id: "+runID) {
		t.Fatal("demo contract has no run_id line")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "contract.yaml"), []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

// clusterBrokers is TRAJFLOW_KAFKA_CLUSTER (deploy/local/cluster.sh env), or "".
func clusterBrokers(t testing.TB) string {
	addrs := os.Getenv("TRAJFLOW_KAFKA_CLUSTER")
	for _, a := range strings.Split(addrs, ",") {
		if a == "" {
			continue
		}
		c, err := net.DialTimeout("tcp", a, 5*time.Second)
		if err != nil {
			t.Fatalf("TRAJFLOW_KAFKA_CLUSTER %s: %v (deploy/local/cluster.sh up)", a, err)
		}
		c.Close()
	}
	return addrs
}

// rollingScenario is TestRollingRestart's body, for processes and
// containers alike: start the fleet of the base manifests, restart every
// instance once while rounds run, stop dispatch, let the rest drain, and
// account. topicsCreate creates the run's topics.
func rollingScenario(t *testing.T, f *fleet, runID string, topicsCreate func()) {
	start := time.Now()
	topicsCreate()
	cfg := &pipeline.Config{Brokers: strings.Split(f.brokers, ",")}
	topics, err := pipeline.TopicsFor(runID)
	if err != nil {
		t.Fatal(err)
	}
	// Two instances of validate and reward, one of each other stage (the
	// manifests' dispatch waits for the gate: eval and gate run too).
	names := map[string][]string{}
	var order []*instance
	for _, st := range []string{"dispatch", "rollout", "validate", "validate", "reward", "reward", "advantage", "pack", "train", "eval", "gate", "snapshot"} {
		name := fmt.Sprintf("%s-%d", st, len(names[st]))
		names[st] = append(names[st], name)
		order = append(order, f.start(st, name))
	}
	for _, in := range order {
		if err := f.waitReady(in, 90*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("fleet of %d operators ready after %s", len(order), time.Since(start).Round(time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	waitVersion := func(v int64, timeout time.Duration) runProgress {
		deadline := time.Now().Add(timeout)
		for {
			p, err := progress(ctx, cfg, topics)
			if err == nil && p.version >= v {
				return p
			}
			if time.Now().After(deadline) {
				t.Fatalf("policy version %d not released after %s (progress %+v, err %v); exited: %v", v, timeout, p, err, f.exited())
			}
			time.Sleep(300 * time.Millisecond)
		}
	}
	p := waitVersion(2, 3*time.Minute)
	restarts := 0
	for i, in := range order {
		before := p.version
		next, err := f.rollingRestart(in, fmt.Sprintf("%s-r%d", in.stage, i), 90*time.Second)
		if err != nil {
			t.Fatalf("rolling restart of %s: %v", in.name, err)
		}
		order[i] = next
		restarts++
		// The loop goes on after each restart: one more release.
		p = waitVersion(before+1, 3*time.Minute)
		t.Logf("restarted %s as %s; policy version %d, %d groups decided", in.name, next.name, p.version, p.decided)
	}
	if ex := f.exited(); len(ex) > 0 {
		t.Fatalf("operators exited by themselves:\n%s", strings.Join(ex, "\n"))
	}
	// Stop dispatching, then wait until every dispatched group is decided
	// and every batch trained.
	if err := f.stop(order[0]); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Minute)
	for {
		p, err = progress(ctx, cfg, topics)
		if err == nil && p.decided == p.dispatched && p.version == int64(p.batches) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("run did not drain: %+v (err %v)", p, err)
		}
		time.Sleep(300 * time.Millisecond)
	}
	for _, in := range order[1:] {
		if err := f.stop(in); err != nil {
			t.Error(err)
		}
	}
	launched, err := loop.Launched(ctx, cfg, topics)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := audit.Collect(ctx, cfg, topics)
	if err != nil {
		t.Fatal(err)
	}
	counts := rep.Account(launched)
	hashes, err := loop.BatchHashes(ctx, cfg, topics)
	if err != nil {
		t.Fatal(err)
	}
	rounds := p.dispatched / 16
	t.Logf("rolling restart: %d operators restarted one by one, %d graceful stops; %d rounds, %d batches; %v (%s)",
		restarts, f.gracefuls, rounds, len(hashes), counts, time.Since(start).Round(time.Second))
	f.logUsage()
	if p.dispatched != rounds*16 {
		t.Fatalf("%d groups dispatched: not whole rounds of 16", p.dispatched)
	}
	if counts.Lost != 0 || counts.Duplicated != 0 || counts.Launched != rounds*16*16 {
		t.Fatalf("accounting after the rolling restart: %v (want %d launched, lost 0, duplicated 0); first lost %v",
			counts, rounds*16*16, counts.LostIDs[:min(5, len(counts.LostIDs))])
	}
	want := demo(t, runID, rounds)
	if len(hashes) != len(want.BatchHashes) {
		t.Fatalf("%d batches, the in-process demo of %d rounds made %d", len(hashes), rounds, len(want.BatchHashes))
	}
	for i := range hashes {
		if hashes[i] != want.BatchHashes[i] {
			t.Fatalf("batch %d differs from the uninterrupted in-process demo", i)
		}
	}
}

// demo runs the in-process loop of the same contract and run id.
func demo(t *testing.T, runID string, rounds int) *loop.Summary {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// EvalSamples 4: the manifests' eval runs with the default --eval-samples.
	s, err := loop.Run(ctx, loop.Options{Updates: rounds, Seed: 1, RunID: runID, Out: t.TempDir(), EvalSamples: 4, Quiet: true}, io.Discard)
	if err != nil {
		t.Fatalf("demo: %v", err)
	}
	if s.Lost != 0 || s.DuplicatesAdmitted != 0 {
		t.Fatalf("demo: lost %d, duplicates %d", s.Lost, s.DuplicatesAdmitted)
	}
	return s
}

// logUsage prints each stage's CPU time per second of life and peak RSS.
func (f *fleet) logUsage() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, st := range []string{"dispatch", "rollout", "validate", "reward", "advantage", "pack", "train", "snapshot"} {
		var b strings.Builder
		for _, u := range f.usage[st] {
			if u.life <= 0 {
				continue
			}
			fmt.Fprintf(&b, " [%.3f cores over %s, peak RSS %d MB]", u.cpu.Seconds()/u.life.Seconds(), u.life.Round(time.Second), u.peakKB/1024)
		}
		f.t.Logf("usage %-9s%s", st, b.String())
	}
}
