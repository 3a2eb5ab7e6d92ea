package audit

import (
	"testing"

	"github.com/trajflow/trajflow/schemas"
)

func batch(id string, ids ...string) *schemas.PackedBatch {
	return &schemas.PackedBatch{BatchID: id, Rows: []schemas.PackedRow{{SegTrajectoryIDs: ids}}}
}

func TestStream(t *testing.T) {
	type step struct {
		batch  *schemas.PackedBatch
		census *schemas.CensusEvent
	}
	cases := []struct {
		name  string
		steps []step
		want  Counts
	}{
		{"all decided", []step{
			{batch: batch("b0", "a", "b")},
			{census: &schemas.CensusEvent{Kind: schemas.CensusFiltered, AttemptID: "c", Reason: "stale"}},
			{census: &schemas.CensusEvent{Kind: schemas.CensusQuarantined, AttemptID: "d", Reason: "infra_failure"}},
		}, Counts{Launched: 4, Admitted: 2, Filtered: 1, Quarantined: 1}},
		{"admitted twice", []step{
			{batch: batch("b0", "a", "b", "c")},
			{batch: batch("b1", "a", "d")},
		}, Counts{Launched: 4, Admitted: 4, Duplicated: 1}},
		{"batch repeated", []step{
			{batch: batch("b0", "a")},
			{batch: batch("b0", "a")},
			{batch: batch("b1", "b", "c", "d")},
		}, Counts{Launched: 4, Admitted: 4, Duplicated: 2}},
		{"census repeated and other kinds ignored", []step{
			{census: &schemas.CensusEvent{Kind: schemas.CensusFiltered, AttemptID: "a", Reason: "zero_variance"}},
			{census: &schemas.CensusEvent{Kind: schemas.CensusFiltered, AttemptID: "a", Reason: "zero_variance"}},
			{census: &schemas.CensusEvent{Kind: schemas.CensusAdmitted, AttemptID: "b"}},
			{batch: batch("b0", "b", "c")},
		}, Counts{Launched: 4, Admitted: 2, Filtered: 1, Lost: 1, LostIDs: []string{"d"}}},
		{"excluded at the update, before and after its batch", []step{
			{batch: batch("b0", "a", "b")},
			{census: &schemas.CensusEvent{Kind: schemas.CensusFiltered, Stage: TrainStage, AttemptID: "a", Reason: schemas.ReasonStaleAtUpdate}},
			{census: &schemas.CensusEvent{Kind: schemas.CensusFiltered, Stage: TrainStage, AttemptID: "a", Reason: schemas.ReasonStaleAtUpdate}},
			{census: &schemas.CensusEvent{Kind: schemas.CensusFiltered, Stage: TrainStage, AttemptID: "c", Reason: schemas.ReasonStaleAtUpdate}},
			{batch: batch("b1", "c", "d")},
		}, Counts{Launched: 4, Admitted: 2, Excluded: 2}},
		{"never decided", nil, Counts{Launched: 4, Lost: 4, LostIDs: []string{"a", "b", "c", "d"}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := NewStream()
			for i, id := range []string{"a", "b", "c", "d"} {
				s.Launch(id, Attempt{Seq: int64(i), Tokens: 10 * (i + 1)})
			}
			decided := 0
			for _, st := range tc.steps {
				if st.batch != nil {
					for _, f := range s.Batch(st.batch) {
						if (f.Outcome != OutcomeAdmitted && f.Outcome != OutcomeExcluded) || f.Tokens == 0 {
							t.Errorf("fate %+v", f)
						}
						decided++
					}
				}
				if st.census != nil {
					if f, ok := s.Census(st.census); ok {
						if f.Reason != st.census.Reason || f.ID != st.census.AttemptID {
							t.Errorf("fate %+v for %+v", f, st.census)
						}
						decided++
					}
				}
			}
			got := s.Counts()
			if got.Launched != tc.want.Launched || got.Admitted != tc.want.Admitted || got.Filtered != tc.want.Filtered ||
				got.Quarantined != tc.want.Quarantined || got.Lost != tc.want.Lost || got.Duplicated != tc.want.Duplicated ||
				got.Excluded != tc.want.Excluded {
				t.Fatalf("counts %v, want %v", got, tc.want)
			}
			if len(got.LostIDs) != len(tc.want.LostIDs) {
				t.Fatalf("lost ids %v, want %v", got.LostIDs, tc.want.LostIDs)
			}
			for i := range got.LostIDs {
				if got.LostIDs[i] != tc.want.LostIDs[i] {
					t.Fatalf("lost ids %v, want %v", got.LostIDs, tc.want.LostIDs)
				}
			}
			if decided != got.Admitted+got.Excluded+got.Filtered+got.Quarantined || s.InFlight() != got.Lost {
				t.Fatalf("decided %d, in flight %d, counts %v", decided, s.InFlight(), got)
			}
		})
	}
}
