package census_test

import (
	"bytes"
	"encoding/json"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/census"
	"github.com/trajflow/trajflow/schemas"
)

// writeCensus writes a run snapshot holding only census events.
func writeCensus(t *testing.T, run string, events []schemas.CensusEvent) string {
	t.Helper()
	dir := t.TempDir()
	var msgs []parquet.Message
	for i, e := range events {
		if e.EventID == "" {
			e.EventID = e.AttemptID + "/" + e.Kind + "/" + e.Stage + "/" + e.Reason
		}
		b, err := schemas.EncodeCensus(e)
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, parquet.Message{Offset: int64(i), Value: b})
	}
	tgt := parquet.Target{Dir: dir, Run: run, Topic: run + ".census", ContractHash: "h"}
	if _, _, err := parquet.WriteFile(tgt, 0, msgs, parquet.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	info, _ := json.Marshal(parquet.RunInfo{Run: run, ContractHash: "h"})
	if err := os.WriteFile(parquet.RunDir(dir, run)+"/"+parquet.RunInfoFile, info, 0o644); err != nil {
		t.Fatal(err)
	}
	return parquet.RunDir(dir, run)
}

// TestCensusPerUpdate: two rounds of two attempts. Update 0 (begun at
// t=100) trains a0 and a1 of round 0; update 1 (t=200) trains b0 and
// excludes b1 at the update (12 stale tokens). b1, dispatched at 50 and
// completed at 250, is a straggler at both boundaries. Launched against
// trained: round 0 latencies 10 and 30 ms, all trained; round 1 latencies
// 20 and 200 ms, only the fast one trained (mean 110 launched, 20
// trained): the selection by latency the table shows.
func TestCensusPerUpdate(t *testing.T) {
	ev := func(id, kind string, round, at int64) schemas.CensusEvent {
		return schemas.CensusEvent{RunID: "r", AttemptID: id, Kind: kind, Stage: "s", Update: round, At: at}
	}
	done := func(id string, at, latMS, tokens int64) schemas.CensusEvent {
		e := ev(id, schemas.CensusCompleted, 0, at)
		e.LatencyUS, e.Tokens = latMS*1000, tokens
		return e
	}
	task := func(e schemas.CensusEvent, task string) schemas.CensusEvent { e.TaskID = task; return e }
	trained := func(id string, update, at, version int64) schemas.CensusEvent {
		e := ev(id, schemas.CensusTrained, update, at)
		e.Stage, e.PolicyVersion, e.Tokens = "train", version, 5
		return e
	}
	excl := ev("b1", schemas.CensusFiltered, 1, 200)
	excl.Stage, excl.Reason, excl.StaleTokens, excl.PolicyVersion = "train", schemas.ReasonStaleAtUpdate, 12, 1
	dir := writeCensus(t, "r", []schemas.CensusEvent{
		task(ev("a0", schemas.CensusDispatched, 0, 0), "t1"), task(ev("a1", schemas.CensusDispatched, 0, 0), "t2"),
		task(ev("b0", schemas.CensusDispatched, 1, 50), "t1"), task(ev("b1", schemas.CensusDispatched, 1, 50), "t3"),
		done("a0", 10, 10, 20), done("a1", 30, 30, 40), done("b0", 70, 20, 30), done("b1", 250, 200, 50),
		trained("a0", 0, 100, 1), trained("a1", 0, 100, 1), trained("b0", 1, 200, 2), excl,
		task(ev("c0", schemas.CensusDispatched, 2, 300), "t4"), // round 2 fed no update (yet)
	})
	rep, err := census.Collect(t.Context(), dir)
	if err != nil {
		t.Fatal(err)
	}
	rows := rep.Updates()
	if len(rows) != 2 {
		t.Fatalf("%d update rows, want 2: %+v", len(rows), rows)
	}
	u0, u1 := rows[0], rows[1]
	if u0.Update != 0 || u0.Version != 1 || u0.Trained != 2 || u0.Launched != 2 || u0.Excluded != 0 ||
		u0.LatencyLaunched != 20 || u0.LatencyTrained != 20 || u0.TasksTrained != 2 || u0.Stragglers != 1 {
		t.Fatalf("update 0: %+v", u0)
	}
	// At update 0 (t=100) b0 had completed (70), b1 had not.
	if u0.StragglersExcluded != 1 || u0.StragglersTrained != 0 {
		t.Fatalf("update 0 stragglers: %+v", u0)
	}
	if u1.Update != 1 || u1.Version != 2 || u1.Trained != 1 || u1.Excluded != 1 || u1.Launched != 2 ||
		u1.LatencyLaunched != 110 || u1.LatencyTrained != 20 || u1.TasksLaunched != 2 || u1.TasksTrained != 1 ||
		u1.StaleTokens != 12 || u1.Stragglers != 1 || u1.StragglersExcluded != 1 {
		t.Fatalf("update 1: %+v", u1)
	}
	if share, stale, _ := rep.StaleShare(); stale != 12 || share != 0 {
		t.Fatalf("stale %d share %v (no trajectories recorded: share 0)", stale, share)
	}
	var out bytes.Buffer
	rep.PrintUpdates(&out)
	for _, want := range []string{"stale share", "per update", "stragglers", "rounds that fed no update: [2] (1 attempts"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
}

// TestCensusTimeline: a0 dispatched at 0, started at 4 ms, completed at
// 10 ms, trained at 100 ms: 4 ms waiting, 6 running, 90 to its update; a1
// started at 1 ms (and again at 3 ms: the first start counts), completed
// at 30, trained at 100: 1, 29, 70. b0 was excluded at the update and c0
// has no started event: neither is in the timeline.
func TestCensusTimeline(t *testing.T) {
	ev := func(id, kind string, at int64) schemas.CensusEvent {
		return schemas.CensusEvent{RunID: "r", AttemptID: id, Kind: kind, Stage: "s", At: at * 1000}
	}
	trained := func(id string, at int64) schemas.CensusEvent {
		e := ev(id, schemas.CensusTrained, at)
		e.Stage, e.PolicyVersion = "train", 1
		return e
	}
	excl := ev("b0", schemas.CensusFiltered, 100)
	excl.Stage, excl.Reason, excl.StaleTokens = "train", schemas.ReasonStaleAtUpdate, 3
	restart := ev("a1", schemas.CensusStarted, 3)
	restart.EventID = "a1/started/again"
	dir := writeCensus(t, "r", []schemas.CensusEvent{
		ev("a0", schemas.CensusDispatched, 0), ev("a1", schemas.CensusDispatched, 0), ev("b0", schemas.CensusDispatched, 0), ev("c0", schemas.CensusDispatched, 0),
		restart, ev("a0", schemas.CensusStarted, 4), ev("a1", schemas.CensusStarted, 1), ev("b0", schemas.CensusStarted, 2),
		ev("a0", schemas.CensusCompleted, 10), ev("a1", schemas.CensusCompleted, 30), ev("b0", schemas.CensusCompleted, 50), ev("c0", schemas.CensusCompleted, 20),
		trained("a0", 100), trained("a1", 100), excl, trained("c0", 100),
	})
	rep, err := census.Collect(t.Context(), dir)
	if err != nil {
		t.Fatal(err)
	}
	tl := rep.Timeline()
	want := census.Timeline{Waiting: []float64{1, 4}, Running: []float64{6, 29}, ToUpdate: []float64{70, 90}}
	if !reflect.DeepEqual(tl, want) {
		t.Fatalf("timeline %+v, want %+v", tl, want)
	}
	var out bytes.Buffer
	rep.Print(&out, 5)
	if !strings.Contains(out.String(), "time in flight of the trained attempts") || !strings.Contains(out.String(), "n=2") {
		t.Errorf("census output lacks the timeline:\n%s", out.String())
	}
}
