// Package integration runs trajflow's operators as separate processes
// against a broker — the embedded one (`trajflow broker`, in the default
// test run) or real Apache Kafka (build tag "integration", address in
// TRAJFLOW_KAFKA; see deploy/local/kafka.sh) — and injects faults: SIGKILL
// of operators at random moments with restarts (some after deleting the
// operator's state directory), broker restarts, consumer-group rebalances,
// failing reward evaluators, malformed records on every data-plane topic.
// Every scenario accounts for each launched attempt (internal/audit):
// admitted exactly once, filtered or quarantined with a reason; lost and
// duplicated must be 0 (docs/SYSTEMS.md §14: at-least-once delivery with
// deduplication, nothing silently duplicated).
package integration

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// binPath is the trajflow binary built once by TestMain.
var binPath string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "trajflow-it-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	binPath = filepath.Join(dir, "trajflow")
	build := exec.Command("go", "build", "-o", binPath, "../cmd/trajflow")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build trajflow:", err)
		os.Exit(2)
	}
	code := m.Run()
	if err := writeReport(); err != nil {
		fmt.Fprintln(os.Stderr, "report:", err)
		code = 1
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

// runContract writes a copy of testdata/contracts/conformance.yaml with
// run_id set to runID (real Kafka keeps topics between tests, so every
// scenario gets its own run) and extra appended, and returns its path and
// resolved contract.
func runContract(t testing.TB, runID, extra string) (string, *contract.Contract) {
	t.Helper()
	src, err := os.ReadFile("../testdata/contracts/conformance.yaml")
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Replace(string(src), "run_id: conformance", "run_id: "+runID, 1)
	if !strings.Contains(s, "run_id: "+runID) {
		t.Fatal("conformance contract has no run_id line")
	}
	path := filepath.Join(t.TempDir(), "contract.yaml")
	if err := os.WriteFile(path, []byte(s+extra), 0o644); err != nil {
		t.Fatal(err)
	}
	return path, testkit.LoadContract(t, path)
}

// uniqueRun names a run uniquely (real Kafka keeps topics between runs).
func uniqueRun(prefix string) string {
	return fmt.Sprintf("%s-%d-%04d", prefix, time.Now().Unix()%1_000_000, rand.IntN(10000))
}

// proc is one operator process.
type proc struct {
	name, inst, state string
	args              []string
	cmd               *exec.Cmd
	done              chan struct{}
	err               error
	log               string
}

// fleet starts, kills and restarts operator processes of one run.
type fleet struct {
	t            testing.TB
	brokers      string
	contractPath string
	clientConfig string // --client-config, optional
	// stageArgs are the flags every instance gets after its identity
	// (those of one stage only by that stage: argsOf)
	// (newFleet: a 5 s partial-group timeout, pack windows closed after
	// 1 s); extraArgs follow them.
	stageArgs []string
	extraArgs []string
	dir       string

	mu     sync.Mutex
	procs  map[string]*proc // by instance
	kills  int
	wipes  int
	starts int
}

func newFleet(t testing.TB, brokers, contractPath string) *fleet {
	f := &fleet{t: t, brokers: brokers, contractPath: contractPath, dir: t.TempDir(), procs: map[string]*proc{},
		stageArgs: []string{"--partial-group-timeout", "5s", "--window-max-wait", "1s", "--log-level", "info"}}
	t.Cleanup(f.stopAll)
	return f
}

// stageOnly are the flags of trajflow run that one stage alone takes
// (the others refuse them), with that stage.
var stageOnly = map[string]string{"--partial-group-timeout": "advantage", "--window-max-wait": "pack",
	"--snapshot-dir": "snapshot", "--snapshot-roll-bytes": "snapshot", "--snapshot-roll-interval": "snapshot",
	"--eval-samples": "eval", "--device": "train"}

// argsOf is args, flag-value pairs, without the flags of stages other
// than stage.
func argsOf(stage string, args []string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		if only, ok := stageOnly[args[i]]; ok && only != stage {
			i++ // and its value
			continue
		}
		out = append(out, args[i])
	}
	return out
}

