package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// TestAsyncLagBoundUnderChaos is the lag bound's guarantee under
// randomized timing: for several seeds, the asynchronous loop runs as
// separate `trajflow run` processes with a deliberately slow trainer (20
// optimizer epochs per update), every group admitted (zero-variance
// groups kept), heavy-tailed tool latencies (the contract's latency
// model) with pack windows closed early by a timeout (so batches are
// smaller and more numerous than the pacing assumes, and samples wait
// behind them), and
// operators SIGKILLed at random moments and restarted (some without their
// state). The seed also picks max_lag (1 or 2), the stale policy (drop or
// mask_stale) and the partial-rollout rule (finish or continue).
//
// Whatever happened, at every optimizer step no trained token has a lag
// above max_lag (the optimizer's own lag strata in the update records),
// and every token the lag rule excluded is counted with its reason: for
// every batch the trainer took (trained or refused as stale_batch), the
// stale tokens recomputed from the batch and the trainer's version at its
// update equal the census's (stage train, reason stale_at_update for a
// trajectory left with nothing, stale_tokens on the rest) and the update
// record's. Nothing is lost or admitted twice.
//
// TRAJFLOW_CHAOS_SEEDS sets how many seeds run (default 3).
func TestAsyncLagBoundUnderChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a broker and the loop's operators as processes; run without -short")
	}
	// Parallel: it runs beside the package's other long process test
	// (TestReadmeFleet) once the sequential tests are done; a loaded
	// machine only adds to the timing it randomizes.
	t.Parallel()
	seeds := 3
	if v, err := strconv.Atoi(os.Getenv("TRAJFLOW_CHAOS_SEEDS")); err == nil && v > 0 {
		seeds = v
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "trajflow")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	for seed := 1; seed <= seeds; seed++ {
		t.Run(fmt.Sprintf("seed-%d", seed), func(t *testing.T) { chaosRun(t, bin, uint64(seed)) })
	}
}

// chaosSetup is one randomized scenario.
type chaosSetup struct {
	seed          uint64
	maxLag        int64
	stale         string
	partial       string
	rounds, kills int
}

func (c chaosSetup) contract(run string) string {
	src, err := os.ReadFile("../../testdata/contracts/demo.yaml")
	if err != nil {
		panic(err)
	}
	s := string(src)
	for _, r := range [][2]string{
		{"run_id: demo", "run_id: " + run},
		{"seed: 1 ", fmt.Sprintf("seed: %d ", c.seed)},
		{"  mode: sync  ", "  mode: async "},
		{"  max_lag: 0 ", fmt.Sprintf("  max_lag: %d ", c.maxLag)},
		{"  stale_policy: drop ", "  stale_policy: " + c.stale + " "},
		{"  partial_rollouts: finish ", "  partial_rollouts: " + c.partial + " "},
		{"  epochs: 4 ", "  epochs: 20 "},
		{"  group_size: 16 ", "  group_size: 8 "},
		{"  tasks_per_update: 16 ", "  tasks_per_update: 4 "},
		{"  groups_per_update: 16 ", "  groups_per_update: 4 "},
		{"  batch_groups: 16 ", "  batch_groups: 4 "},
		{"  zero_variance: penalize_failed ", "  zero_variance: keep "}, // every group reaches a batch
		// Groups finish spread out in time (heavy-tailed tool calls), so
		// windows close by their timeout with fewer groups than a round.
		{"  tool_median_ms: 0\n", "  tool_median_ms: 60\n"},
		{"  tool_sigma: 0\n", "  tool_sigma: 1.2\n"},
	} {
		if !strings.Contains(s, r[0]) {
			panic("demo.yaml has no " + r[0])
		}
		s = strings.Replace(s, r[0], r[1], 1)
	}
	return s
}

