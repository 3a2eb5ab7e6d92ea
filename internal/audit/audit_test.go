package audit

import (
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// TestCollectCopiesAndConflicts: a batch message repeated byte for byte (a
// producer's retry after a lost acknowledgement) is a copy, which
// AccountDistinct does not count as a duplicate (the trainer skips it by
// batch id); Account still counts every occurrence, and a batch id seen
// again with other content is a duplicate in both.
func TestCollectCopiesAndConflicts(t *testing.T) {
	topics, err := pipeline.TopicsFor("audit")
	if err != nil {
		t.Fatal(err)
	}
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, topics.Batches, topics.Census))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	addr := c.ListenAddrs()[0]
	enc := func(id string, ids ...string) []byte {
		b, err := schemas.PackedBatches.Encode(nil, schemas.PackedBatch{BatchID: id, RunID: "audit",
			Rows: []schemas.PackedRow{{SegTrajectoryIDs: ids}}})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	write := func(vals ...[]byte) {
		tr := &kafka.Transport{} // not DefaultTransport, whose pools outlive the writer
		defer tr.CloseIdleConnections()
		w := &kafka.Writer{Addr: kafka.TCP(addr), Topic: topics.Batches, RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond, Transport: tr}
		defer w.Close()
		for _, v := range vals {
			if err := w.WriteMessages(context.Background(), kafka.Message{Value: v}); err != nil {
				t.Fatal(err)
			}
		}
	}
	b0 := enc("b0", "a", "b")
	write(b0, enc("b1", "c"), b0)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := &pipeline.Config{Brokers: []string{addr}}
	launched := []string{"a", "b", "c"}
	rep, err := Collect(ctx, cfg, topics)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Copies != 1 || rep.Conflicts != 0 {
		t.Fatalf("copies %d, conflicts %d; want 1 and 0", rep.Copies, rep.Conflicts)
	}
	if got := rep.AccountDistinct(launched); got.Duplicated != 0 || got.Admitted != 3 || got.Lost != 0 {
		t.Fatalf("distinct accounting %v, want 3 admitted and no duplicate", got)
	}
	if got := rep.Account(launched); got.Duplicated != 3 {
		t.Fatalf("accounting %v, want 3 duplicates (two trajectories and the batch id)", got)
	}
	write(enc("b1", "c", "d"))
	if rep, err = Collect(ctx, cfg, topics); err != nil {
		t.Fatal(err)
	}
	if got := rep.AccountDistinct(launched); rep.Conflicts != 1 || got.Duplicated != 1 {
		t.Fatalf("conflicts %d, distinct accounting %v; want 1 conflict counted as a duplicate", rep.Conflicts, got)
	}
}

// TestAccountAttemptsFollowsRetries: an attempt that failed for the
// infrastructure is accounted by the attempt that ran it again (once or
// twice), not lost; one whose retry was never decided is lost.
func TestAccountAttemptsFollowsRetries(t *testing.T) {
	att := func(member int32) schemas.TaskAttempt {
		return schemas.TaskAttempt{RunID: "run", TaskID: "task", GroupID: "g", Member: member,
			AttemptID: schemas.AttemptID("run", "task", "g", member, 0)}
	}
	id := func(member, n int32) string { return schemas.AttemptID("run", "task", "g", member, n) }
	r := &Report{Admitted: map[string]int{}, Filtered: map[string]string{}, Quarantined: map[string]string{},
		FailedInfra: map[string]string{}, BatchIDs: map[string]int{}}
	r.Admitted[id(0, 0)] = 1                                                      // never failed
	r.FailedInfra[id(1, 0)], r.Admitted[id(1, 1)] = "timeout", 1                  // retried once
	r.FailedInfra[id(2, 0)], r.FailedInfra[id(2, 1)] = "timeout", "reset"         // retried twice
	r.Filtered[id(2, 2)] = "zero_variance"                                        //
	r.FailedInfra[id(3, 0)] = "timeout"                                           // retry never decided
	r.FailedInfra[id(4, 0)], r.Quarantined[id(4, 0)] = "reset", "infra_exhausted" // decided itself
	c := r.AccountAttempts([]schemas.TaskAttempt{att(0), att(1), att(2), att(3), att(4)})
	if c.Launched != 5 || c.Admitted != 2 || c.Filtered != 1 || c.Quarantined != 1 || c.Lost != 1 || c.Retried != 3 || c.RetriedTries["timeout"] != 3 || c.RetriedTries["reset"] != 1 || c.LostIDs[0] != id(3, 1) {
		t.Fatalf("%v retried %d lost %v", c, c.Retried, c.LostIDs)
	}
	if plain := r.Account([]string{id(1, 0)}); plain.Lost != 1 {
		t.Fatalf("Account does not follow retries: %v", plain)
	}
}

// TestAccountExcluded: an attempt admitted to a batch and excluded by the
// trainer's lag rule is neither lost nor admitted (trained): it is
// excluded; every launched attempt is in exactly one category.
func TestAccountExcluded(t *testing.T) {
	r := &Report{
		BatchIDs: map[string]int{"b0": 1},
		Admitted: map[string]int{"a": 1, "b": 1},
		Filtered: map[string]string{"c": "zero_variance"},
		Excluded: map[string]string{"b": "stale_at_update"},
	}
	c := r.Account([]string{"a", "b", "c", "d"})
	if c.Admitted != 1 || c.Excluded != 1 || c.Filtered != 1 || c.Lost != 1 || c.Duplicated != 0 {
		t.Fatalf("counts %v, want admitted 1, excluded 1, filtered 1, lost 1", c)
	}
	if c.Admitted+c.Excluded+c.Filtered+c.Quarantined+c.Lost != c.Launched {
		t.Fatalf("categories do not partition the launched attempts: %v", c)
	}
}
