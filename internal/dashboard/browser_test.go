package dashboard

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/schemas"
)

// evalSamples is the hidden-eval attempts per task of the test runs and of
// the dashboards that re-measure them.
const evalSamples = 2

// serve serves d on a free port of 127.0.0.1 until the test ends and
// returns its origin.
func serve(t *testing.T, ctx context.Context, d *Dashboard) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	sctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.ServeListener(sctx, ln) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("dashboard server: %v", err)
		}
	})
	return "http://" + ln.Addr().String()
}

// TestBrowserSnapshot loads the dashboard of a demo run's snapshot
// directory in headless Chromium and checks what the page shows against
// the run's summary.json and records.
func TestBrowserSnapshot(t *testing.T) {
	findChromium(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	out, sum := demoRun(t)
	d, err := New(ctx, Config{Dir: out, EvalSamples: evalSamples})
	if err != nil {
		t.Fatal(err)
	}
	origin := serve(t, ctx, d)
	b := startBrowser(t, ctx)
	b.navigate(ctx, origin+"/")
	shots := artifactsDir(t)
	checkPanels(t, ctx, b, sum, false)
	checks := b.texts(ctx, `#overview table.checks tbody tr td:last-child`)
	if len(checks) < 8 || slices.ContainsFunc(checks, func(s string) bool { return s != "equal" }) {
		t.Errorf("the checks against summary.json read %v, want every one equal", checks)
	}
	checkLatencyPanel(t, ctx, b, d)
	b.screenshot(ctx, "", filepath.Join(shots, "snapshot-page.png"))
	checkViewer(t, ctx, b, d, filepath.Join(shots, "snapshot-viewer.png"))
	checkOrigin(t, b, origin)
}

// TestBrowserLive runs the demo loop against an embedded broker and
// serves the dashboard live from the run's topics while it runs; once the
// run ends, the page (refreshing by itself) shows the run's final counts.
func TestBrowserLive(t *testing.T) {
	findChromium(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	br, err := kafka.StartBroker(ctx, kafka.BrokerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer br.Close()
	out := t.TempDir()
	const run = "dashlive"
	done := make(chan *loop.Summary, 1)
	go func() { // joined below: the test waits for the run
		s, err := loop.Run(ctx, loop.Options{Out: out, Brokers: []string{br.Addr()}, RunID: run,
			Updates: 3, Seed: 1, EvalSamples: evalSamples, Quiet: true}, io.Discard)
		if err != nil {
			t.Errorf("demo run: %v", err)
		}
		done <- s
	}()
	waitFile(t, ctx, filepath.Join(out, "releases", "policy-v00000000.json"), done)
	d, err := New(ctx, Config{Brokers: []string{br.Addr()}, Run: run, Releases: filepath.Join(out, "releases"),
		Refresh: 500 * time.Millisecond, EvalSamples: evalSamples})
	if err != nil {
		t.Fatal(err)
	}
	origin := serve(t, ctx, d)
	b := startBrowser(t, ctx)
	b.navigate(ctx, origin+"/")
	sum := <-done
	if sum == nil {
		t.FailNow()
	}
	// The page reloads its panels every 5 s; wait for one showing the end:
	// every overview field the check compares, since the census's last
	// events (the filtered and undecided counts) may land after the
	// trainer's last update.
	want, err := json.Marshal(overviewWant(sum))
	if err != nil {
		t.Fatal(err)
	}
	b.waitFor(ctx, "the final counts", fmt.Sprintf(`Object.entries(%s).every(([k, v]) => `+
		`(document.querySelector('#overview [data-field="' + k + '"] .v') || {}).textContent === v)`, want), 90*time.Second)
	shots := artifactsDir(t)
	checkPanels(t, ctx, b, sum, true)
	groups := b.texts(ctx, `table.consumer-lag tbody tr td:first-child`)
	for _, stage := range loop.Stages {
		if !slices.Contains(groups, run+"."+stage) {
			t.Errorf("consumer lag lists groups %v, missing %s.%s", groups, run, stage)
		}
	}
	b.screenshot(ctx, "", filepath.Join(shots, "live-page.png"))
	checkViewer(t, ctx, b, d, filepath.Join(shots, "live-viewer.png"))
	checkOrigin(t, b, origin)
}

// waitFile waits for path to exist (or the run to end first).
func waitFile(t *testing.T, ctx context.Context, path string, done chan *loop.Summary) {
	t.Helper()
	for {
		if _, err := os.Stat(path); err == nil {
			return
		}
		select {
		case s := <-done:
			done <- s
			t.Fatalf("the run ended before %s appeared", path)
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// checkPanels checks every panel of the page against the run's summary.
func checkPanels(t *testing.T, ctx context.Context, b *browser, sum *loop.Summary, live bool) {
	t.Helper()
	fields := map[string]string{}
	b.eval(ctx, `Object.fromEntries([...document.querySelectorAll('#overview [data-field]')].map(e => [e.dataset.field, e.querySelector('.v').textContent]))`, &fields)
	want := overviewWant(sum)
	for k, v := range want {
		if fields[k] != v {
			t.Errorf("overview %s shows %q, summary.json says %s", k, fields[k], v)
		}
	}
	charts := b.texts(ctx, `svg.chart`, "dataset.chart")
	for _, id := range []string{"success-by-version", "pass-at-k", "validity", "eval-success", "loss", "kl", "clip", "ratio", "entropy",
		"reward-components", "advantages", "lengths", "stage-tokens", "trainer-tokens", "yield-losses", "sync", "policy-lag", "attempt-latency", "denials"} {
		if !slices.Contains(charts, id) {
			t.Errorf("no chart %q on the page (charts: %v)", id, charts)
		}
	}
	var n struct{ Success, Eval, Loss, Stages int }
	b.eval(ctx, `({Success: document.querySelectorAll('svg[data-chart="success-by-version"] circle.pt').length,
		Eval: document.querySelectorAll('svg[data-chart="eval-success"] circle.pt[data-series="re-measured"]').length,
		Loss: document.querySelectorAll('svg[data-chart="loss"] circle.pt[data-series="loss"]').length,
		Stages: document.querySelectorAll('svg[data-chart="stage-tokens"] polyline').length})`, &n)
	if n.Success != sum.Updates || n.Loss != sum.Updates || n.Eval < 2 || n.Stages < 5 {
		t.Errorf("chart points: success %d and loss %d (want %d: versions 0..%d sampled, %d updates), eval %d (>= 2), stage lines %d (>= 5)",
			n.Success, n.Loss, sum.Updates, sum.Updates-1, sum.Updates, n.Eval, n.Stages)
	}
	header := b.texts(ctx, `#run-meta`)
	if live != (len(header) == 1 && strings.Contains(header[0], "live")) {
		t.Errorf("header %q for a live=%v run", header, live)
	}
}

// checkLatencyPanel checks the systems panel's latency section against
// the summary the page was served: the long tail's count and one row of
// the slowest table per slowest attempt, the first the longest.
func checkLatencyPanel(t *testing.T, ctx context.Context, b *browser, d *Dashboard) {
	t.Helper()
	d.mu.RLock()
	l := d.view.Summary.Systems.Latency
	d.mu.RUnlock()
	tail := b.texts(ctx, `#tail-attempts`)
	rows := b.texts(ctx, `table.slowest tbody tr td:nth-child(4)`)
	if len(tail) != 1 || tail[0] != strconv.Itoa(l.Tail) || len(rows) != len(l.Slowest) || len(rows) == 0 ||
		rows[0] != fmt.Sprintf("%.3f", l.Slowest[0].Seconds) {
		t.Errorf("latency section: tail %q, slowest seconds %q; served tail %d, slowest %+v", tail, rows, l.Tail, l.Slowest)
	}
}

// overviewWant is what the overview's fields must show for the run
// summarized by sum.
func overviewWant(sum *loop.Summary) map[string]string {
	return map[string]string{
		"updates": strconv.Itoa(sum.Updates), "attempts_launched": strconv.Itoa(sum.AttemptsLaunched),
		"trajectories_admitted": strconv.Itoa(sum.TrajectoriesAdmitted), "trajectories_filtered": strconv.Itoa(sum.TrajectoriesFiltered),
		"duplicates_admitted": strconv.Itoa(sum.DuplicatesAdmitted), "undecided": strconv.Itoa(sum.Lost),
		"eval_success_initial": fmt.Sprintf("%.3f", sum.EvalSuccessInitial), "eval_success_final": fmt.Sprintf("%.3f", sum.EvalSuccessFinal),
		"batches": strconv.Itoa(len(sum.BatchHashes)), "rounds": strconv.Itoa(sum.Rounds),
	}
}

// checkViewer finds an admitted multi-turn trajectory through the
// viewer's form and checks its tokens, colours and census history.
func checkViewer(t *testing.T, ctx context.Context, b *browser, d *Dashboard, shot string) {
	t.Helper()
	d.mu.RLock()
	var det *TrajectoryDetail
	for _, row := range d.view.Find(Query{Outcome: schemas.CensusAdmitted, Limit: 1 << 20}).Rows {
		if row.Turns >= 2 {
			det, _ = d.view.Detail(row.ID)
			break
		}
	}
	d.mu.RUnlock()
	if det == nil || det.Batch == nil {
		t.Fatal("no admitted trajectory of two turns or more in the run")
	}
	// The run has ended, but the dashboard may still be reading the
	// census events of the last update: wait until the one of this
	// trajectory's training is in the view (the page shows the view).
	waited := time.Now()
	for deadline := time.Now().Add(30 * time.Second); !hasKind(det.Census, schemas.CensusTrained); {
		if time.Now().After(deadline) || ctx.Err() != nil {
			t.Fatalf("trajectory %s (batch %s): no trained event in its census %v after 30 s", det.ID, det.Batch.BatchID, det.Census)
		}
		time.Sleep(200 * time.Millisecond)
		d.mu.RLock()
		again, err := d.view.Detail(det.ID)
		d.mu.RUnlock()
		if err == nil && again != nil && again.Batch != nil {
			det = again
		}
	}
	t.Logf("trajectory %s: its trained event was in the view after %v", det.ID, time.Since(waited).Round(time.Millisecond))
	actions := 0
	for _, tok := range det.Tokens {
		if tok.Role == "action" {
			actions++
		}
	}
	b.eval(ctx, fmt.Sprintf(`document.getElementById("q-id").value = %q; document.getElementById("find").click(); true`, det.ID), nil)
	b.waitFor(ctx, "the search result", `document.querySelectorAll("#results tr.pick").length === 1`, 30*time.Second)
	b.eval(ctx, `document.querySelector("#results tr.pick").click(); true`, nil)
	b.waitFor(ctx, "the trajectory", fmt.Sprintf(`document.querySelector("#trajectory[data-id='%s'] #tokens .tok")`, det.ID), 30*time.Second)
	count := func(mode string) (all, coloured int) {
		var c struct{ All, Col int }
		b.eval(ctx, fmt.Sprintf(`document.getElementById("cmode-%s").click();
			({All: document.querySelectorAll("#tokens .tok").length, Col: document.querySelectorAll("#tokens .tok.col").length})`, mode), &c)
		return c.All, c.Col
	}
	all, byLogprob := count("logprob")
	if all != len(det.Tokens) || byLogprob != actions {
		t.Errorf("viewer: %d token spans, %d coloured by log-prob; want %d tokens, %d action tokens", all, byLogprob, len(det.Tokens), actions)
	}
	if _, byMask := count("mask"); int64(byMask) != det.Batch.Trained {
		t.Errorf("viewer: %d spans coloured by mask, want the %d trained tokens", byMask, det.Batch.Trained)
	}
	if _, byAdv := count("advantage"); int64(byAdv) != det.Batch.Trained {
		t.Errorf("viewer: %d spans coloured by advantage, want the %d trained tokens", byAdv, det.Batch.Trained)
	}
	kinds := b.texts(ctx, `#census-history tbody tr td:nth-child(2)`)
	var want []string
	for _, ev := range det.Census {
		want = append(want, ev.Kind)
	}
	if !slices.Equal(kinds, want) || !slices.Contains(kinds, schemas.CensusTrained) {
		t.Errorf("census history shows %v, the census holds %v (with a trained event)", kinds, want)
	}
	trained := b.texts(ctx, `#trained-by`)
	if len(trained) != 1 || !strings.Contains(trained[0], det.Batch.BatchID) || !strings.Contains(trained[0], "input ids equal the stream") ||
		det.Update == nil || !strings.Contains(trained[0], fmt.Sprintf("→ %d", det.Update.Version)) {
		t.Errorf("batch and update section: %q (batch %s)", trained, det.Batch.BatchID)
	}
	b.call(ctx, "Emulation.setDeviceMetricsOverride", map[string]any{"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": false}, nil)
	// The sticky header would cover the top of the region.
	b.eval(ctx, `document.getElementById("cmode-logprob").click(); document.querySelector("header").style.position = "static"; true`, nil)
	b.screenshot(ctx, "#detail", shot)
	if ex := b.pageExceptions(); len(ex) > 0 {
		t.Errorf("the page threw: %v", ex)
	}
}

// checkOrigin asserts that every request of the page went to the
// dashboard itself.
func checkOrigin(t *testing.T, b *browser, origin string) {
	t.Helper()
	all, off := b.offOrigin(origin)
	if len(all) < 5 || len(off) > 0 {
		t.Errorf("requests of the page: %d, outside %s: %v", len(all), origin, off)
	}
}

// texts returns a property (default textContent) of every element
// matching selector.
func (b *browser) texts(ctx context.Context, selector string, prop ...string) []string {
	b.t.Helper()
	p := "textContent"
	if len(prop) > 0 {
		p = prop[0]
	}
	var out []string
	b.eval(ctx, fmt.Sprintf(`[...document.querySelectorAll(%q)].map(e => String(e.%s))`, selector, p), &out)
	return out
}

// hasKind reports whether a census history holds an event of kind.
func hasKind(history []schemas.CensusEvent, kind string) bool {
	return slices.ContainsFunc(history, func(ev schemas.CensusEvent) bool { return ev.Kind == kind })
}