func chaosRun(t *testing.T, bin string, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, uint64(time.Now().UnixNano())))
	c := chaosSetup{seed: seed, maxLag: 1 + int64(seed%2), stale: []string{"drop", "mask_stale"}[seed/2%2],
		partial: []string{"finish", "continue"}[seed/4%2], rounds: 12, kills: 3}
	t.Logf("seed %d: max_lag %d, stale_policy %s, partial_rollouts %s, %d rounds of 4 groups x 8, %d kills",
		seed, c.maxLag, c.stale, c.partial, c.rounds, c.kills)
	dir := t.TempDir()
	run := fmt.Sprintf("chaos%d", seed)
	cpath := filepath.Join(dir, "contract.yaml")
	if err := os.WriteFile(cpath, []byte(c.contract(run)), 0o644); err != nil {
		t.Fatal(err)
	}
	procs := map[string]*exec.Cmd{}
	var all []*exec.Cmd
	t.Cleanup(func() {
		for _, p := range all {
			p.Process.Signal(syscall.SIGKILL)
			p.Wait()
		}
	})
	// Every process logs to dir/logs; a failed run prints their tails.
	logs := filepath.Join(dir, "logs")
	if err := os.MkdirAll(logs, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			printLogTails(t, logs)
		}
	})
	start := func(args ...string) (*exec.Cmd, io.Reader) {
		cmd := exec.Command(bin, args...)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		lf, err := os.OpenFile(filepath.Join(logs, logName(args)), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { lf.Close() })
		cmd.Stderr = lf
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		all = append(all, cmd)
		return cmd, out
	}
	_, bout := start("broker", "--port", "0", "--log-level", "warn")
	line, err := bufio.NewReader(bout).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "broker listening on ") {
		t.Fatalf("broker: %q %v", line, err)
	}
	go io.Copy(io.Discard, bout)
	addr := strings.TrimSpace(strings.TrimPrefix(line, "broker listening on "))
	if out, err := exec.Command(bin, "topics", "create", "--brokers", addr, "--contract", cpath).CombinedOutput(); err != nil {
		t.Fatalf("topics: %v\n%s", err, out)
	}
	releases := filepath.Join(dir, "releases")
	startOp := func(name string) {
		args := []string{"run", name, "--brokers", addr, "--contract", cpath, "--releases", releases,
			"--rounds", fmt.Sprint(c.rounds), "--state", filepath.Join(dir, "state", name), "--log-level", "info"}
		if name == "pack" {
			args = append(args, "--window-max-wait", "100ms") // windows smaller and later than the pacing assumes
		}
		cmd, out := start(args...)
		go io.Copy(io.Discard, out)
		procs[name] = cmd
	}
	for _, name := range loop.Stages {
		startOp(name)
	}
	topics, _ := pipeline.TopicsFor(run)
	cfg := &pipeline.Config{Brokers: []string{addr}}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	victims := []string{"train", "pack", "dispatch", "rollout", "advantage"}
	nextKill, kills := time.Now().Add(time.Duration(1500+rng.IntN(3000))*time.Millisecond), 0
	for {
		if kills < c.kills && time.Now().After(nextKill) {
			v := victims[rng.IntN(len(victims))]
			procs[v].Process.Signal(syscall.SIGKILL)
			procs[v].Wait()
			if rng.IntN(2) == 0 {
				os.RemoveAll(filepath.Join(dir, "state", v)) // restarted without its local state
			}
			time.Sleep(time.Duration(rng.IntN(800)) * time.Millisecond)
			startOp(v)
			kills++
			t.Logf("killed and restarted %s", v)
			nextKill = time.Now().Add(time.Duration(2000+rng.IntN(4000)) * time.Millisecond)
		}
		if ctx.Err() != nil {
			chaosStuck(t, cfg, topics)
			t.Fatalf("the loop did not finish")
		}
		if kills == c.kills && chaosDone(t, ctx, cfg, topics, c.rounds*4) {
			break
		}
		time.Sleep(300 * time.Millisecond)
	}
	// A restarted operator may still be starting: give it a moment before
	// the graceful stop.
	time.Sleep(time.Second)
	for name, p := range procs {
		p.Process.Signal(syscall.SIGINT)
		if err := p.Wait(); err != nil {
			t.Errorf("operator %s: %v", name, err)
		}
	}
	checkChaos(t, ctx, cfg, topics, releases, c)
}

