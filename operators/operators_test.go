package operators_test

import (
	"bytes"
	"math"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/ipc"

	"github.com/trajflow/trajflow/schemas"

	"github.com/trajflow/trajflow/internal/testkit"
)

// TestStagesEndToEnd runs validate, reward, advantage and pack as Kafka
// operators on the embedded broker over synthetic groups: every attempt is
// admitted exactly once or filtered with a reason.
func TestStagesEndToEnd(t *testing.T) {
	c := testkit.LoadContract(t, "../testdata/contracts/conformance.yaml")
	run := testkit.StartRun(t, c, "")
	s := run.Synth(400, 4000)
	ids := run.Produce(t, s, 0, 60)
	for _, name := range []string{"validate", "reward", "advantage", "pack"} {
		run.StartOperator(t, name, t.TempDir())
	}
	counts := run.WaitAccounted(t, ids, 20*time.Second)
	t.Logf("%v", counts)
	if counts.Lost != 0 || counts.Duplicated != 0 {
		t.Fatalf("lost=%d duplicated=%d (%v), lost ids %v", counts.Lost, counts.Duplicated, counts, counts.LostIDs[:min(5, len(counts.LostIDs))])
	}
	if counts.Admitted < len(ids)/2 {
		t.Fatalf("only %d of %d admitted", counts.Admitted, len(ids))
	}
}

// TestBadInputQuarantined produces garbage bytes, a wrong schema version, a
// token/log-prob length mismatch and a NaN log-prob onto the trajectories
// topic between good groups: each lands in quarantine with its reason and
// source coordinates, and the good groups still flow to batches. The
// advantage stage runs without a partial-group timeout: the groups that
// lost a member close only through validate's declaration of the refused
// member, carried through the broker in the record headers.
func TestBadInputQuarantined(t *testing.T) {
	c := testkit.LoadContract(t, "../testdata/contracts/conformance.yaml")
	run := testkit.StartRun(t, c, "")
	run.PartialGroupTimeout = -1
	s := run.Synth(300, 3000)
	good := run.Produce(t, s, 0, 4)

	mismatch := s.Group(100)
	mismatch[2].Turns[0].ActionLogprobs = mismatch[2].Turns[0].ActionLogprobs[1:]
	nan := s.Group(101)
	nan[5].Turns[0].ActionLogprobs[0] = float32(math.NaN())
	bad := map[string][]byte{
		"garbage":         []byte("\x00\x01not an arrow stream at all"),
		"unknown_version": wrongVersion(t, s.Group(102)),
		"mismatch":        mustEncode(t, mismatch),
		"nan":             mustEncode(t, nan),
	}
	run.ProduceRaw(t, run.Topics.Trajectories, bad)
	good = append(good, run.Produce(t, s, 4, 8)...)

	for _, name := range []string{"validate", "reward", "advantage", "pack"} {
		run.StartOperator(t, name, t.TempDir())
	}
	counts := run.WaitAccounted(t, good, 30*time.Second)
	if counts.Lost != 0 || counts.Duplicated != 0 {
		t.Fatalf("good records: %v", counts)
	}
	q := run.ReadAll(t, run.Topics.Quarantine)
	reasons := map[string]string{}
	for _, m := range q {
		reasons[string(m.Header(schemas.HeaderReason))] = string(m.Header(schemas.HeaderSourceTopic))
	}
	for _, want := range []string{"undecodable", "unknown_version", "logprob_length_mismatch", "nonfinite_logprob"} {
		if src, ok := reasons[want]; !ok || src != run.Topics.Trajectories {
			t.Errorf("no quarantine record with reason %q from %s; got %v", want, run.Topics.Trajectories, reasons)
		}
	}
	if len(q) != 4 {
		t.Errorf("quarantine holds %d records, want 4", len(q))
	}
	// The 7 valid members of the mismatch and NaN groups are scored as
	// incomplete groups (min_group_size = group size) once validate's
	// declaration of the refused member closes them: filtered with a
	// reason, never lost.
	rest := []string{}
	for i, tr := range mismatch {
		if i != 2 {
			rest = append(rest, tr.RecordID)
		}
	}
	for i, tr := range nan {
		if i != 5 {
			rest = append(rest, tr.RecordID)
		}
	}
	if c := run.WaitAccounted(t, rest, 30*time.Second); c.Lost != 0 || c.Filtered != len(rest) {
		t.Fatalf("members of groups with a quarantined member: %v (want all filtered)", c)
	}
}

func mustEncode(t *testing.T, rows []schemas.Trajectory) []byte {
	t.Helper()
	b, err := schemas.Trajectories.Encode(nil, rows)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// wrongVersion encodes rows under a schema whose version metadata is 99.
func wrongVersion(t *testing.T, rows []schemas.Trajectory) []byte {
	t.Helper()
	rec, err := schemas.Trajectories.ToRecord(nil, rows)
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Release()
	md := arrow.NewMetadata([]string{schemas.MetaKind, schemas.MetaVersion}, []string{string(schemas.KindTrajectory), "99"})
	sc := arrow.NewSchema(rec.Schema().Fields(), &md)
	rec2 := array.NewRecordBatch(sc, rec.Columns(), rec.NumRows())
	defer rec2.Release()
	var buf bytes.Buffer
	w := ipc.NewWriter(&buf, ipc.WithSchema(sc))
	if err := w.Write(rec2); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}