// start launches `trajflow run name` as instance inst (state directory
// kept per instance, so a restart finds the previous state unless wiped).
func (f *fleet) start(name, inst string) *proc {
	f.t.Helper()
	state := filepath.Join(f.dir, "state", inst)
	args := []string{"run", name, "--contract", f.contractPath, "--state", state,
		"--instance", inst, "--health", "127.0.0.1:0"}
	if f.clientConfig != "" {
		// The file names the brokers (its listener), which trajflow run
		// refuses beside a --brokers naming others.
		args = append(args, "--client-config", f.clientConfig)
	} else {
		args = append(args, "--brokers", f.brokers)
	}
	args = append(args, argsOf(name, f.stageArgs)...)
	args = append(args, argsOf(name, f.extraArgs)...)
	f.mu.Lock()
	f.starts++
	n := f.starts
	f.mu.Unlock()
	logPath := filepath.Join(f.dir, fmt.Sprintf("%s.%d.log", inst, n))
	lf, err := os.Create(logPath)
	if err != nil {
		f.t.Fatal(err)
	}
	cmd := exec.Command(binPath, args...)
	cmd.Stdout, cmd.Stderr = lf, lf
	if err := cmd.Start(); err != nil {
		f.t.Fatalf("start %s: %v", inst, err)
	}
	p := &proc{name: name, inst: inst, state: state, args: args, cmd: cmd, done: make(chan struct{}), log: logPath}
	go func() {
		p.err = cmd.Wait()
		lf.Close()
		close(p.done)
	}()
	f.mu.Lock()
	f.procs[inst] = p
	f.mu.Unlock()
	return p
}

// kill sends SIGKILL to the instance and waits for it to die.
func (f *fleet) kill(inst string) {
	f.mu.Lock()
	p := f.procs[inst]
	f.kills++
	f.mu.Unlock()
	if p == nil {
		f.t.Fatalf("kill: no instance %s", inst)
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// restart starts inst again, after deleting its state directory if wipe.
func (f *fleet) restart(inst string, wipe bool) {
	f.mu.Lock()
	p := f.procs[inst]
	if wipe {
		f.wipes++
	}
	f.mu.Unlock()
	if wipe {
		if err := os.RemoveAll(p.state); err != nil {
			f.t.Fatalf("wipe %s: %v", p.state, err)
		}
	}
	f.start(p.name, inst)
}

// stop ends inst gracefully (SIGTERM), waiting up to 40 s.
func (f *fleet) stop(inst string) {
	f.mu.Lock()
	p := f.procs[inst]
	delete(f.procs, inst)
	f.mu.Unlock()
	if p == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(40 * time.Second):
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		<-p.done
		f.t.Errorf("instance %s did not stop within 40s after SIGTERM", inst)
	}
}

// exited reports instances that ended by themselves (not killed or
// stopped by the test), with the tail of their logs.
func (f *fleet) exited() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for inst, p := range f.procs {
		select {
		case <-p.done:
			out = append(out, fmt.Sprintf("%s exited: %v\n%s", inst, p.err, tail(p.log, 15)))
		default:
		}
	}
	sort.Strings(out)
	return out
}

// exitedFailing is exited without the operators that exited 0: one run
// with --rounds exits 0 by itself once that run is done and drained.
func (f *fleet) exitedFailing() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for inst, p := range f.procs {
		select {
		case <-p.done:
			if p.err != nil {
				out = append(out, fmt.Sprintf("%s exited: %v\n%s", inst, p.err, tail(p.log, 15)))
			}
		default:
		}
	}
	sort.Strings(out)
	return out
}

func (f *fleet) stopAll() {
	f.mu.Lock()
	insts := make([]string, 0, len(f.procs))
	for inst := range f.procs {
		insts = append(insts, inst)
	}
	f.mu.Unlock()
	var wg sync.WaitGroup
	for _, inst := range insts {
		wg.Add(1)
		go func() { defer wg.Done(); f.stop(inst) }()
	}
	wg.Wait()
	if f.t.Failed() {
		f.dumpLogs()
	}
}

// dumpLogs prints the tail of every process log (after a failure).
func (f *fleet) dumpLogs() {
	paths, _ := filepath.Glob(filepath.Join(f.dir, "*.log"))
	for _, p := range paths {
		f.t.Logf("--- %s\n%s", filepath.Base(p), tail(p, 20))
	}
}

