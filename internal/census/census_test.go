package census_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/census"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/schemas"
)

// TestCensusFunnel counts a hand-made census: redelivered events count
// once, failures split into infrastructure and task, and quarantine and
// filter reasons are kept apart.
func TestCensusFunnel(t *testing.T) {
	dir := t.TempDir()
	run := "censusrun"
	ev := func(id, kind, reason string, infra bool) schemas.CensusEvent {
		return schemas.CensusEvent{EventID: id + kind + reason, RunID: run, AttemptID: id, Kind: kind, Stage: "s", Reason: reason, Infra: infra}
	}
	events := []schemas.CensusEvent{
		ev("a", schemas.CensusDispatched, "", false), ev("b", schemas.CensusDispatched, "", false),
		ev("c", schemas.CensusDispatched, "", false), ev("d", schemas.CensusDispatched, "", false),
		ev("a", schemas.CensusAdmitted, "", false), ev("a", schemas.CensusAdmitted, "", false), // redelivered
		ev("a", schemas.CensusTrained, "", false),
		ev("b", schemas.CensusFiltered, "zero_variance", false),
		ev("c", schemas.CensusFailed, "", true), ev("c", schemas.CensusQuarantined, "infra_invalid", false),
		ev("d", schemas.CensusFailed, "", false), ev("d", schemas.CensusFiltered, "stale", false),
		ev("a", schemas.CensusRetried, "timeout", true), ev("a1", schemas.CensusRetried, "timeout", true),
		ev("b", schemas.CensusRetried, "status_connection", true),
	}
	var msgs []parquet.Message
	for i, e := range events {
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
	s := synth.Default()
	rows := s.Group(0)
	b, err := schemas.Trajectories.Encode(nil, rows)
	if err != nil {
		t.Fatal(err)
	}
	tgt.Topic = run + ".trajectories"
	if _, _, err := parquet.WriteFile(tgt, 0, []parquet.Message{{Value: b}}, parquet.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	info, _ := json.Marshal(parquet.RunInfo{Run: run, ContractHash: "h"})
	if err := os.WriteFile(parquet.RunDir(dir, run)+"/"+parquet.RunInfoFile, info, 0o644); err != nil {
		t.Fatal(err)
	}
	rep, err := census.Collect(t.Context(), parquet.RunDir(dir, run))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		got  int
		want int
	}{
		{"distinct events", rep.Events, len(events) - 1},
		{"dispatched", rep.Count(schemas.CensusDispatched), 4},
		{"admitted", rep.Count(schemas.CensusAdmitted), 1},
		{"trained", rep.Count(schemas.CensusTrained), 1},
		{"failed infra", len(rep.FailedInfra), 1},
		{"failed task", len(rep.FailedTask), 1},
		{"filtered zero variance", len(rep.Reasons["filtered/zero_variance"]), 1},
		{"filtered stale", len(rep.Reasons["filtered/stale"]), 1},
		{"quarantined", len(rep.Reasons["quarantined/infra_invalid"]), 1},
		{"launched trajectories", len(rep.Launched), len(rows)},
		{"retried timeout", rep.Retried["timeout"], 2},
		{"retried status_connection", rep.Retried["status_connection"], 1},
	}
	for _, tc := range tests {
		if tc.got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, tc.got, tc.want)
		}
	}
	var out bytes.Buffer
	rep.Print(&out, 5)
	for _, want := range []string{"denominator: 4 launched attempts, from dispatched events", "zero_variance", "failed (infrastructure)", "latency ms", "environment calls retried (events, not attempts): 3"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
}

// TestCollectUnreadable: files of the topics the census reads that are
// corrupt or missing (their sidecar left) are all listed, the counts are
// those of the other files and the printed report says it is partial; a
// missing file of a topic the census does not read is a warning; census
// files that are all unreadable are not mistaken for a snapshot without
// a census topic.
func TestCollectUnreadable(t *testing.T) {
	const run = "censusbad"
	write := func(dir, topic string, msgs []parquet.Message) string {
		t.Helper()
		path, _, err := parquet.WriteFile(parquet.Target{Dir: dir, Run: run, Topic: run + "." + topic, ContractHash: "h"}, 0, msgs, parquet.WriteOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return path
	}
	events := func(from, n int) []parquet.Message {
		var msgs []parquet.Message
		for i := from; i < from+n; i++ {
			b, err := schemas.EncodeCensus(schemas.CensusEvent{EventID: fmt.Sprint(i), RunID: run, AttemptID: fmt.Sprint("a", i), Kind: schemas.CensusDispatched})
			if err != nil {
				t.Fatal(err)
			}
			msgs = append(msgs, parquet.Message{Offset: int64(i), Value: b})
		}
		return msgs
	}
	remove := func(path string) {
		t.Helper()
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name string
		// damage returns the unreadable files and the missing file of a
		// topic the census does not read.
		damage     func(census1, census2, trajs, valid string) (unreadable []string, warned string)
		dispatched int
	}{
		{"corrupt census, missing trajectories, missing valid", func(c1, c2, tr, v string) ([]string, string) {
			testkit.FlipByte(t, c2)
			remove(tr)
			remove(v)
			return []string{c2, tr}, v
		}, 3},
		{"every census file unreadable", func(c1, c2, tr, v string) ([]string, string) {
			testkit.FlipByte(t, c1)
			remove(c2)
			return []string{c1, c2}, ""
		}, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			c1, c2 := write(dir, "census", events(0, 3)), write(dir, "census", events(3, 2))
			rows := synth.Default().Group(0)
			b, err := schemas.Trajectories.Encode(nil, rows)
			if err != nil {
				t.Fatal(err)
			}
			tr := write(dir, "trajectories", []parquet.Message{{Value: b}})
			v := write(dir, "valid", []parquet.Message{{Value: b}})
			info, _ := json.Marshal(parquet.RunInfo{Run: run, ContractHash: "h"})
			if err := os.WriteFile(filepath.Join(parquet.RunDir(dir, run), parquet.RunInfoFile), info, 0o644); err != nil {
				t.Fatal(err)
			}
			unreadable, warned := tc.damage(c1, c2, tr, v)
			rep, err := census.Collect(t.Context(), parquet.RunDir(dir, run))
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, f := range rep.Unreadable {
				got = append(got, f.File.Path)
			}
			slices.Sort(got)
			slices.Sort(unreadable)
			if !rep.Partial() || !slices.Equal(got, unreadable) || rep.Count(schemas.CensusDispatched) != tc.dispatched {
				t.Errorf("unreadable %v (want %v), %d dispatched (want %d)", got, unreadable, rep.Count(schemas.CensusDispatched), tc.dispatched)
			}
			warnings := strings.Join(rep.Warnings, "\n")
			if warned != "" && (!strings.Contains(warnings, warned) || !strings.Contains(warnings, "file missing")) {
				t.Errorf("warnings %q do not name the missing %s", warnings, warned)
			}
			var out bytes.Buffer
			rep.Print(&out, 5)
			if want := fmt.Sprintf("PARTIAL: %d snapshot file(s) unreadable", len(unreadable)); !strings.HasPrefix(out.String(), want) {
				t.Errorf("report does not begin with %q:\n%s", want, out.String())
			}
			for _, p := range unreadable {
				if !strings.Contains(out.String(), p) {
					t.Errorf("report does not name %s", p)
				}
			}
		})
	}
}
