package integration

import (
	"context"
	"errors"
	"hash/fnv"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// startOp runs a stage in process with deps until the test ends.
func startOp(t testing.TB, run *testkit.Run, name string, deps operators.Deps) {
	t.Helper()
	deps.Contract, deps.Topics = run.Contract, run.Topics
	if deps.VocabSize == 0 {
		deps.VocabSize = 32000
	}
	deps.PartialGroupTimeout, deps.WindowMaxWait = 5*time.Second, time.Second
	op, err := operators.NewOperator(name, deps, run.Config(name, t.TempDir()))
	if err != nil {
		t.Fatalf("operator %s: %v", name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- op.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, pipeline.ErrStopped) {
			t.Errorf("operator %s: %v", name, err)
		}
	})
}

// judge is a test reward evaluator: for an id with bucket 0 it always fails
// (service down), for buckets 1 and 2 it fails the first two calls then
// succeeds (transient), otherwise it succeeds.
type judge struct {
	mu    sync.Mutex
	calls map[string]int
}

func bucket(id string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(id))
	return h.Sum32() % 16
}

func (*judge) Name() string    { return "judge" }
func (*judge) Version() string { return "1" }
func (j *judge) Evaluate(_ context.Context, t *schemas.Trajectory) ([]schemas.RewardComponent, error) {
	j.mu.Lock()
	j.calls[t.RecordID]++
	n := j.calls[t.RecordID]
	j.mu.Unlock()
	switch b := bucket(t.RecordID); {
	case b == 0:
		return nil, errors.New("judge service unavailable")
	case (b == 1 || b == 2) && n <= 2:
		return nil, errors.New("judge timeout")
	}
	return []schemas.RewardComponent{{Raw: 1}}, nil
}

// evaluatorScenario: a reward evaluator that fails transiently is retried
// and the attempt admitted; one that always fails sends the attempt to
// quarantine as reward_unavailable, flagged infrastructure, never a task
// failure; an environment timeout (status timed_out) is quarantined as
// timed_out, infrastructure too (docs/PIPELINE.md §8, docs/SYSTEMS.md §14).
func evaluatorScenario(t *testing.T, addr, broker string) {
	start := time.Now()
	path, c := runContract(t, uniqueRun("eval"), "")
	_ = path
	c.Rewards = append(c.Rewards, c.Rewards[0])
	c.Rewards[len(c.Rewards)-1].Name, c.Rewards[len(c.Rewards)-1].Version = "judge", "1"
	c.Rewards[len(c.Rewards)-1].Weight = 1
	run := startRun(t, c, addr)
	s := run.Synth(100, 1000)
	const groups = 40
	var ids []string
	var timedOut []string
	var msgs [][]schemas.Trajectory
	for g := int64(0); g < groups; g++ {
		rows := s.Group(g)
		if g%10 == 3 { // an environment timeout in every tenth group
			rows[1].Status = schemas.StatusTimedOut
			timedOut = append(timedOut, rows[1].RecordID)
		}
		for _, r := range rows {
			ids = append(ids, r.RecordID)
		}
		msgs = append(msgs, rows)
	}
	produceRows(t, run, run.Topics.Trajectories, msgs)
	j := &judge{calls: map[string]int{}}
	startOp(t, run, "validate", operators.Deps{})
	startOp(t, run, "reward", operators.Deps{Evaluators: []reward.Evaluator{j}})
	startOp(t, run, "advantage", operators.Deps{})
	startOp(t, run, "pack", operators.Deps{})
	counts, rep := settle(t, run, ids, 60*time.Second)
	record(t, scenarioResult{Name: "reward evaluator failures + environment timeouts", Broker: broker, Counts: counts, Reasons: reasons(rep.Quarantined), Elapsed: time.Since(start)})
	if counts.Lost != 0 || counts.Duplicated != 0 {
		t.Errorf("lost=%d duplicated=%d", counts.Lost, counts.Duplicated)
	}
	census := censusByAttempt(t, run)
	isTimedOut := map[string]bool{}
	for _, id := range timedOut {
		isTimedOut[id] = true
	}
	var always, transient int
	for _, id := range ids {
		evs := census[id]
		for _, ev := range evs {
			if ev.Kind == schemas.CensusFailed {
				t.Errorf("%s counted as a task failure: %+v", id, ev)
			}
		}
		q := rep.Quarantined[id]
		switch {
		case isTimedOut[id]:
			if q != "timed_out" || !infraQuarantine(evs) {
				t.Errorf("environment timeout %s: quarantine %q, census %+v; want timed_out, infra", id, q, evs)
			}
		case bucket(id) == 0:
			always++
			if q != "reward_unavailable" || !infraQuarantine(evs) {
				t.Errorf("always-failing evaluator %s: quarantine %q, census %+v; want reward_unavailable, infra", id, q, evs)
			}
		case bucket(id) == 1 || bucket(id) == 2:
			transient++
			if q == "reward_unavailable" {
				t.Errorf("transient evaluator failure %s was not retried", id)
			}
			j.mu.Lock()
			n := j.calls[id]
			j.mu.Unlock()
			if q == "" && n < 3 {
				t.Errorf("transient %s: %d evaluator calls, want >= 3", id, n)
			}
		}
	}
	if always == 0 || transient == 0 {
		t.Fatalf("the id buckets selected %d always-failing and %d transient attempts", always, transient)
	}
	checkFailedCost(t, run, msgs, census, always+len(timedOut))
	t.Logf("always-failing %d, transient %d, environment timeouts %d", always, transient, len(timedOut))
}

