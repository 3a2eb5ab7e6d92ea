package dashboard

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// The offline tests share one demo run (3 updates), made on first use.
var shared struct {
	once sync.Once
	root string
	out  string
	sum  *loop.Summary
	err  error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared.root != "" {
		os.RemoveAll(shared.root)
	}
	os.Exit(code)
}

// demoRun returns the output directory and summary of the shared run.
func demoRun(t *testing.T) (string, *loop.Summary) {
	t.Helper()
	shared.once.Do(func() {
		if shared.root, shared.err = os.MkdirTemp("", "dashboard-demo-"); shared.err != nil {
			return
		}
		shared.out = filepath.Join(shared.root, "demo")
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		// Zero-variance groups dropped, so the run has filtered
		// trajectories and losses for the views to itemize.
		shared.sum, shared.err = loop.Run(ctx, loop.Options{Out: shared.out, Updates: 3, Seed: 1, EvalSamples: evalSamples, Quiet: true,
			Edit: testkit.DropZeroVariance}, io.Discard)
	})
	if shared.err != nil {
		t.Fatalf("demo run: %v", shared.err)
	}
	return shared.out, shared.sum
}

// copyDir copies the shared run, for tests that damage it.
func copyDir(t *testing.T, src string) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "demo")
	err := filepath.Walk(src, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		if fi.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}

func getJSON(t *testing.T, url string, status int, v any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != status {
		t.Fatalf("GET %s: %d %s, want %d", url, resp.StatusCode, b, status)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("GET %s: %v: %s", url, err, b)
	}
}

// TestSnapshotAPI serves a demo run's snapshot directory and checks the
// JSON API against summary.json and against the records themselves.
func TestSnapshotAPI(t *testing.T) {
	out, sum := demoRun(t)
	d, err := New(context.Background(), Config{Dir: out, EvalSamples: evalSamples})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d.Handler())
	defer srv.Close()
	var s Summary
	getJSON(t, srv.URL+"/api/summary", http.StatusOK, &s)
	o := s.Overview
	if len(o.Checks) != 10 {
		t.Errorf("%d checks against summary.json, want 10: %+v", len(o.Checks), o.Checks)
	}
	for _, c := range o.Checks {
		if !c.OK {
			t.Errorf("check %s: dashboard %v, summary.json %v", c.Name, c.Dashboard, c.Recorded)
		}
	}
	if o.Updates != sum.Updates || o.Launched != sum.AttemptsLaunched || o.Admitted != sum.TrajectoriesAdmitted ||
		o.Recorded != sum.AttemptsLaunched || *o.EvalFinal != sum.EvalSuccessFinal {
		t.Errorf("overview %+v, summary %+v", o, sum)
	}
	checkCapability(t, s.Capability, sum)
	checkLearning(t, s.Learning, sum)
	checkSystems(t, s.Systems, sum)
	h := s.Integrity.Hashes
	if h.Files == nil || h.Files.Verified < 10 || len(h.Files.Failures) > 0 || len(h.Files.Gaps) > 0 ||
		h.ReleasesVerified != sum.Updates+1 || len(h.ReleaseFailures) > 0 || len(h.ManifestMismatch) > 0 {
		t.Errorf("hashes %+v (files %+v)", h, h.Files)
	}
	if s.Integrity.Denied.Turns == 0 || s.Integrity.Quarantine.Total != 0 || s.Integrity.EvalAccess != (EvalAccess{}) {
		t.Errorf("integrity %+v", s.Integrity)
	}
	checkFinder(t, srv.URL, d)
}

