package dispatch_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// TestDispatchRestart: a dispatcher restarted from the topics (its local
// state gone) neither repeats nor skips a round, and its attempts are the
// same as those it would have dispatched without the restart.
func TestDispatchRestart(t *testing.T) {
	c := contract.Default()
	run := testkit.StartRun(t, c, "")
	tr := &kafkago.Transport{} // not DefaultTransport, whose pools outlive the writer
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{Addr: kafkago.TCP(run.Addr), RequiredAcks: kafkago.RequireAll, BatchTimeout: time.Millisecond, Transport: tr}
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	produce := func(topic string, v []byte) {
		t.Helper()
		if err := w.WriteMessages(ctx, kafkago.Message{Topic: topic, Key: []byte("k"), Value: v}); err != nil {
			t.Fatal(err)
		}
	}
	type tasksState struct {
		messages int
		groups   map[string]int64 // group -> round
		attempts map[string]bool
	}
	read := func() tasksState {
		st := tasksState{groups: map[string]int64{}, attempts: map[string]bool{}}
		cfg := run.Config("reader", "")
		err := pipeline.ScanTail(ctx, &cfg, run.Topics.Tasks, 0, func(m pipeline.Message) error {
			st.messages++
			atts, err := schemas.TaskAttempts.Decode(nil, m.Value)
			if err != nil {
				return err
			}
			for _, a := range atts {
				st.attempts[a.AttemptID] = true
			}
			var r int64
			json.Unmarshal(m.Header("trajflow-round"), &r)
			st.groups[string(m.Key)] = r
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	waitFor := func(n int) tasksState {
		t.Helper()
		for {
			st := read()
			if st.messages >= n || ctx.Err() != nil {
				return st
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	rel, _ := schemas.EncodeRelease(schemas.PolicyRelease{PolicyVersion: 0, Ready: true})
	produce(run.Topics.Policy, rel)

	stop := run.StartOperator(t, "dispatch", t.TempDir())
	st := waitFor(16)
	if st.messages != 16 || len(st.groups) != 16 {
		t.Fatalf("round 0: %d messages, %d groups", st.messages, len(st.groups))
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	// Round 0 decided (all filtered) while the dispatcher was down.
	var groups []string
	for g := range st.groups {
		groups = append(groups, g)
	}
	win, _ := schemas.EncodeWindow(schemas.WindowRecord{Groups: groups})
	produce(run.Topics.Windows, win)

	run.StartOperator(t, "dispatch", t.TempDir()) // fresh local state
	st = waitFor(32)
	time.Sleep(500 * time.Millisecond) // nothing more may come
	st = read()
	rounds := map[int64]int{}
	for _, r := range st.groups {
		rounds[r]++
	}
	if st.messages != 32 || len(st.groups) != 32 || rounds[0] != 16 || rounds[1] != 16 || len(st.attempts) != 32*16 {
		t.Fatalf("after restart: %d messages, %d groups, rounds %v, %d attempts", st.messages, len(st.groups), rounds, len(st.attempts))
	}
}