// chaosStuck logs where the groups of a run that did not finish are: for
// every group not decided by pack, the messages it has on each topic of
// the chain, and the trainer's progress.
func chaosStuck(t *testing.T, cfg *pipeline.Config, topics pipeline.Topics) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	chain := []string{topics.Tasks, topics.Trajectories, topics.Valid, topics.Rewarded, topics.Scored}
	on := map[string]map[string]int{} // group -> topic -> messages
	for _, topic := range chain {
		for _, m := range readAllPartitions(t, ctx, cfg, topic) {
			g := string(m.Key)
			if on[g] == nil {
				on[g] = map[string]int{}
			}
			on[g][topic]++
		}
	}
	decided := map[string]bool{}
	for _, m := range readAllPartitions(t, ctx, cfg, topics.Windows) {
		w, err := schemas.DecodeWindow(m.Value)
		if err != nil {
			t.Logf("window record at %s: %v", m.Ref, err)
			continue
		}
		t.Logf("window %s: batch %q (index %d) trainer v%d closed by %s, groups %v", m.Ref, w.BatchID, w.BatchIndex, w.TrainerVersion, w.ClosedBy, w.Groups)
		for _, g := range w.Groups {
			decided[g] = true
		}
	}
	for _, m := range readAllPartitions(t, ctx, cfg, topics.Policy) {
		if rel, err := schemas.DecodeRelease(m.Value); err == nil {
			t.Logf("release v%d ready=%v next_batch %d", rel.PolicyVersion, rel.Ready, rel.NextBatch)
		}
	}
	for g, per := range on {
		if decided[g] {
			continue
		}
		var where []string
		for _, topic := range chain {
			where = append(where, fmt.Sprintf("%s=%d", topic, per[topic]))
		}
		t.Logf("group %s undecided: %s", g, strings.Join(where, " "))
	}
}

// logName is the log file of a process started with args.
func logName(args []string) string {
	if args[0] == "run" {
		return args[1] + ".log"
	}
	return args[0] + ".log"
}

// printLogTails logs the last lines of every process's log in dir.
func printLogTails(t *testing.T, dir string) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		t.Logf("--- %s (last lines)\n%s", e.Name(), strings.Join(lines[max(0, len(lines)-15):], "\n"))
	}
}