func checkCapability(t *testing.T, c Capability, sum *loop.Summary) {
	t.Helper()
	if len(c.ByVersion) != sum.Updates { // versions 0..updates-1 sampled
		t.Fatalf("%d versions, want %d", len(c.ByVersion), sum.Updates)
	}
	for i, v := range c.ByVersion {
		lo, hi := Wilson(v.Successes, v.Judged)
		if v.Version != int64(i) || v.Judged != v.Attempts || v.Success != float64(v.Successes)/float64(v.Judged) ||
			v.Lo != lo || v.Hi != hi || v.Lo > v.Success || v.Hi < v.Success {
			t.Errorf("version %+v", v)
		}
		// pass@1 is the mean success over groups of equal size: the success.
		if len(v.PassAtK) != 5 || math.Abs(v.PassAtK[0].Value-v.Success) > 1e-12 || v.PassAtK[4].K != 16 {
			t.Errorf("version %d pass@k %+v, success %v", v.Version, v.PassAtK, v.Success)
		}
		for k := 1; k < len(v.PassAtK); k++ {
			if v.PassAtK[k].Value < v.PassAtK[k-1].Value {
				t.Errorf("version %d: pass@k decreases in k: %+v", v.Version, v.PassAtK)
			}
		}
		if v.Turns != v.TurnsOK+v.Invalid+v.Denied || v.Validity <= 0 {
			t.Errorf("version %d turns %+v", v.Version, v)
		}
	}
	if len(c.Eval) != len(sum.Evals) {
		t.Fatalf("%d eval points, the run recorded %d", len(c.Eval), len(sum.Evals))
	}
	for i, e := range c.Eval {
		if !e.Match || e.Version != sum.Evals[i].Version || e.Success != sum.Evals[i].Success || e.Attempts != 64*evalSamples {
			t.Errorf("eval %+v, recorded %+v", e, sum.Evals[i])
		}
	}
}

func checkLearning(t *testing.T, l Learning, sum *loop.Summary) {
	t.Helper()
	if len(l.Updates) != sum.Updates {
		t.Fatalf("%d update rows, want %d", len(l.Updates), sum.Updates)
	}
	for i, u := range l.Updates {
		line := sum.PerUpdate[i]
		// On policy, the first step's ratio is exactly 1; the demo's line
		// prints the last step's KL, clip fraction and the first's entropy.
		if u.Version != line.Update || u.BatchID != line.BatchID || u.FirstRatioMean != 1 || u.ApproxKL != line.KL || u.Entropy != line.Entropy {
			t.Errorf("update %+v, demo line %+v", u, line)
		}
	}
	// The rows' cost ledgers sum to the run's (summary.json "cost").
	var cost schemas.UpdateCost
	for _, u := range l.Updates {
		if u.Cost == nil {
			t.Fatalf("update %d has no cost ledger", u.Version)
		}
		cost.Add(*u.Cost)
	}
	if cost != sum.Cost || cost.Rollout.Episodes == 0 {
		t.Errorf("update rows' cost %+v, summary.json %+v", cost, sum.Cost)
	}
	if len(l.Lag) != 1 || l.Lag[0].Lag != 0 || l.Lag[0].RatioMean != 1 {
		t.Errorf("lag strata %+v (stop-and-synchronize: lag 0, ratio 1 at the first step)", l.Lag)
	}
	for _, v := range l.ByVersion {
		if len(v.Components) != 1 || v.Components[0].Name != "kv_success" || v.Advantage.N == 0 || v.Tokens.Mean <= 0 {
			t.Errorf("learning by version %+v", v)
		}
	}
}

func checkSystems(t *testing.T, s Systems, sum *loop.Summary) {
	t.Helper()
	var rollout *StageRate
	for i := range s.Stages {
		if s.Stages[i].Stage == "rollout" {
			rollout = &s.Stages[i]
		}
	}
	if rollout == nil || rollout.Tokens == 0 || rollout.TokensPerS <= 0 || len(rollout.Series) != buckets {
		t.Errorf("stages %+v", s.Stages)
	}
	var windowTrained int64
	for _, w := range s.Windows {
		windowTrained += w.Trained
	}
	// pack's window records count the trained tokens of each batch: the
	// yield's trained tokens, read from the batches' masks, are the same.
	if s.Yield.Trained != windowTrained || s.Yield.Trained == 0 || s.Yield.Generated <= s.Yield.Trained {
		t.Errorf("yield %+v, windows trained %d", s.Yield, windowTrained)
	}
	var lost int64
	for _, l := range s.Yield.Losses {
		lost += l.Tokens
	}
	if lost != s.Yield.Generated-s.Yield.Trained {
		t.Errorf("losses itemize %d tokens, generated %d - trained %d", lost, s.Yield.Generated, s.Yield.Trained)
	}
	if len(s.Sync) != sum.Updates+1 || len(s.Trainer) != sum.Updates || len(s.PolicyLag) != 1 || s.PolicyLag[0].Tokens != s.Yield.Trained {
		t.Errorf("sync %d rows, trainer %d rows, policy lag %+v", len(s.Sync), len(s.Trainer), s.PolicyLag)
	}
	if s.LagNote == "" || len(s.Lags) != 0 {
		t.Errorf("a snapshot has no consumer offsets: %q %+v", s.LagNote, s.Lags)
	}
	checkLatency(t, s.Latency, sum)
}