// checkFailedCost: the refused episodes' cost reaches pack's window
// records (docs/SYSTEMS.md §17): each counted census event is a
// quarantine of this run, counted once, with the refused episode's stream
// tokens; at most the refused episodes, and some (the failures are spread
// over the run; only those pack reads after the last window stay held).
func checkFailedCost(t *testing.T, run *testkit.Run, msgs [][]schemas.Trajectory, census map[string][]schemas.CensusEvent, refused int) {
	t.Helper()
	streams := map[string]int64{}
	for _, rows := range msgs {
		for _, r := range rows {
			for _, tu := range r.Turns {
				streams[r.RecordID] += int64(len(tu.PromptIDs) + len(tu.ActionIDs) + len(tu.ObservationIDs))
			}
		}
	}
	byEvent := map[string]schemas.CensusEvent{}
	for _, evs := range census {
		for _, ev := range evs {
			byEvent[ev.EventID] = ev
		}
	}
	counted := map[string]bool{}
	var episodes int
	var tokens, want int64
	for _, m := range run.ReadAll(t, run.Topics.Windows) {
		w, err := schemas.DecodeWindow(m.Value)
		if err != nil || w.Cost == nil {
			t.Fatalf("window record %s: cost %v, %v", m.Ref, w.Cost, err)
		}
		episodes += w.Cost.Failed.Episodes
		tokens += w.Cost.Failed.RolloutTokens
		for _, id := range w.FailedEvents {
			ev, ok := byEvent[id]
			if counted[id] || !ok || ev.Kind != schemas.CensusQuarantined {
				t.Fatalf("window %d counts failure event %s (counted before %v): census %+v", w.BatchIndex, id, counted[id], ev)
			}
			counted[id] = true
			want += streams[ev.AttemptID]
		}
	}
	if episodes == 0 || episodes != len(counted) || episodes > refused || tokens != want {
		t.Fatalf("windows count %d failed episodes, %d tokens (%d events, their episodes' tokens %d); %d episodes were refused",
			episodes, tokens, len(counted), want, refused)
	}
	t.Logf("failed generation in the windows: %d of %d refused episodes, %d tokens", episodes, refused, tokens)
}

// infraQuarantine reports whether evs holds a quarantine event flagged
// infrastructure.
func infraQuarantine(evs []schemas.CensusEvent) bool {
	for _, ev := range evs {
		if ev.Kind == schemas.CensusQuarantined && ev.Infra {
			return true
		}
	}
	return false
}

// censusByAttempt reads the run's census, grouped by attempt id.
func censusByAttempt(t testing.TB, run *testkit.Run) map[string][]schemas.CensusEvent {
	t.Helper()
	cfg := run.Config("census-read", "")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out := map[string][]schemas.CensusEvent{}
	err := pipeline.ScanTail(ctx, &cfg, run.Topics.Census, 0, func(m pipeline.Message) error {
		ev, err := schemas.DecodeCensus(m.Value)
		if err != nil {
			return err
		}
		out[ev.AttemptID] = append(out[ev.AttemptID], ev)
		return nil
	})
	if err != nil {
		t.Fatalf("census: %v", err)
	}
	return out
}

// produceRows writes one message per row set to topic (keyed by group).
func produceRows(t testing.TB, run *testkit.Run, topic string, msgs [][]schemas.Trajectory) {
	t.Helper()
	var raw []rawMsg
	for _, rows := range msgs {
		b, err := schemas.Trajectories.Encode(nil, rows)
		if err != nil {
			t.Fatal(err)
		}
		raw = append(raw, rawMsg{key: rows[0].GroupID, value: b})
	}
	produceRaw(t, run, topic, raw)
}

type rawMsg struct {
	key     string
	value   []byte
	headers map[string]string
}

func TestEvaluatorFailuresEmbedded(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end")
	}
	evaluatorScenario(t, "", "embedded (in process)")
}