// chaosDone reports whether every group was decided and every batch taken
// by the trainer (trained into a release, or refused).
func chaosDone(t *testing.T, ctx context.Context, cfg *pipeline.Config, topics pipeline.Topics, groups int) bool {
	decided, batches := map[string]bool{}, 0
	if err := pipeline.ScanTail(ctx, cfg, topics.Windows, 0, func(m pipeline.Message) error {
		w, err := schemas.DecodeWindow(m.Value)
		if err != nil {
			return err
		}
		for _, g := range w.Groups {
			decided[g] = true
		}
		if w.BatchID != "" {
			batches = max(batches, int(w.BatchIndex)+1)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	next := int64(0)
	if err := pipeline.ScanTail(ctx, cfg, topics.Policy, 0, func(m pipeline.Message) error {
		if rel, err := schemas.DecodeRelease(m.Value); err == nil {
			next = max(next, rel.NextBatch)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// A batch the trainer refused (stale_batch) leaves next behind it
	// until a later one trains.
	refused := map[int64]bool{}
	for _, m := range readAllPartitions(t, ctx, cfg, topics.Quarantine) {
		if string(m.Header(schemas.HeaderStage)) != "train" || string(m.Header(schemas.HeaderSourceTopic)) != topics.Batches {
			continue
		}
		if b, err := schemas.PackedBatches.Decode(nil, m.Value); err == nil {
			refused[b.BatchIndex] = true
		}
	}
	if len(decided) < groups {
		return false
	}
	for i := next; i < int64(batches); i++ {
		if !refused[i] {
			return false
		}
	}
	return true
}

// readAllPartitions reads every partition of topic.
func readAllPartitions(t *testing.T, ctx context.Context, cfg *pipeline.Config, topic string) []pipeline.Message {
	var out []pipeline.Message
	if err := pipeline.ScanTail(ctx, cfg, topic, 0, func(m pipeline.Message) error {
		out = append(out, m)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// checkChaos checks the bound and the accounting of a finished run.
func checkChaos(t *testing.T, ctx context.Context, cfg *pipeline.Config, topics pipeline.Topics, releases string, c chaosSetup) {
	launched, err := loop.Launched(ctx, cfg, topics)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := audit.Collect(ctx, cfg, topics)
	if err != nil {
		t.Fatal(err)
	}
	counts := rep.Account(launched)
	t.Logf("accounting %v", counts)
	if counts.Lost != 0 || counts.Duplicated != 0 || counts.Launched != c.rounds*4*8 {
		t.Fatalf("accounting %v (lost %v)", counts, counts.LostIDs)
	}
	files, err := pipeline.NewDirReleases(releases)
	if err != nil {
		t.Fatal(err)
	}
	// The trainer's version at the update of every batch it took.
	from := map[string]int64{}
	updates := map[string]gpu.UpdateRecord{}
	for v := int64(1); ; v++ {
		u, err := gpu.ReadUpdate(files, v)
		if err != nil {
			break
		}
		updates[u.BatchID], from[u.BatchID] = u, u.Metrics.FromVersion
		for _, l := range u.Metrics.Lag {
			if l.Lag > c.maxLag || l.Lag < 0 {
				t.Fatalf("update %d: the optimizer trained %d tokens at lag %d, max_lag %d", v, l.Tokens, l.Lag, c.maxLag)
			}
		}
		for _, l := range u.Lag {
			if l.Lag > c.maxLag {
				t.Fatalf("update %d: lag_tokens %v beyond max_lag %d", v, u.Lag, c.maxLag)
			}
		}
	}
	if len(updates) == 0 {
		t.Fatal("no update")
	}
	// The census of the trainer: stale tokens by batch, and the excluded
	// trajectories with their reason.
	censusStale := map[string]int64{}
	excluded := map[string]bool{}
	for _, m := range readAllPartitions(t, ctx, cfg, topics.Census) {
		ev, err := schemas.DecodeCensus(m.Value)
		if err != nil || ev.Stage != "train" {
			continue
		}
		if _, ok := from[ev.BatchID]; !ok && ev.Kind == schemas.CensusFiltered {
			from[ev.BatchID] = ev.PolicyVersion // a batch refused as stale_batch
		}
		if ev.Kind == schemas.CensusFiltered {
			if ev.Reason != schemas.ReasonStaleAtUpdate || ev.StaleTokens == 0 {
				t.Fatalf("train census event %+v: want reason %s and its excluded tokens", ev, schemas.ReasonStaleAtUpdate)
			}
			if !excluded[ev.EventID] {
				excluded[ev.EventID] = true
				censusStale[ev.BatchID] += ev.StaleTokens
			}
		}
	}
	seenTrained := map[string]bool{}
	for _, m := range readAllPartitions(t, ctx, cfg, topics.Census) {
		ev, err := schemas.DecodeCensus(m.Value)
		if err == nil && ev.Stage == "train" && ev.Kind == schemas.CensusTrained && !seenTrained[ev.EventID] {
			seenTrained[ev.EventID] = true
			censusStale[ev.BatchID] += ev.StaleTokens
		}
	}
	// Recompute the rule from each batch the trainer took.
	var total int64
	if err := pipeline.ScanTail(ctx, cfg, topics.Batches, 0, func(m pipeline.Message) error {
		b, err := schemas.PackedBatches.Decode(nil, m.Value)
		if err != nil {
			return err
		}
		f, ok := from[b.BatchID]
		if !ok {
			return nil // never reached the trainer's rule (every trajectory trained already)
		}
		want := staleOf(b, f, c.maxLag, c.stale)
		total += want
		if got := censusStale[b.BatchID]; got != want {
			return fmt.Errorf("batch %s at version %d: the rule excludes %d tokens, the census counts %d", b.BatchID, f, want, got)
		}
		if u, ok := updates[b.BatchID]; ok && u.StaleTokens != want {
			return fmt.Errorf("batch %s: update record %d counts %d stale tokens, the rule %d", b.BatchID, u.Version, u.StaleTokens, want)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d updates, %d tokens excluded at the update by the lag rule, %d trajectories", len(updates), total, counts.Excluded)
}

// staleOf is the lag rule recomputed: the trained tokens of b the rule
// excludes at trainer version f (drop: every trained token of a segment
// holding a stale one).
func staleOf(b schemas.PackedBatch, f, maxLag int64, policy string) int64 {
	var n int64
	for _, r := range b.Rows {
		segStale := map[int32]bool{}
		for i, m := range r.ActionMask {
			if m == 1 && f-int64(r.PolicyVersions[i]) > maxLag {
				segStale[r.SegmentIDs[i]] = true
			}
		}
		for i, m := range r.ActionMask {
			if m != 1 {
				continue
			}
			if f-int64(r.PolicyVersions[i]) > maxLag || (policy == "drop" && segStale[r.SegmentIDs[i]]) {
				n++
			}
		}
	}
	return n
}
