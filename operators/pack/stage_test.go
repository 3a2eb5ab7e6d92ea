package pack

import (
	"context"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// scoredMsg is a scored-topic message at offset off holding rows (one
// group's records).
func scoredMsg(t *testing.T, topic string, off int64, rows ...schemas.Scored) pipeline.Message {
	t.Helper()
	b, err := schemas.ScoredTrajectories.Encode(nil, rows)
	if err != nil {
		t.Fatal(err)
	}
	return pipeline.Message{Ref: pipeline.Ref{Topic: topic, Offset: off}, Key: []byte(rows[0].GroupID), Value: b}
}

// driveStage runs a new pack stage of cfg over in, with the topics of
// scan as what it reads back at start (nil: nothing).
func driveStage(t *testing.T, cfg StageConfig, in []pipeline.Message, scan pipeline.MemScanner) *pipeline.Driven {
	t.Helper()
	st, err := NewStage(cfg)
	if err != nil {
		t.Fatal(err)
	}
	d, err := pipeline.Drive(context.Background(), st, in, pipeline.DriveConfig{QuarantineTopic: cfg.Topics.Quarantine,
		Env: pipeline.EnvConfig{Scanner: scan}})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

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
		return scoredMsg(t, topics.Scored, off, rows...)
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
				w, err := schemas.DecodeWindow(o.Value)
				if err != nil {
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
	// Round 0: two groups, every member filtered. The first group's
	// message is held until its window is decided (its offset must not be
	// committed while the decision lives only in the open window).
	res, err := st.Process(ctx, msg(0, zeroVar("a1", "g1", 0), zeroVar("a2", "g1", 0)))
	if err != nil || len(windows(res)) != 0 || !res.Hold {
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
	if res.Hold || !slices.ContainsFunc(res.Release, func(r pipeline.Ref) bool { return r.Offset == 0 }) {
		t.Fatalf("closing the empty round releases the first group's message: hold %v release %v", res.Hold, res.Release)
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

// TestStageRestartMidWindowDecidesTheRound reproduces the pack hang of a
// kill mid-window: part of a round reached pack (one group filtered, one
// admitted), pack died with the window open, and a new pack instance was
// redelivered only what the old one had not committed. Every record the
// open window decided must be among those (held), so the restarted window
// decides the whole round and writes its window record — otherwise the
// round can never complete and synchronous dispatch waits forever.
func TestStageRestartMidWindowDecidesTheRound(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	o := testOptions()
	o.BatchTokens, o.BatchGroups = 1<<20, 3
	cfg := StageConfig{Options: o, Topics: topics, RunID: "r", ContractHash: "h", CountDecidedGroups: true}
	msg := func(off int64, rows ...schemas.Scored) pipeline.Message {
		return scoredMsg(t, topics.Scored, off, rows...)
	}
	zeroVar := func(id, group string) schemas.Scored {
		s := small(id, group, 0, 3)
		s.Group.Filtered = "zero_variance"
		return s
	}
	round := []pipeline.Message{
		msg(0, zeroVar("a1", "g1"), zeroVar("a2", "g1")),         // filtered group
		msg(1, small("b1", "g2", 0, 3), small("b2", "g2", 0, 3)), // admitted group
		msg(2, small("c1", "g3", 0, 3), small("c2", "g3", 0, 3)), // arrives after the restart
	}
	drive := func(in []pipeline.Message) *pipeline.Driven { return driveStage(t, cfg, in, nil) }
	// The first life sees two groups of three and dies with the window open:
	// what it holds is what a restart gets redelivered.
	first := drive(round[:2])
	if len(first.On(topics.Windows)) != 0 {
		t.Fatal("the window closed with two of three groups")
	}
	var redelivered []pipeline.Message
	for _, ref := range first.Held {
		redelivered = append(redelivered, round[ref.Offset])
	}
	if len(redelivered) != 2 {
		t.Fatalf("held %v: every decided record of the open window must be held (the filtered group's too)", first.Held)
	}
	second := drive(append(redelivered, round[2]))
	ws := second.On(topics.Windows)
	if len(ws) != 1 {
		t.Fatalf("after the restart %d window records, want 1: the round never completes", len(ws))
	}
	w, err := schemas.DecodeWindow(ws[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Groups) != 3 || len(second.Held) != 0 {
		t.Fatalf("window groups %v, still held %v", w.Groups, second.Held)
	}
}

// TestStageMaxWaitClosesAFilteredWindow: --window-max-wait closes a window
// whose oldest decision is older than the wait, even when every record in
// it was filtered (nothing admitted).
func TestStageMaxWaitClosesAFilteredWindow(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	o := testOptions()
	o.BatchTokens, o.BatchGroups = 1<<20, 4
	now := time.Unix(1000, 0)
	st, err := NewStage(StageConfig{Options: o, Topics: topics, RunID: "r", ContractHash: "h", CountDecidedGroups: true,
		MaxWait: time.Second, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	s := small("a1", "g1", 0, 3)
	s.Group.Filtered = "zero_variance"
	b, err := schemas.ScoredTrajectories.Encode(nil, []schemas.Scored{s})
	if err != nil {
		t.Fatal(err)
	}
	d, err := pipeline.Drive(context.Background(), st, []pipeline.Message{{Ref: pipeline.Ref{Topic: topics.Scored}, Key: []byte("g1"), Value: b}},
		pipeline.DriveConfig{QuarantineTopic: topics.Quarantine, TickAt: now.Add(2 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	ws := d.On(topics.Windows)
	if len(ws) != 1 || len(d.Held) != 0 {
		t.Fatalf("%d window records, held %v: want the filtered window closed by the wait", len(ws), d.Held)
	}
	w, _ := schemas.DecodeWindow(ws[0].Value)
	if w.ClosedBy != "timeout" || w.BatchID != "" {
		t.Fatalf("window %+v, want closed by timeout without a batch", w)
	}
}

// TestStageRestartAfterCloseKeepsTheClosedWindow: pack closed a window
// (batch and window record written) and died before its inputs were
// committed, so a restart is redelivered the closed window's records
// along with the next round. The restarted pack must take them as
// decided — the admitted ones from the batches topic, the filtered ones
// from the windows topic — and decide the next round in a window of its
// own; counting a redelivered filtered group in the open window would
// close it with part of the next round, whose other groups could then
// never fill a window. A window whose batch never reached the batches
// topic did not close: its records are decided again, into the same
// window. The opposite, a batch without its window record, cannot
// happen: the batch is written only once the record is acknowledged.
func TestStageRestartAfterCloseKeepsTheClosedWindow(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	o := testOptions()
	o.BatchTokens, o.BatchGroups = 1<<20, 2
	cfg := StageConfig{Options: o, Topics: topics, RunID: "r", ContractHash: "h", CountDecidedGroups: true}
	msg := func(off int64, rows ...schemas.Scored) pipeline.Message {
		return scoredMsg(t, topics.Scored, off, rows...)
	}
	zeroVar := func(id, group string, v int64) schemas.Scored {
		s := small(id, group, v, 3)
		s.Group.Filtered = "zero_variance"
		return s
	}
	in := []pipeline.Message{
		msg(0, zeroVar("a1", "g1", 0), zeroVar("a2", "g1", 0)),   // round 0, filtered
		msg(1, small("b1", "g2", 0, 3), small("b2", "g2", 0, 3)), // round 0, admitted: the window closes
		msg(2, small("c1", "g3", 1, 3), small("c2", "g3", 1, 3)), // round 1
		msg(3, zeroVar("d1", "g4", 1), zeroVar("d2", "g4", 1)),   // round 1, filtered
	}
	drive := func(in []pipeline.Message, scan pipeline.MemScanner) *pipeline.Driven {
		return driveStage(t, cfg, in, scan)
	}
	asMessages := func(outs []pipeline.Output) []pipeline.Message {
		var ms []pipeline.Message
		for i, o := range outs {
			ms = append(ms, pipeline.Message{Ref: pipeline.Ref{Topic: o.Topic, Offset: int64(i)}, Key: o.Key, Value: o.Value})
		}
		return ms
	}
	groupsOf := func(d *pipeline.Driven) [][]string {
		var out [][]string
		for _, o := range d.On(topics.Windows) {
			w, err := schemas.DecodeWindow(o.Value)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, w.Groups)
		}
		return out
	}
	first := drive(in[:2], nil)
	if got := groupsOf(first); len(got) != 1 || len(first.On(topics.Batches)) != 1 {
		t.Fatalf("first life: windows %v, %d batches", got, len(first.On(topics.Batches)))
	}
	// The window record is written first, the batch only once it is
	// acknowledged: a batch whose window record was lost cannot happen.
	win := slices.IndexFunc(first.Outputs, func(o pipeline.Output) bool { return o.Topic == topics.Windows })
	bat := slices.IndexFunc(first.Outputs, func(o pipeline.Output) bool { return o.Topic == topics.Batches })
	if win < 0 || bat < win || !first.Outputs[bat].After || first.Outputs[win].After {
		t.Fatalf("outputs: window record at %d, batch at %d (After %v); want the record first and the batch after it", win, bat, bat >= 0 && first.Outputs[bat].After)
	}
	// Batch and window record were written; nothing was committed.
	second := drive(in, pipeline.MemScanner{
		topics.Batches: asMessages(first.On(topics.Batches)), topics.Windows: asMessages(first.On(topics.Windows)),
	})
	if got := groupsOf(second); len(got) != 1 || !slices.Equal(got[0], []string{"g3", "g4"}) || len(second.Held) != 0 {
		t.Fatalf("after the restart windows %v (want one, of round 1: [g3 g4]), held %v", got, second.Held)
	}
	// Only the window record was written: the window is decided again.
	third := drive(in, pipeline.MemScanner{topics.Windows: asMessages(first.On(topics.Windows))})
	if got := groupsOf(third); len(got) != 2 || !slices.Equal(got[0], []string{"g1", "g2"}) || !slices.Equal(got[1], []string{"g3", "g4"}) {
		t.Fatalf("batch lost: windows %v, want [g1 g2] then [g3 g4]", got)
	}
}

// TestStageCostLedger: every window record carries the cost of its
// decided episodes, admitted and filtered, and a batch's
// trajflow-window-cost header the cost of every window of its index — a
// window that filtered everything packs no batch, and its cost rides on
// the next batch, also across a restart between the two (rebuilt from
// the windows topic). Expected values are hand-summed from the records.
func TestStageCostLedger(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	o := testOptions()
	o.BatchTokens, o.BatchGroups = 1<<20, 2
	cfg := StageConfig{Options: o, Topics: topics, RunID: "r", ContractHash: "h", CountDecidedGroups: true}
	// rec is a one-turn record of n action tokens (n+3 stream tokens)
	// whose turn took gen and env microseconds.
	rec := func(id, group string, v int64, n int, filtered bool, gen, env int64) schemas.Scored {
		s := small(id, group, v, n)
		s.Turns[0].GenLatencyUS, s.Turns[0].EnvLatencyUS = gen, env
		if filtered {
			s.Group.Filtered = "zero_variance"
		}
		return s
	}
	msg := func(off int64, rows ...schemas.Scored) pipeline.Message {
		return scoredMsg(t, topics.Scored, off, rows...)
	}
	round0 := []pipeline.Message{ // every record filtered: a window without a batch
		msg(0, rec("a1", "g1", 0, 3, true, 1_000, 2_000), rec("a2", "g1", 0, 3, true, 3_000, 4_000)),
		msg(1, rec("b1", "g2", 0, 4, true, 5_000, 0), rec("b2", "g2", 0, 4, true, 0, 6_000)),
	}
	round1 := []pipeline.Message{
		msg(2, rec("c1", "g3", 1, 3, false, 10_000, 20_000), rec("c2", "g3", 1, 3, false, 30_000, 40_000)),
		msg(3, rec("d1", "g4", 1, 5, false, 50_000, 60_000), rec("d2", "g4", 1, 3, true, 70_000, 80_000)),
	}
	const h = 3.6e9 // microseconds per hour
	wantWindow0 := schemas.WindowCost{Windows: 1,
		Filtered: schemas.EpisodeCost{Episodes: 4, RolloutTokens: 6 + 6 + 7 + 7, GenerationHours: 9_000 / h, EnvironmentHours: 12_000 / h}}
	wantWindow1 := schemas.WindowCost{Windows: 1,
		Admitted: schemas.EpisodeCost{Episodes: 3, RolloutTokens: 6 + 6 + 8, GenerationHours: 90_000 / h, EnvironmentHours: 120_000 / h},
		Filtered: schemas.EpisodeCost{Episodes: 1, RolloutTokens: 6, GenerationHours: 70_000 / h, EnvironmentHours: 80_000 / h}}
	wantHeader := schemas.WindowCost{Windows: 2, Admitted: wantWindow1.Admitted,
		Filtered: schemas.EpisodeCost{Episodes: 5, RolloutTokens: 32, GenerationHours: 79_000 / h, EnvironmentHours: 92_000 / h}}
	drive := func(in []pipeline.Message, scan pipeline.MemScanner) *pipeline.Driven {
		return driveStage(t, cfg, in, scan)
	}
	windowCosts := func(d *pipeline.Driven) []schemas.WindowCost {
		var out []schemas.WindowCost
		for _, m := range d.On(topics.Windows) {
			w, err := schemas.DecodeWindow(m.Value)
			if err != nil || w.Cost == nil {
				t.Fatalf("window record %s: cost %v, %v", m.Value, w.Cost, err)
			}
			out = append(out, *w.Cost)
		}
		return out
	}
	header := func(d *pipeline.Driven) schemas.WindowCost {
		bs := d.On(topics.Batches)
		if len(bs) != 1 {
			t.Fatalf("%d batches, want 1", len(bs))
		}
		m := pipeline.Message{Headers: bs[0].Headers}
		c, err := schemas.DecodeWindowCost(m.Header(schemas.HeaderWindowCost))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	one := drive(append(slices.Clone(round0), round1...), nil)
	if got := windowCosts(one); len(got) != 2 || !costNear(got[0], wantWindow0) || !costNear(got[1], wantWindow1) {
		t.Fatalf("window costs %+v\nwant %+v and %+v", got, wantWindow0, wantWindow1)
	}
	if got := header(one); !costNear(got, wantHeader) {
		t.Fatalf("batch cost header %+v\nwant %+v", got, wantHeader)
	}
	// A restart after the batch-less window: the cost it carries is read
	// back from the windows topic.
	first := drive(round0, nil)
	if len(first.On(topics.Windows)) != 1 || len(first.On(topics.Batches)) != 0 || len(first.Held) != 0 {
		t.Fatalf("round 0: %d windows, %d batches, held %v", len(first.On(topics.Windows)), len(first.On(topics.Batches)), first.Held)
	}
	second := drive(round1, pipeline.MemScanner{topics.Windows: first.Messages(topics.Windows)})
	if got := header(second); !costNear(got, wantHeader) {
		t.Fatalf("after a restart the batch cost header is %+v\nwant %+v", got, wantHeader)
	}
}

// costNear compares window costs: counts exactly, hours to 1e-12
// relative (they are sums of per-episode quotients).
func costNear(a, b schemas.WindowCost) bool {
	near := func(x, y float64) bool { return math.Abs(x-y) <= 1e-12*math.Max(math.Abs(x), math.Abs(y)) }
	ep := func(x, y schemas.EpisodeCost) bool {
		return x.Episodes == y.Episodes && x.RolloutTokens == y.RolloutTokens &&
			near(x.GenerationHours, y.GenerationHours) && near(x.EnvironmentHours, y.EnvironmentHours)
	}
	return a.Windows == b.Windows && ep(a.Admitted, b.Admitted) && ep(a.Filtered, b.Filtered) && ep(a.Failed, b.Failed)
}

// TestStageFailedCost: the failed generation the census reports while a
// window is open — attempts refused for good after they ran, tries that
// failed for a reason of the infrastructure — is the window's Failed cost
// and rides on the batch's cost header; the events are held until the
// window closes, and a restarted pack redelivered them does not count
// them again (the window record lists them). Other events, and other
// runs', are passed over. Expected values are hand-summed.
func TestStageFailedCost(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	o := testOptions()
	o.BatchTokens, o.BatchGroups = 1<<20, 1
	cfg := StageConfig{Options: o, Topics: topics, RunID: "r", ContractHash: "h", CountDecidedGroups: true}
	census := func(off int64, ev schemas.CensusEvent) pipeline.Message {
		if ev.RunID == "" {
			ev.RunID = "r"
		}
		out, err := stagekit.Census(topics.Census, ev)
		if err != nil {
			t.Fatal(err)
		}
		return pipeline.Message{Ref: pipeline.Ref{Topic: topics.Census, Partition: 1, Offset: off}, Key: out.Key, Value: out.Value, Headers: out.Headers}
	}
	events := []pipeline.Message{
		// counted: 1 episode, 40 tokens, 0.001 h
		census(0, schemas.CensusEvent{AttemptID: "a1", Kind: schemas.CensusQuarantined, Stage: "validate", Reason: "bad_tokens", Tokens: 40, LatencyUS: 3_600_000}),
		// counted: a try run again, 0.002 h, no episode
		census(1, schemas.CensusEvent{AttemptID: "a2", Kind: schemas.CensusFailed, Stage: "rollout", Reason: "policy_timeout", Infra: true, LatencyUS: 7_200_000}),
		// counted: a try that timed out, 0.0005 h
		census(2, schemas.CensusEvent{AttemptID: "a3", Kind: schemas.CensusTimedOut, Stage: "rollout", Reason: "timed_out", Infra: true, LatencyUS: 1_800_000}),
		// counted: quarantined after its last try, 1 episode
		census(3, schemas.CensusEvent{AttemptID: "a3", Kind: schemas.CensusQuarantined, Stage: "rollout", Reason: "infra_exhausted", Infra: true}),
		// passed over: a completed episode, a task refused before it ran,
		// another run's failure, the first event again
		census(4, schemas.CensusEvent{AttemptID: "a4", Kind: schemas.CensusCompleted, Stage: "rollout", Tokens: 99, LatencyUS: 1}),
		census(5, schemas.CensusEvent{AttemptID: "a5", Kind: schemas.CensusQuarantined, Stage: "dispatch", Reason: "eval_task_id"}),
		census(6, schemas.CensusEvent{RunID: "other", AttemptID: "a6", Kind: schemas.CensusQuarantined, Stage: "validate", Tokens: 7}),
		census(7, schemas.CensusEvent{AttemptID: "a1", Kind: schemas.CensusQuarantined, Stage: "validate", Reason: "bad_tokens", Tokens: 40, LatencyUS: 3_600_000}),
	}
	round := func(off int64, g string) pipeline.Message {
		return scoredMsg(t, topics.Scored, off, small(g+"-1", g, 0, 3), small(g+"-2", g, 0, 4))
	}
	const h = 3.6e9
	wantFailed := schemas.EpisodeCost{Episodes: 2, RolloutTokens: 40, EnvironmentHours: (3_600_000 + 7_200_000 + 1_800_000) / h}

	in := append(slices.Clone(events), round(0, "g1"))
	one := driveStage(t, cfg, in, nil)
	ws := one.On(topics.Windows)
	if len(ws) != 1 {
		t.Fatalf("%d window records, want 1", len(ws))
	}
	w, err := schemas.DecodeWindow(ws[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	if w.Cost == nil || !costNear(schemas.WindowCost{Windows: 1, Admitted: w.Cost.Admitted, Failed: wantFailed}, *w.Cost) {
		t.Fatalf("window cost %+v, want failed %+v", w.Cost, wantFailed)
	}
	if len(w.FailedEvents) != 4 {
		t.Fatalf("window record lists failed events %v, want the 4 counted", w.FailedEvents)
	}
	bs := one.On(topics.Batches)
	if len(bs) != 1 {
		t.Fatalf("%d batches, want 1", len(bs))
	}
	bm := pipeline.Message{Headers: bs[0].Headers}
	hc, err := schemas.DecodeWindowCost(bm.Header(schemas.HeaderWindowCost))
	if err != nil || !costNear(hc, *w.Cost) {
		t.Fatalf("batch cost header %+v (%v), want the window's %+v", hc, err, *w.Cost)
	}
	if len(one.Held) != 0 || one.Quarantined != 0 {
		t.Fatalf("held %v, %d quarantined after the window closed", one.Held, one.Quarantined)
	}
	for i := range 4 {
		if !slices.Contains(one.Released, events[i].Ref) {
			t.Fatalf("counted census event at %v not released with its window: %v", events[i].Ref, one.Released)
		}
	}
	// Held until the window closes: no window, the counted events stay held.
	open := driveStage(t, cfg, events, nil)
	if len(open.Held) != 4 || len(open.On(topics.Windows)) != 0 {
		t.Fatalf("no window closed: held %v, want the 4 counted events", open.Held)
	}
	// A restart redelivered the events (the window closed, the commit was
	// lost): the next window counts none of them again.
	again := driveStage(t, cfg, append(slices.Clone(events), round(1, "g2")),
		pipeline.MemScanner{topics.Windows: one.Messages(topics.Windows), topics.Batches: one.Messages(topics.Batches)})
	ws = again.On(topics.Windows)
	if len(ws) != 1 {
		t.Fatalf("after the restart %d window records, want 1", len(ws))
	}
	w2, err := schemas.DecodeWindow(ws[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	if w2.Cost == nil || w2.Cost.Failed != (schemas.EpisodeCost{}) || len(w2.FailedEvents) != 0 {
		t.Fatalf("after the restart the window counts failures again: %+v %v", w2.Cost, w2.FailedEvents)
	}
}

// TestStageRestartWritesTheClosedWindowsCensus: pack closed windows (their
// records and batches acknowledged) and died before their census events
// were all written and before its inputs were committed. The redelivered
// group's decided records write their census events again, with the ids
// of the first writing and the decisions the window records list; a
// record of the group whose window did not close (its batch lost) is
// decided again. Here a token budget of one record closes a window after
// every record, so the one message of group g1 spans three windows, and
// the third one's batch is lost.
func TestStageRestartWritesTheClosedWindowsCensus(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	o := testOptions()
	o.BatchTokens = 1
	cfg := StageConfig{Options: o, Topics: topics, RunID: "r", ContractHash: "h"}
	stale := small("r0", "g1", 0, 3)
	stale.Turns[0].PolicyVersion = -5 // lag 5 > max lag 1 at version 0: filtered when added
	in := []pipeline.Message{scoredMsg(t, topics.Scored, 0, stale, small("r1", "g1", 0, 3), small("r2", "g1", 0, 3), small("r3", "g1", 0, 3))}
	first := driveStage(t, cfg, in, nil)
	if n := len(first.On(topics.Windows)); n != 3 || len(first.On(topics.Batches)) != 3 {
		t.Fatalf("first life: %d windows, %d batches; want 3 and 3", n, len(first.On(topics.Batches)))
	}
	census := func(d *pipeline.Driven) map[string]schemas.CensusEvent {
		out := map[string]schemas.CensusEvent{}
		for _, o := range d.On(topics.Census) {
			ev, err := schemas.DecodeCensus(o.Value)
			if err != nil {
				t.Fatal(err)
			}
			out[ev.AttemptID] = ev
		}
		return out
	}
	want := census(first)
	if len(want) != 4 || want["r0"].Kind != schemas.CensusFiltered || want["r0"].Reason != string(FilterStale) {
		t.Fatalf("first life census %+v: want r0 filtered stale and r1..r3 admitted", want)
	}
	// Windows 1-3 and the batches of the first two were written; no census
	// event, no commit.
	batches := first.Messages(topics.Batches)[:2]
	second := driveStage(t, cfg, in, pipeline.MemScanner{topics.Batches: batches, topics.Windows: first.Messages(topics.Windows)})
	got := census(second)
	for _, id := range []string{"r0", "r1", "r2", "r3"} {
		g, w := got[id], want[id]
		if g.EventID != w.EventID || g.Kind != w.Kind || g.Reason != w.Reason || g.BatchID != w.BatchID || g.Tokens != w.Tokens || g.StaleTokens != w.StaleTokens {
			t.Errorf("%s: census after the restart %+v, want the first life's %+v", id, g, w)
		}
	}
	// r3's window did not close: it is decided again, into a batch of the
	// same index (the next after the two on the topic).
	if ws := second.On(topics.Windows); len(ws) != 1 {
		t.Fatalf("after the restart %d windows, want 1 (r3's)", len(ws))
	} else if w, _ := schemas.DecodeWindow(ws[0].Value); !slices.Equal(w.Admitted, []string{"r3"}) || w.BatchIndex != 2 {
		t.Fatalf("after the restart window %+v, want r3 admitted at batch index 2", w)
	}
	if len(second.Held) != 0 {
		t.Fatalf("held after the restart: %v", second.Held)
	}
}