// logs returns every process log's content concatenated.
func (f *fleet) logs() string {
	paths, _ := filepath.Glob(filepath.Join(f.dir, "*.log"))
	var b strings.Builder
	for _, p := range paths {
		data, _ := os.ReadFile(p)
		b.Write(data)
	}
	return b.String()
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

// healthAddr waits for the process to print its health address.
func healthAddr(p *proc, timeout time.Duration) (string, error) {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		data, _ := os.ReadFile(p.log)
		sc := bufio.NewScanner(strings.NewReader(string(data)))
		for sc.Scan() {
			if addr, ok := pipeline.HealthAddrOf(sc.Text()); ok {
				return addr, nil
			}
		}
		select {
		case <-p.done:
			return "", fmt.Errorf("%s exited: %v", p.inst, p.err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	return "", errors.New("no health address printed")
}

// startBrokerProcess runs `trajflow broker --port 0` and returns its
// address.
func startBrokerProcess(t testing.TB) string { return startBrokerProcessOn(t, 0) }

// startBrokerProcessOn runs `trajflow broker --port port`.
func startBrokerProcessOn(t testing.TB, port int) string {
	t.Helper()
	return testkit.StartBrokerProcess(t, binPath, port)
}

// producer feeds groups [0, n) in chunks over time, so that kills land
// while records are in flight; ids collects the launched attempt ids.
type producer struct {
	mu   sync.Mutex
	ids  []string
	done chan struct{}
}

func startProducer(t testing.TB, run *testkit.Run, meanTokens float64, n, chunk int64, every time.Duration) *producer {
	p := &producer{done: make(chan struct{})}
	s := synthFor(run, meanTokens)
	go func() {
		defer close(p.done)
		for from := int64(0); from < n; from += chunk {
			ids := run.Produce(t, s, from, min(from+chunk, n))
			p.mu.Lock()
			p.ids = append(p.ids, ids...)
			p.mu.Unlock()
			time.Sleep(every)
		}
	}()
	return p
}

func (p *producer) wait() []string {
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.ids...)
}

// chaos kills random instances of the fleet in rounds: each round, gap
// plus a random 0.8-2.5 s after the previous one, SIGKILLs one instance of
// every stage in stages (each at a random moment within 0.4 s), deletes
// the state directory of those wipe selects, and restarts them.
func chaos(f *fleet, rng *rand.Rand, rounds int, gap time.Duration, pick func(stage string) string, stages []string, wipe func(round int, stage string) bool) {
	for r := 0; r < rounds; r++ {
		if r > 0 {
			time.Sleep(gap)
		}
		time.Sleep(time.Duration(800+rng.IntN(1700)) * time.Millisecond)
		var wg sync.WaitGroup
		for _, st := range stages {
			inst := pick(st)
			w := wipe(r, st)
			delay := time.Duration(rng.IntN(400)) * time.Millisecond
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(delay)
				f.kill(inst)
				f.restart(inst, w)
			}()
		}
		wg.Wait()
	}
}

// settle waits until every launched attempt is accounted for (or timeout)
// and checks the census: one distinct admitted event per admitted attempt.
func settle(t testing.TB, run *testkit.Run, ids []string, timeout time.Duration) (audit.Counts, *audit.Report) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	lastLog := time.Now()
	var rep *audit.Report
	var lastErr error
	for {
		// Audit errors right after a broker restart (stale leaders) are
		// transient: retried until the deadline.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		r, err := run.Audit(ctx)
		cancel()
		if err == nil {
			rep = r
			if r.Account(ids).Lost == 0 {
				break
			}
		} else {
			lastErr = err
		}
		if time.Now().After(deadline) {
			break
		}
		if time.Since(lastLog) > 10*time.Second {
			if rep != nil {
				t.Logf("settling: %v", rep.Account(ids))
			} else {
				t.Logf("settling: audit error %v", lastErr)
			}
			lastLog = time.Now()
		}
		time.Sleep(time.Second)
	}
	if rep == nil {
		t.Fatalf("audit: %v", lastErr)
	}
	return rep.Account(ids), rep
}

// checkCounts asserts nothing was lost or duplicated and the census holds
// one admitted event per admitted attempt.
func checkCounts(t testing.TB, run *testkit.Run, c audit.Counts, rep *audit.Report) {
	t.Helper()
	if c.Lost != 0 || c.Duplicated != 0 {
		t.Errorf("lost=%d duplicated=%d (%v); first lost %v", c.Lost, c.Duplicated, c, c.LostIDs[:min(5, len(c.LostIDs))])
		if c.Lost > 0 {
			t.Logf("where the lost attempts are: %s", locate(t, run, c.LostIDs))
		}
	}
	if c.Admitted == 0 {
		t.Errorf("nothing admitted (%v)", c)
	}
	if c.Quarantined > 0 || c.Filtered > 0 {
		t.Logf("quarantine reasons %v; filter reasons %v", reasons(rep.Quarantined), reasons(rep.Filtered))
	}
	if got := rep.Census["admitted"]; got != c.Admitted+c.Excluded {
		t.Errorf("census holds %d distinct admitted events for %d admitted attempts (%d of them excluded at the update)", got, c.Admitted+c.Excluded, c.Excluded)
	}
}