// checkLatency checks the latency section of a demo run: every attempt
// timed, every turn's two latencies counted, the versions' and domains'
// parts adding up to the whole, the slowest listed slowest first.
func checkLatency(t *testing.T, l Latency, sum *loop.Summary) {
	t.Helper()
	if l.AttemptS.N != sum.AttemptsLaunched || l.Untimed != 0 || l.GenerationMS.N == 0 || l.EnvStepMS.N != l.GenerationMS.N ||
		l.AttemptS.Min < 0 || l.AttemptS.P99 > l.AttemptS.Max || l.GenerationShare <= 0 || l.GenerationShare+l.EnvShare > 1 {
		t.Errorf("latency of %d attempts: %+v", sum.AttemptsLaunched, l)
	}
	attempts, turns, tail := 0, 0, 0
	for _, v := range l.ByVersion {
		attempts += v.AttemptS.N
		tail += v.Tail
	}
	for _, d := range l.ByDomain {
		turns += d.EnvStepMS.N
	}
	if attempts != l.AttemptS.N || turns != l.EnvStepMS.N || tail != l.Tail || len(l.ByVersion) != sum.Updates {
		t.Errorf("by version %d attempts, %d in the tail; by domain %d turns; want %d, %d, %d (versions %d, want %d)",
			attempts, tail, turns, l.AttemptS.N, l.Tail, l.EnvStepMS.N, len(l.ByVersion), sum.Updates)
	}
	if len(l.Slowest) != min(slowestShown, l.AttemptS.N) || l.Slowest[0].Seconds != l.AttemptS.Max {
		t.Fatalf("slowest %+v, longest attempt %v s", l.Slowest, l.AttemptS.Max)
	}
	for i := 1; i < len(l.Slowest); i++ {
		if l.Slowest[i].Seconds > l.Slowest[i-1].Seconds {
			t.Errorf("slowest out of order: %+v", l.Slowest)
		}
	}
}

// checkFinder queries the trajectory finder and one trajectory.
func checkFinder(t *testing.T, url string, d *Dashboard) {
	t.Helper()
	var all TrajectoryList
	getJSON(t, url+"/api/trajectories?outcome=admitted&limit=1000", http.StatusOK, &all)
	if all.Total != d.view.Summary.Overview.Admitted || len(all.Rows) != all.Total {
		t.Fatalf("%d admitted listed (%d rows), overview says %d", all.Total, len(all.Rows), d.view.Summary.Overview.Admitted)
	}
	first := all.Rows[0]
	var group TrajectoryList
	getJSON(t, url+"/api/trajectories?group="+first.Group, http.StatusOK, &group)
	var byTask TrajectoryList
	getJSON(t, url+"/api/trajectories?task="+first.Task, http.StatusOK, &byTask)
	var byID TrajectoryList
	getJSON(t, url+"/api/trajectories?id="+first.ID[:10], http.StatusOK, &byID)
	if group.Total != 16 || byTask.Total < 16 || byID.Total != 1 || byID.Rows[0].ID != first.ID {
		t.Errorf("group %d, task %d, id prefix %d rows", group.Total, byTask.Total, byID.Total)
	}
	var det TrajectoryDetail
	getJSON(t, url+"/api/trajectory?id="+first.ID, http.StatusOK, &det)
	if len(det.Tokens) != first.Tokens || det.Batch == nil || !det.Batch.Aligned || det.Update == nil || det.Window == nil ||
		det.Fate.Outcome != schemas.CensusAdmitted || len(det.Census) < 5 || len(det.Rewards) != 1 || det.Scored == nil {
		t.Errorf("trajectory %s: %d tokens (want %d), batch %+v, update %v, fate %+v, %d census events",
			first.ID, len(det.Tokens), first.Tokens, det.Batch, det.Update != nil, det.Fate, len(det.Census))
	}
	var e map[string]string
	getJSON(t, url+"/api/trajectory?id=nope", http.StatusNotFound, &e)
	getJSON(t, url+"/api/trajectory", http.StatusBadRequest, &e)
	getJSON(t, url+"/api/trajectories?version=x", http.StatusBadRequest, &e)
	if !strings.Contains(e["error"], `version "x"`) {
		t.Errorf("bad version answered %v", e)
	}
}

