package pack

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// TestStageDeadlines: in asynchronous mode (max_lag 1, two groups a window)
// group A was dispatched with P and Q at version 0 and straggles; B, C and
// D were dispatched at version 1 and finish first (A's rollout started at
// version 0: census "started"). A's last chance to train
// within max_lag is batch 1 (trained at version 1): with Deadlines batch 1
// keeps a place for it, C and D wait (held) for batch 2, and A's turns are
// at most one version old when trained. Without Deadlines, B and C fill
// batch 1 and A lands in batch 2, trained at version 2, where its version-0
// turn is stale. A reservation whose group never comes is given up after
// DeadlineWait; one whose group was quarantined upstream at once.
func TestStageDeadlines(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	o := testOptions()
	o.BatchTokens, o.BatchGroups, o.MaxLag, o.StalePolicy = 1<<20, 2, 1, StaleMaskTurns
	off := map[string]int64{}
	at := func(topic string) pipeline.Ref {
		r := pipeline.Ref{Topic: topic, Offset: off[topic]}
		off[topic]++
		return r
	}
	census := func(ev schemas.CensusEvent) pipeline.Message {
		ev.RunID = "r"
		out, err := stagekit.Census(topics.Census, ev)
		if err != nil {
			t.Fatal(err)
		}
		return pipeline.Message{Ref: at(topics.Census), Key: out.Key, Value: out.Value, Headers: out.Headers}
	}
	dispatched := func(group string, v int64) pipeline.Message {
		return census(schemas.CensusEvent{AttemptID: group + "-1", GroupID: group, Kind: schemas.CensusDispatched, Stage: "dispatch", PolicyVersion: v})
	}
	started := func(group string, v int64) pipeline.Message {
		return census(schemas.CensusEvent{AttemptID: group + "-1", GroupID: group, Kind: schemas.CensusStarted, Stage: "rollout", PolicyVersion: v})
	}
	group := func(g string, versions ...int64) pipeline.Message {
		var turns []turnSpec
		for _, v := range versions {
			turns = append(turns, turnSpec{prompt: []int32{1, 2}, action: []int32{7, 8, 9}, logprobs: []float32{-0.1, -0.2, -0.3}, obs: []int32{3}, version: v, adv: 1})
		}
		m := scoredMsg(t, topics.Scored, 0, scored(g+"-1", g, turns...), scored(g+"-2", g, turns...))
		m.Ref = at(topics.Scored)
		return m
	}
	release := func(v int64) pipeline.Message {
		b, err := schemas.EncodeRelease(schemas.PolicyRelease{PolicyVersion: v, Ready: true, NextBatch: v})
		if err != nil {
			t.Fatal(err)
		}
		return pipeline.Message{Ref: at(topics.Policy), Value: b}
	}
	type window struct {
		groups  string
		version int64 // the trainer version the batch is trained at
	}
	cases := []struct {
		name      string
		deadlines bool
		running   bool               // A's rollout started (census "started") before B, C, D came
		straggler []pipeline.Message // what happens to A after B, C, D
		tick      bool
		want      []window
		held      int // scored messages still held at the end
	}{
		{"deadlines", true, true, []pipeline.Message{group("A", 0, 1)}, false,
			[]window{{"P,Q", 0}, {"A,B", 1}, {"C,D", 2}}, 0},
		{"first come", false, true, []pipeline.Message{group("A", 0, 1)}, false,
			[]window{{"P,Q", 0}, {"B,C", 1}, {"A,D", 2}}, 0},
		// Still waiting for a worker: it will start on a newer version.
		{"queued", true, false, []pipeline.Message{group("A", 1, 2)}, false,
			[]window{{"P,Q", 0}, {"B,C", 1}, {"A,D", 2}}, 0},
		{"never comes", true, true, nil, true,
			[]window{{"P,Q", 0}, {"B,C", 1}}, 1},
		{"quarantined upstream", true, true, []pipeline.Message{census(schemas.CensusEvent{AttemptID: "A-1", GroupID: "A",
			Kind: schemas.CensusQuarantined, Stage: "validate", Reason: "bad_tokens"})}, false,
			[]window{{"P,Q", 0}, {"B,C", 1}}, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in := []pipeline.Message{
				dispatched("P", 0), dispatched("Q", 0), dispatched("A", 0), started("P", 0), started("Q", 0),
			}
			if tc.running {
				in = append(in, started("A", 0))
			}
			in = append(in,
				group("P", 0), group("Q", 0), // batch 0, trained at version 0
				release(1),
				dispatched("B", 1), dispatched("C", 1), dispatched("D", 1),
				group("B", 1), group("C", 1), group("D", 1),
			)
			in = append(in, tc.straggler...)
			st, err := NewStage(StageConfig{Options: o, Topics: topics, RunID: "r", ContractHash: "h",
				CountDecidedGroups: true, Deadlines: tc.deadlines})
			if err != nil {
				t.Fatal(err)
			}
			dc := pipeline.DriveConfig{QuarantineTopic: topics.Quarantine}
			if tc.tick {
				dc.TickAt = time.Now().Add(time.Minute)
			}
			d, err := pipeline.Drive(t.Context(), st, in, dc)
			if err != nil {
				t.Fatal(err)
			}
			var got []window
			for _, out := range d.On(topics.Windows) {
				w, err := schemas.DecodeWindow(out.Value)
				if err != nil {
					t.Fatal(err)
				}
				// Batch i is trained at version i: one release per batch.
				got = append(got, window{strings.Join(w.Groups, ","), w.BatchIndex})
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("windows %v, want %v", got, tc.want)
			}
			held := 0
			for _, r := range d.Held {
				if r.Topic == topics.Scored {
					held++
				}
			}
			if held != tc.held {
				t.Fatalf("%d scored messages held at the end (%v), want %d", held, d.Held, tc.held)
			}
			// Every scored message is released once, or still held.
			seen := map[pipeline.Ref]int{}
			for _, r := range d.Released {
				seen[r]++
			}
			for _, m := range in {
				if m.Topic == topics.Scored && seen[m.Ref]+boolInt(slices.Contains(d.Held, m.Ref)) != 1 {
					t.Fatalf("scored message at %v released %d times (held %v)", m.Ref, seen[m.Ref], d.Held)
				}
			}
		})
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestStageDeadlinesAfterRestart: a restarted pack re-reads the census from
// its committed offset, which a held failure event can keep behind the
// groups its closed windows decided; their "dispatched" events reserve
// nothing, so the next window fills with the groups that come.
func TestStageDeadlinesAfterRestart(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	o := testOptions()
	o.BatchTokens, o.BatchGroups, o.MaxLag = 1<<20, 2, 1
	cfg := StageConfig{Options: o, Topics: topics, RunID: "r", ContractHash: "h", CountDecidedGroups: true, Deadlines: true}
	var coff, soff int64
	event := func(kind, stage, group string, v int64) pipeline.Message {
		out, err := stagekit.Census(topics.Census, schemas.CensusEvent{RunID: "r", AttemptID: group + "-1", GroupID: group,
			Kind: kind, Stage: stage, PolicyVersion: v})
		if err != nil {
			t.Fatal(err)
		}
		coff++
		return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Census, Offset: coff}, Key: out.Key, Value: out.Value, Headers: out.Headers}
	}
	dispatched := func(group string, v int64) pipeline.Message {
		return event(schemas.CensusDispatched, "dispatch", group, v)
	}
	started := func(group string, v int64) pipeline.Message {
		return event(schemas.CensusStarted, "rollout", group, v)
	}
	group := func(g string, v int64) pipeline.Message {
		soff++
		return scoredMsg(t, topics.Scored, soff, small(g+"-1", g, v, 3), small(g+"-2", g, v, 4))
	}
	b, err := schemas.EncodeRelease(schemas.PolicyRelease{PolicyVersion: 1, Ready: true, NextBatch: 1})
	if err != nil {
		t.Fatal(err)
	}
	rel := pipeline.Message{Ref: pipeline.Ref{Topic: topics.Policy}, Value: b}

	first := driveStage(t, cfg, []pipeline.Message{dispatched("P", 0), dispatched("Q", 0), started("P", 0), started("Q", 0),
		group("P", 0), group("Q", 0)}, nil)
	if n := len(first.On(topics.Windows)); n != 1 {
		t.Fatalf("first run: %d windows, want 1", n)
	}
	coff = 0
	in := []pipeline.Message{dispatched("P", 0), dispatched("Q", 0), started("P", 0), started("Q", 0), rel, dispatched("B", 1), dispatched("C", 1), group("B", 1), group("C", 1)}
	again := driveStage(t, cfg, in, pipeline.MemScanner{topics.Windows: first.Messages(topics.Windows), topics.Batches: first.Messages(topics.Batches)})
	ws := again.On(topics.Windows)
	if len(ws) != 1 {
		t.Fatalf("after the restart %d windows (held %v), want B and C's", len(ws), again.Held)
	}
	w, err := schemas.DecodeWindow(ws[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	if w.BatchIndex != 1 || !slices.Equal(w.Groups, []string{"B", "C"}) {
		t.Fatalf("after the restart window %d of %v, want batch 1 of [B C]", w.BatchIndex, w.Groups)
	}
}