// locate reports, for a failed accounting, how far the lost attempts got:
// how many of them appear on each data-plane topic.
func locate(t testing.TB, run *testkit.Run, lost []string) string {
	t.Helper()
	want := map[string]bool{}
	for _, id := range lost {
		want[id] = true
	}
	cfg := run.Config("locate", "")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var b strings.Builder
	for _, topic := range []string{run.Topics.Trajectories, run.Topics.Valid, run.Topics.Rewarded, run.Topics.Scored} {
		seen := map[string]bool{}
		err := pipeline.ScanTail(ctx, &cfg, topic, 0, func(m pipeline.Message) error {
			for _, id := range idsIn(m.Value) {
				if want[id] {
					seen[id] = true
				}
			}
			return nil
		})
		fmt.Fprintf(&b, "%s: %d of %d lost (err %v); ", topic, len(seen), len(lost), err)
	}
	return b.String()
}

// idsIn returns the record ids of a trajectories-like message (any of the
// trajectory, rewarded or scored kinds).
func idsIn(v []byte) []string {
	var out []string
	if rows, err := schemas.Trajectories.Decode(nil, v); err == nil {
		for _, r := range rows {
			out = append(out, r.RecordID)
		}
		return out
	}
	if rows, err := schemas.RewardedTrajectories.Decode(nil, v); err == nil {
		for _, r := range rows {
			out = append(out, r.RecordID)
		}
		return out
	}
	if rows, err := schemas.ScoredTrajectories.Decode(nil, v); err == nil {
		for _, r := range rows {
			out = append(out, r.RecordID)
		}
	}
	return out
}

// reasons counts the reasons of a census map.
func reasons(m map[string]string) map[string]int {
	out := map[string]int{}
	for _, r := range m {
		out[r]++
	}
	return out
}

// startRun creates the run's topics (testkit.StartRun) and waits until the
// broker serves every one of them (real Kafka propagates new topics'
// metadata asynchronously).
func startRun(t testing.TB, c *contract.Contract, addr string) *testkit.Run {
	t.Helper()
	run := testkit.StartRun(t, c, addr)
	names := []string{run.Topics.Trajectories, run.Topics.Valid, run.Topics.Rewarded, run.Topics.Scored,
		run.Topics.Batches, run.Topics.Quarantine, run.Topics.Census}
	tr := &kafkago.Transport{} // not DefaultTransport, whose pools outlive the client
	defer tr.CloseIdleConnections()
	cl := &kafkago.Client{Addr: kafkago.TCP(run.Addr), Timeout: 5 * time.Second, Transport: tr}
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		md, err := cl.Metadata(ctx, &kafkago.MetadataRequest{Topics: names})
		cancel()
		ready := err == nil && len(md.Topics) == len(names)
		if ready {
			for _, tp := range md.Topics {
				if tp.Error != nil || len(tp.Partitions) == 0 {
					ready = false
				}
				for _, p := range tp.Partitions {
					if p.Error != nil || p.Leader.ID < 0 {
						ready = false
					}
				}
			}
		}
		if ready {
			return run
		}
		if time.Now().After(deadline) {
			t.Fatalf("topics of %s not served after 30s (last error %v)", c.RunID, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// synthFor is the run's synthetic distribution with token ids inside the
// vocabulary `trajflow run` validates against.
func synthFor(run *testkit.Run, meanTokens float64) synth.Config {
	s := run.Synth(meanTokens, int(meanTokens*10))
	s.Vocab = rollout.VocabSize
	return s
}

// produceRaw writes msgs to topic as they are (headers included).
func produceRaw(t testing.TB, run *testkit.Run, topic string, msgs []rawMsg) {
	t.Helper()
	tr := &kafkago.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{
		Addr: kafkago.TCP(run.Addr), Topic: topic, Balancer: &kafkago.Murmur2Balancer{},
		RequiredAcks: kafkago.RequireAll, BatchTimeout: 2 * time.Millisecond,
		BatchBytes: int64(run.Contract.Topics.MaxMessageBytes), Transport: tr,
	}
	defer w.Close()
	out := make([]kafkago.Message, len(msgs))
	for i, m := range msgs {
		out[i] = kafkago.Message{Key: []byte(m.key), Value: m.value}
		for k, v := range m.headers {
			out[i].Headers = append(out[i].Headers, kafkago.Header{Key: k, Value: []byte(v)})
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := w.WriteMessages(ctx, out...); err != nil {
		t.Fatalf("produce to %s: %v", topic, err)
	}
}

// checkNoneRefused asserts that no well-formed attempt was quarantined or
// filtered: faults (kills, restarts, rebalances, outages) must never turn
// good data into refusals.
func checkNoneRefused(t testing.TB, c audit.Counts, rep *audit.Report) {
	t.Helper()
	if c.Quarantined != 0 || c.Filtered != 0 {
		t.Errorf("well-formed attempts refused: quarantined %v, filtered %v", reasons(rep.Quarantined), reasons(rep.Filtered))
	}
}