// TestDamagedSnapshot: a changed byte of a snapshot file and of a release
// checkpoint are shown as hash failures, and the rest is still served.
func TestDamagedSnapshot(t *testing.T) {
	out, sum := demoRun(t)
	dir := copyDir(t, out)
	files, err := parquet.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	var victim string
	for _, f := range files {
		if f.Topic == "windows" {
			victim = f.Path
		}
	}
	testkit.FlipByte(t, victim)
	testkit.FlipByte(t, filepath.Join(dir, "releases", gpu.CheckpointName(2)))
	d, err := New(context.Background(), Config{Dir: dir, EvalSamples: 0})
	if err != nil {
		t.Fatal(err)
	}
	s := d.view.Summary
	h := s.Integrity.Hashes
	rel, _ := filepath.Rel(dir, victim)
	if len(h.Files.Failures) != 1 || h.Files.Failures[0].File != rel || !strings.Contains(h.Files.Failures[0].Error, "sha256") {
		t.Errorf("file failures %+v, want %s", h.Files.Failures, rel)
	}
	if len(h.ReleaseFailures) != 1 || h.ReleaseFailures[0].Version != 2 || h.ReleasesVerified != sum.Updates {
		t.Errorf("release failures %+v, %d verified", h.ReleaseFailures, h.ReleasesVerified)
	}
	if len(s.Systems.Windows) != 0 || s.Overview.Launched != sum.AttemptsLaunched {
		t.Errorf("the damaged windows file was read (%d windows) or the rest was not (%d launched)", len(s.Systems.Windows), s.Overview.Launched)
	}
	if s.Capability.EvalNote == "" || len(s.Capability.Eval) != 0 {
		t.Errorf("eval with --eval-samples 0: %q %+v", s.Capability.EvalNote, s.Capability.Eval)
	}
}

// damage flips a byte of the run's first batches file and removes the
// first file of partition 3 of valid, leaving its sidecar: one corrupt
// and one missing snapshot file. It returns their paths relative to dir.
func damage(t *testing.T, dir string) (corrupt, missing string) {
	t.Helper()
	files, err := parquet.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		switch {
		case f.Topic == "batches" && corrupt == "":
			corrupt = f.Path
		case f.Topic == "valid" && f.Partition == 3 && missing == "":
			missing = f.Path
		}
	}
	if corrupt == "" || missing == "" {
		t.Fatalf("the run has no batches file (%q) or no file of valid/3 (%q)", corrupt, missing)
	}
	testkit.FlipByte(t, corrupt)
	if err := os.Remove(missing); err != nil {
		t.Fatal(err)
	}
	corrupt, _ = filepath.Rel(dir, corrupt)
	missing, _ = filepath.Rel(dir, missing)
	return corrupt, missing
}

// TestUnreadableFiles: a corrupt snapshot file and a missing one (its
// sidecar left) are hash failures, the overview lists both as unreadable
// and marks every check it computed from the records partial — the lost
// check among them, whose difference the corrupt batches file causes —
// but not the updates, read from the release directory.
func TestUnreadableFiles(t *testing.T) {
	out, _ := demoRun(t)
	dir := copyDir(t, out)
	corrupt, missing := damage(t, dir)
	d, err := New(context.Background(), Config{Dir: dir, EvalSamples: 0})
	if err != nil {
		t.Fatal(err)
	}
	s := d.view.Summary
	failures := map[string]string{}
	for _, f := range s.Integrity.Hashes.Files.Failures {
		failures[f.File] = f.Error
	}
	if len(failures) != 2 || !strings.Contains(failures[corrupt], "sha256") || !strings.Contains(failures[missing], "file missing") ||
		!strings.Contains(failures[missing], missing) {
		t.Errorf("file failures %v, want %s corrupt and %s missing", failures, corrupt, missing)
	}
	o := s.Overview
	if len(o.UnreadableFiles) != 2 || !slices.Contains(o.UnreadableFiles, corrupt) || !slices.Contains(o.UnreadableFiles, missing) {
		t.Errorf("overview unreadable files %v, want %s and %s", o.UnreadableFiles, corrupt, missing)
	}
	if o.Batches != 0 {
		t.Errorf("%d batches read from a corrupt batches file", o.Batches)
	}
	const want = "partial: 2 files unreadable"
	checks := map[string]Check{}
	for _, c := range o.Checks {
		checks[c.Name] = c
		if wantPartial := c.Name != "updates"; (c.Partial == want) != wantPartial || (c.Partial != "" && c.Partial != want) {
			t.Errorf("check %+v: partial %q, want %q", c, c.Partial, map[bool]string{true: want}[wantPartial])
		}
	}
	if len(checks) != 8 || checks["lost"].OK || !checks["updates"].OK {
		t.Errorf("checks %+v: want 8, lost different, updates equal", o.Checks)
	}
	var js struct {
		Overview struct {
			Unreadable []string `json:"unreadable_files"`
		} `json:"overview"`
	}
	if err := json.Unmarshal(d.view.JSON, &js); err != nil || len(js.Overview.Unreadable) != 2 {
		t.Errorf("JSON overview.unreadable_files %v (%v)", js.Overview.Unreadable, err)
	}
}

