package pack

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// TestStageSyncWindows: in stop-and-synchronize mode a round whose groups
// are all filtered closes a window with a WindowRecord and no batch; a
// round with admitted members closes with a batch judged against the
// behavior version its records carry, even before the policy topic said so.
func TestStageSyncWindows(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	o := testOptions()
	o.BatchTokens, o.BatchGroups = 1<<20, 2
	st, err := NewStage(StageConfig{Options: o, Topics: topics, RunID: "r", ContractHash: "h", CountDecidedGroups: true})
	if err != nil {
		t.Fatal(err)
	}
	msg := func(off int64, rows ...schemas.Scored) pipeline.Message {
		b, err := schemas.ScoredTrajectories.Encode(nil, rows)
		if err != nil {
			t.Fatal(err)
		}
		return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Scored, Offset: off}, Key: []byte(rows[0].GroupID), Value: b}
	}
	zeroVar := func(id, group string, v int64) schemas.Scored {
		s := small(id, group, v, 3)
		s.Group.Filtered = "zero_variance"
		return s
	}
	windows := func(res pipeline.Result) []WindowRecord {
		var out []WindowRecord
		for _, o := range res.Outputs {
			if o.Topic == topics.Windows {
				var w WindowRecord
				if err := json.Unmarshal(o.Value, &w); err != nil {
					t.Fatal(err)
				}
				out = append(out, w)
			}
		}
		return out
	}
	count := func(res pipeline.Result, topic string) int {
		n := 0
		for _, o := range res.Outputs {
			if o.Topic == topic {
				n++
			}
		}
		return n
	}
	ctx := context.Background()
	// Round 0: two groups, every member filtered.
	res, err := st.Process(ctx, msg(0, zeroVar("a1", "g1", 0), zeroVar("a2", "g1", 0)))
	if err != nil || len(windows(res)) != 0 || res.Hold {
		t.Fatalf("first group: %+v %v", res, err)
	}
	res, err = st.Process(ctx, msg(1, zeroVar("b1", "g2", 0), zeroVar("b2", "g2", 0)))
	if err != nil {
		t.Fatal(err)
	}
	ws := windows(res)
	if len(ws) != 1 || ws[0].BatchID != "" || len(ws[0].Groups) != 2 || ws[0].Records != 4 || count(res, topics.Batches) != 0 {
		t.Fatalf("empty round: windows %+v, %d batches", ws, count(res, topics.Batches))
	}
	// Round 1 at behavior version 1 (the policy topic has not been read):
	// the second group's members all join the window that the first
	// member of the group made Ready.
	res, err = st.Process(ctx, msg(2, small("c1", "g3", 1, 3), small("c2", "g3", 1, 3)))
	if err != nil || !res.Hold || len(windows(res)) != 0 {
		t.Fatalf("third group: %+v %v", res, err)
	}
	res, err = st.Process(ctx, msg(3, small("d1", "g4", 1, 3), zeroVar("d2", "g4", 1), small("d3", "g4", 1, 3)))
	if err != nil {
		t.Fatal(err)
	}
	ws = windows(res)
	if len(ws) != 1 || ws[0].BatchID == "" || ws[0].TrainerVersion != 1 || len(ws[0].Admitted) != 4 || ws[0].Records != 5 || ws[0].MaxLag != 0 {
		t.Fatalf("second round: %+v", ws)
	}
	if count(res, topics.Batches) != 1 || len(res.Release) != 2 || res.Hold {
		t.Fatalf("second round: %d batches, release %v, hold %v", count(res, topics.Batches), res.Release, res.Hold)
	}
	var batch schemas.PackedBatch
	for _, o := range res.Outputs {
		if o.Topic == topics.Batches {
			if batch, err = schemas.PackedBatches.Decode(nil, o.Value); err != nil {
				t.Fatal(err)
			}
		}
	}
	if batch.BatchIndex != 0 || batch.TrainerVersion != 1 {
		t.Fatalf("batch index %d trainer version %d", batch.BatchIndex, batch.TrainerVersion)
	}
}

// TestStageTokenFullWindowClosesBeforeAdding: when the token budget fills in
// the middle of a group, the next member closes the window and opens the
// next one — it is never refused (a refusal here would quarantine a good
// record and, under redelivery, give one attempt two fates).
func TestStageTokenFullWindowClosesBeforeAdding(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	o := testOptions()
	one := small("x", "g", 0, 3)
	seg, _, err := Reconstruct(&one, 0, o)
	if err != nil {
		t.Fatal(err)
	}
	o.BatchTokens, o.BatchGroups = 2*seg.Len(), 0
	st, err := NewStage(StageConfig{Options: o, Topics: topics, RunID: "r", ContractHash: "h", DedupMemory: 4})
	if err != nil {
		t.Fatal(err)
	}
	rows := []schemas.Scored{small("a", "g1", 0, 3), small("b", "g1", 0, 3), small("c", "g1", 0, 3), small("d", "g2", 0, 3), small("e", "g2", 0, 3)}
	b, err := schemas.ScoredTrajectories.Encode(nil, rows)
	if err != nil {
		t.Fatal(err)
	}
	res, err := st.Process(context.Background(), pipeline.Message{Ref: pipeline.Ref{Topic: topics.Scored}, Key: []byte("g1"), Value: b})
	if err != nil {
		t.Fatal(err)
	}
	var batches, quarantined int
	for _, out := range res.Outputs {
		switch out.Topic {
		case topics.Batches:
			batches++
		case topics.Quarantine:
			quarantined++
		}
	}
	if quarantined != 0 || batches != 2 || !res.Hold {
		t.Fatalf("batches=%d quarantined=%d hold=%v, want 2 batches (a+b, c+d), e held, none quarantined", batches, quarantined, res.Hold)
	}
	// The deduplication memory is bounded: with room for 4 ids, the oldest
	// decided ids are forgotten, the newest are not.
	if st.win.Seen("a") || !st.win.Seen("e") {
		t.Fatalf("dedup memory: seen(a)=%v seen(e)=%v, want false, true", st.win.Seen("a"), st.win.Seen("e"))
	}
}
