package operators_test

import (
	"testing"
	"time"

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