// TestUnreadableFilesPage: the page says at the top of the overview which
// snapshot files are unreadable, and its checks read partial.
func TestUnreadableFilesPage(t *testing.T) {
	findChromium(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, _ := demoRun(t)
	dir := copyDir(t, out)
	corrupt, missing := damage(t, dir)
	d, err := New(ctx, Config{Dir: dir, EvalSamples: 0})
	if err != nil {
		t.Fatal(err)
	}
	b := startBrowser(t, ctx)
	b.navigate(ctx, serve(t, ctx, d)+"/")
	first := b.texts(ctx, `#overview .body > :first-child`, "id")
	files := b.texts(ctx, `#unreadable-files li`)
	if len(first) != 1 || first[0] != "unreadable-files" || len(files) != 2 || !slices.Contains(files, corrupt) || !slices.Contains(files, missing) {
		t.Errorf("overview begins with %q and lists %q; want the unreadable-files warning listing %s and %s", first, files, corrupt, missing)
	}
	checks := b.texts(ctx, `#overview table.checks tbody tr td:last-child`)
	if len(checks) != 8 || !slices.Contains(checks, "partial: 2 files unreadable") || slices.Contains(checks, "DIFFERENT") {
		t.Errorf("the checks against summary.json read %v, want them partial, none plainly DIFFERENT", checks)
	}
	b.screenshot(ctx, "#overview", filepath.Join(artifactsDir(t), "unreadable-overview.png"))
}

// TestUpLayout: given trajflow up's output directory (OUT/snapshots/
// run=<run>, OUT/releases, OUT/summary.json) or its snapshots directory,
// the dashboard finds the run, the releases and summary.json, and checks
// the overview against it.
func TestUpLayout(t *testing.T) {
	out, sum := demoRun(t)
	up := copyDir(t, out)
	if err := os.Mkdir(filepath.Join(up, parquet.SnapshotsDir), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(up, "run=demo"), filepath.Join(up, parquet.SnapshotsDir, "run=demo")); err != nil {
		t.Fatal(err)
	}
	for _, dir := range []string{up, filepath.Join(up, parquet.SnapshotsDir), filepath.Join(up, parquet.SnapshotsDir, "run=demo")} {
		d, err := New(context.Background(), Config{Dir: dir, EvalSamples: 0})
		if err != nil {
			t.Fatalf("%s: %v", dir, err)
		}
		s := d.view.Summary
		if len(s.Overview.Checks) != 8 || s.Integrity.Hashes.ReleasesVerified != sum.Updates+1 || s.Overview.Launched != sum.AttemptsLaunched {
			t.Errorf("%s: %d checks against summary.json (want 8), %d releases verified (want %d), %d launched",
				dir, len(s.Overview.Checks), s.Integrity.Hashes.ReleasesVerified, sum.Updates+1, s.Overview.Launched)
		}
		for _, c := range s.Overview.Checks {
			if !c.OK || c.Partial != "" {
				t.Errorf("%s: check %+v", dir, c)
			}
		}
	}
}

// TestMisalignedRow: the viewer reports a packed row whose old log-prob
// differs from the behavior log-prob the trajectory recorded.
func TestMisalignedRow(t *testing.T) {
	out, _ := demoRun(t)
	d, err := New(context.Background(), Config{Dir: out, EvalSamples: 0})
	if err != nil {
		t.Fatal(err)
	}
	r := d.state.Records
	var id string
	for tid := range r.Segments {
		id = tid
		break
	}
	ref := r.Segments[id]
	row := &r.Batches[ref.Batch].Rows[ref.Row]
	for i, s := range row.SegmentIDs {
		if int(s) == ref.Seg && row.ActionMask[i] == 1 {
			row.OldLogprobs[i] -= 0.25
			break
		}
	}
	det, err := d.view.Detail(id)
	if err != nil {
		t.Fatal(err)
	}
	if det.Batch.Aligned || !strings.Contains(det.Batch.Misaligned, "old log-prob") {
		t.Fatalf("batch %+v", det.Batch)
	}
}

// TestIntegrityRecords checks the integrity panel on records made for it:
// eval-id access by every path, attributed and unattributed quarantine,
// incidents and denials.
func TestIntegrityRecords(t *testing.T) {
	r := NewRecords()
	add := func(short string, v []byte, hs ...pipeline.Header) {
		r.Add(short, parquet.Message{Value: v, Headers: hs, Time: time.Unix(1, 0)})
	}
	enc := func(b []byte, err error) []byte {
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	traj := schemas.Trajectory{RecordID: "a1", TaskID: "t1", GroupID: "g1", Split: schemas.SplitTrain,
		TokenizerHash: rollout.TokenizerHash, ParserVersion: rollout.ParserVersion, Turns: []schemas.Turn{
			{PromptIDs: []int32{1, 2}, ActionIDs: []int32{7, 10, 9}, ActionLogprobs: []float32{-1, -1, 0}, Decision: schemas.DecisionDenied, DecisionReason: "key 0 is forbidden"},
			{PromptIDs: []int32{3}, ActionIDs: []int32{8}, ActionLogprobs: []float32{-2}, Decision: schemas.DecisionInvalid, DecisionReason: "1 tokens, want 3", PolicyVersion: 1}}}
	add("trajectories", enc(schemas.Trajectories.Encode(nil, []schemas.Trajectory{traj})))
	add("census", enc(schemas.EncodeCensus(schemas.CensusEvent{EventID: "e1", AttemptID: "a1", Kind: schemas.CensusQuarantined, Stage: "validate", Reason: evalTaskReason})))
	add("census", enc(schemas.EncodeCensus(schemas.CensusEvent{EventID: "e1", AttemptID: "a1", Kind: schemas.CensusQuarantined, Stage: "validate", Reason: evalTaskReason})))
	add("incidents", enc(schemas.EncodeIncident(schemas.Incident{IncidentID: "i1", AttemptID: "a1", Stage: "rollout", Reason: evalTaskReason})))
	q := func(reason, id string) []pipeline.Header {
		return []pipeline.Header{{Key: schemas.HeaderReason, Value: []byte(reason)}, {Key: schemas.HeaderStage, Value: []byte("validate")},
			{Key: schemas.HeaderID, Value: []byte(id)}, {Key: schemas.HeaderSourceTopic, Value: []byte("run.trajectories")},
			{Key: schemas.HeaderSourcePartition, Value: []byte("0")}, {Key: schemas.HeaderSourceOffset, Value: []byte("7")}}
	}
	add("quarantine", []byte("x"), q(evalTaskReason, "a1")...)
	add("quarantine", []byte("garbage"), q("undecodable", "unknown-id")...)
	add("quarantine", []byte("y"), q("header_mismatch", "")...)
	add("batches", []byte("not arrow"))
	in := integrity(&State{Records: r})
	want := EvalAccess{Incidents: 1, Quarantined: 1, Census: 1}
	if in.EvalAccess != want {
		t.Errorf("eval access %+v, want %+v", in.EvalAccess, want)
	}
	if in.Quarantine.Total != 3 || in.Quarantine.Unattributed != 2 || in.Hashes.HeaderMismatch != 1 || in.Quarantine.Records[0].Source != "run.trajectories/0@7" {
		t.Errorf("quarantine %+v, header mismatch %d", in.Quarantine, in.Hashes.HeaderMismatch)
	}
	if in.Denied.Turns != 1 || in.Denied.Reasons[0].Reason != "key 0 is forbidden" || in.Invalid.Turns != 1 || in.Invalid.ByVersion[0].Version != 1 {
		t.Errorf("denied %+v, invalid %+v", in.Denied, in.Invalid)
	}
	if in.IncidentTotal != 1 || in.Undecodable["batches"] != 1 || in.Redelivered["census"] != 1 {
		t.Errorf("incidents %d, undecodable %v, redelivered %v", in.IncidentTotal, in.Undecodable, in.Redelivered)
	}
	v := Assemble(&State{Records: r})
	det, err := v.Detail("a1")
	if err != nil {
		t.Fatal(err)
	}
	if len(det.Quarantine) != 1 || len(det.Incidents) != 1 || det.Turns[0].Call != "tool call lookup(k0)" || det.Turns[1].Call != "unparsable: 1 tokens, want 3" {
		t.Errorf("detail: quarantine %+v, incidents %+v, turns %+v", det.Quarantine, det.Incidents, det.Turns)
	}
}

// TestLiveWaitsForTopics: a live dashboard started before the run's
// topics exist serves an empty run and says why; unreachable brokers are
// an error naming them.
func TestLiveWaitsForTopics(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := New(ctx, Config{Brokers: []string{testkit.StartBroker(t)}, Run: "not-yet", EvalSamples: 0})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d.Handler())
	defer srv.Close()
	var s struct {
		Summary
		RefreshError string `json:"refresh_error"`
	}
	getJSON(t, srv.URL+"/api/summary", http.StatusOK, &s)
	if !strings.Contains(s.RefreshError, "run not-yet has no topics") || !s.Run.Live || s.Overview.Launched != 0 {
		t.Errorf("refresh error %q, run %+v", s.RefreshError, s.Run)
	}
	_, err = New(ctx, Config{Brokers: []string{"127.0.0.1:1"}, EvalSamples: 0})
	if err == nil || !strings.Contains(err.Error(), "127.0.0.1:1") || errors.Is(err, ErrConfig) {
		t.Errorf("unreachable brokers: %v", err)
	}
	_, err = New(ctx, Config{Dir: t.TempDir()})
	if !errors.Is(err, ErrConfig) {
		t.Errorf("a directory without a run: %v", err)
	}
}

// TestTextFamilyTurns: a trajectory of a tokenizer the dashboard does not
// have shows its token ids and the action texts its environment logged.
func TestTextFamilyTurns(t *testing.T) {
	r := NewRecords()
	art, _ := json.Marshal(rollout.TextArtifacts{Actions: []rollout.TextArtifactAction{
		{Turn: 0, Text: "<tool>calc: 2+3</tool>", Decision: schemas.DecisionOK, Tool: "calc", Arg: "2+3"},
		{Turn: 1, Text: "<answer>5</answer>", Decision: schemas.DecisionOK}}, AnswerTurn: 1})
	traj := schemas.Trajectory{RecordID: "x1", TaskID: "text-1", GroupID: "g", TokenizerHash: "sha256:smollm", Artifacts: string(art),
		Turns: []schemas.Turn{{PromptIDs: []int32{100, 101}, ActionIDs: []int32{500, 501}, ActionLogprobs: []float32{-0.5, -0.1}, ObservationIDs: []int32{7}},
			{Index: 1, ActionIDs: []int32{600}, ActionLogprobs: []float32{-0.2}}}}
	b, err := schemas.Trajectories.Encode(nil, []schemas.Trajectory{traj})
	if err != nil {
		t.Fatal(err)
	}
	r.Add("trajectories", parquet.Message{Value: b})
	det, err := Assemble(&State{Records: r}).Detail("x1")
	if err != nil {
		t.Fatal(err)
	}
	if len(det.Tokens) != 6 || det.Tokens[2].Text != "#500" || *det.Tokens[2].Logprob != -0.5 || det.Tokens[0].Logprob != nil ||
		det.Turns[0].Call != `calc(2+3) — "<tool>calc: 2+3</tool>"` || det.Turns[1].Call != "<answer>5</answer>" ||
		!strings.Contains(det.Vocabulary, "sha256:smollm") {
		t.Errorf("tokens %+v, turns %+v, vocabulary %q", det.Tokens, det.Turns, det.Vocabulary)
	}
}
