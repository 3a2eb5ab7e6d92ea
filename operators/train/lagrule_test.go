package train_test

import (
	"slices"
	"testing"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/operators/train"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// lagRow is one packed row of three segments, hand-built: 12 positions,
// segments 0 (positions 0-3), 1 (4-7), 2 (8-11), trained targets at
// entries 1-2, 5-6, 9-10 (the last entry of every segment is masked),
// with the behavior versions given per trained entry.
func lagRow(v [6]int32) schemas.PackedRow {
	r := schemas.PackedRow{
		InputIDs:       make([]int32, 12),
		PositionIDs:    []int32{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3},
		SegmentIDs:     []int32{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2},
		ActionMask:     make([]uint8, 12),
		PolicyVersions: slices.Repeat([]int32{-1}, 12),
		// trajectory ids of the segments
		SegTrajectoryIDs: []string{"a", "b", "c"},
		SegGroupIDs:      []string{"g1", "g2", "g2"},
		SegLengths:       []int32{4, 4, 4},
	}
	for k, i := range []int{1, 2, 5, 6, 9, 10} {
		r.ActionMask[i] = 1
		r.PolicyVersions[i] = v[k]
	}
	return r
}

func masked(r schemas.PackedRow) []int {
	var at []int
	for i, m := range r.ActionMask {
		if m == 1 {
			at = append(at, i)
		}
	}
	return at
}

// TestLagRuleHandComputed: at trainer version 5 with max_lag 1, tokens of
// versions 4 and 5 train, older ones never do. Segment a is on time
// (versions 4, 5), b stale (3, 3), c mixed (3, 5): drop takes b and c out
// whole; mask_stale masks b's two tokens and c's first, and c trains its
// second token.
func TestLagRuleHandComputed(t *testing.T) {
	versions := [6]int32{4, 5, 3, 3, 3, 5}
	for _, tc := range []struct {
		policy  string
		trained []int
		stale   int64
		dropped []string
		kept    []string
		staleAt []schemas.LagCount
		lag     []schemas.LagCount
	}{
		{pack.StaleDrop, []int{1, 2}, 4, []string{"b", "c"}, []string{"a"},
			[]schemas.LagCount{{Lag: 0, Tokens: 1}, {Lag: 2, Tokens: 3}}, []schemas.LagCount{{Lag: 0, Tokens: 1}, {Lag: 1, Tokens: 1}}},
		{pack.StaleMaskTurns, []int{1, 2, 10}, 3, []string{"b"}, []string{"a", "c"},
			[]schemas.LagCount{{Lag: 2, Tokens: 3}}, []schemas.LagCount{{Lag: 0, Tokens: 2}, {Lag: 1, Tokens: 1}}},
	} {
		b := schemas.PackedBatch{Rows: []schemas.PackedRow{lagRow(versions)}}
		out := train.LagRule{MaxLag: 1, Policy: tc.policy}.Apply(&b, 5)
		if got := masked(b.Rows[0]); !slices.Equal(got, tc.trained) {
			t.Errorf("%s: trained entries %v, want %v", tc.policy, got, tc.trained)
		}
		wantSel := schemas.UpdateSelection{Segments: 3, TrainedSegments: len(tc.kept), Groups: 2, TrainedGroups: len(tc.kept),
			LengthMean: 4, LengthMeanTrained: 4, StaleShare: float64(tc.stale) / 6}
		if out.Selection != wantSel {
			t.Errorf("%s: selection %+v, want %+v", tc.policy, out.Selection, wantSel)
		}
		if out.StaleTokens != tc.stale || !slices.Equal(out.Dropped, tc.dropped) || !slices.Equal(out.Trained, tc.kept) {
			t.Errorf("%s: stale %d dropped %v trained %v, want %d %v %v", tc.policy, out.StaleTokens, out.Dropped, out.Trained, tc.stale, tc.dropped, tc.kept)
		}
		if !slices.Equal(out.StaleLag, tc.staleAt) || !slices.Equal(out.Lag, tc.lag) {
			t.Errorf("%s: stale lag %v, trained lag %v; want %v, %v", tc.policy, out.StaleLag, out.Lag, tc.staleAt, tc.lag)
		}
		var sum int64
		for _, n := range out.Masked {
			sum += n
		}
		if sum != out.StaleTokens {
			t.Errorf("%s: masked per trajectory %v sum to %d, stale tokens %d", tc.policy, out.Masked, sum, out.StaleTokens)
		}
	}
	// Off by one: lag exactly max_lag trains.
	b := schemas.PackedBatch{Rows: []schemas.PackedRow{lagRow([6]int32{4, 4, 4, 4, 4, 4})}}
	if out := (train.LagRule{MaxLag: 1, Policy: pack.StaleDrop}).Apply(&b, 5); out.StaleTokens != 0 || len(out.Trained) != 3 {
		t.Fatalf("lag == max_lag must train: %+v", out)
	}
	if err := (train.LagRule{MaxLag: 0, Policy: "mask_turns"}).Validate(); err == nil {
		t.Fatal("an unknown stale policy must be refused")
	}
}

// TestNewestKeptMatchesLagRule: pack.NewestKept is the trainer's lag rule
// in one number. By hand, for the row of TestLagRuleHandComputed (segments
// a 4,5; b 3,3; c 3,5): under drop the segments' oldest versions are 4, 3
// and 3, so 4; under mask_stale the newest trained token is 5. And for
// every version mix of that row drawn from 0-3, with max_lag 0-2, the rule
// leaves a trained token at trainer version NewestKept + max_lag and none
// one version later.
func TestNewestKeptMatchesLagRule(t *testing.T) {
	row := schemas.PackedBatch{Rows: []schemas.PackedRow{lagRow([6]int32{4, 5, 3, 3, 3, 5})}}
	if got := pack.NewestKept(&row, pack.StaleDrop); got != 4 {
		t.Errorf("drop: NewestKept %d, want 4", got)
	}
	if got := pack.NewestKept(&row, pack.StaleMaskTurns); got != 5 {
		t.Errorf("mask_stale: NewestKept %d, want 5", got)
	}
	if got := pack.NewestKept(&schemas.PackedBatch{}, pack.StaleDrop); got != -1 {
		t.Errorf("empty batch: NewestKept %d, want -1", got)
	}
	for n := range 4 * 4 * 4 * 4 * 4 * 4 {
		var v [6]int32
		for k, x := 0, n; k < 6; k, x = k+1, x/4 {
			v[k] = int32(x % 4)
		}
		for _, policy := range []string{pack.StaleDrop, pack.StaleMaskTurns} {
			for maxLag := int64(0); maxLag <= 2; maxLag++ {
				b := schemas.PackedBatch{Rows: []schemas.PackedRow{lagRow(v)}}
				kept := pack.NewestKept(&b, policy)
				rule := train.LagRule{MaxLag: maxLag, Policy: policy}
				if out := rule.Apply(&b, kept+maxLag); len(out.Trained) == 0 {
					t.Fatalf("%s, max_lag %d, versions %v: nothing trains at version %d = NewestKept %d + max_lag", policy, maxLag, v, kept+maxLag, kept)
				}
				b = schemas.PackedBatch{Rows: []schemas.PackedRow{lagRow(v)}}
				if out := rule.Apply(&b, kept+maxLag+1); len(out.Trained) != 0 {
					t.Fatalf("%s, max_lag %d, versions %v: %v still train at version %d", policy, maxLag, v, out.Trained, kept+maxLag+1)
				}
			}
		}
	}
}

// TestStageLagRuleAtUpdate: the train stage enforces max_lag at the
// optimizer step. Three batches bring the trainer to version 3; batch 3
// holds segments sampled at versions 2 (lag 1: trained) and 1 (lag 2:
// excluded), so the update trains only the first, records the exclusion
// (stale_tokens, stale_segments, not_trained, the lag distributions) and
// counts every excluded trajectory in the census (filtered,
// stale_at_update); no trained token has lag > 1. Batch 4, all of version
// 1 at trainer version 4, is refused as stale_batch, its trajectories
// counted the same way, and the trainer stays at version 4.
func TestStageLagRuleAtUpdate(t *testing.T) {
	f := newFixture(t)
	files := store(t)
	in := []pipeline.Message{f.msg(f.batch(0, 0), 0), f.msg(f.batch(1, 1), 1), f.msg(f.batch(2, 2), 2)}
	mixed := f.batch(3, 2)
	old := f.batch(30, 1)
	mixed.Rows = append(mixed.Rows, old.Rows...)
	stale := f.batch(4, 1)
	in = append(in, f.msg(mixed, 3), f.msg(stale, 4))
	d := f.drive(files, pipeline.MemScanner{}, in...)

	rels := releases(t, d.On(f.topics.Policy))
	if last := rels[len(rels)-1].PolicyVersion; len(rels) != 5 || last != 4 {
		t.Fatalf("releases %d up to version %d, want versions 0..4", len(rels), last)
	}
	u, err := gpu.ReadUpdate(files, 4)
	if err != nil {
		t.Fatal(err)
	}
	var oldTokens int64
	var oldIDs []string
	for _, r := range old.Rows {
		for _, m := range r.ActionMask {
			oldTokens += int64(m)
		}
		oldIDs = append(oldIDs, r.SegTrajectoryIDs...)
	}
	if u.StaleTokens != oldTokens || u.StaleSegments != len(oldIDs) || !slices.Equal(u.NotTrained, oldIDs) ||
		u.MaxLag != 1 || u.StalePolicy != pack.StaleDrop {
		t.Fatalf("update record: stale %d tokens %d segments %v (max_lag %d %s), want %d tokens %d segments",
			u.StaleTokens, u.StaleSegments, u.NotTrained, u.MaxLag, u.StalePolicy, oldTokens, len(oldIDs))
	}
	if len(u.StaleLag) != 1 || u.StaleLag[0] != (schemas.LagCount{Lag: 2, Tokens: oldTokens}) {
		t.Fatalf("stale lag %v, want all %d tokens at lag 2", u.StaleLag, oldTokens)
	}
	if len(u.Lag) != 1 || u.Lag[0].Lag != 1 || len(u.Metrics.Lag) != 1 || u.Metrics.Lag[0].Lag != 1 {
		t.Fatalf("trained lag %v (metrics %v), want every trained token at lag 1", u.Lag, u.Metrics.Lag)
	}
	// Census: every excluded trajectory once, with its reason; the trained
	// ones trained; batch 4 refused with its trajectories counted too.
	excluded := map[string]bool{}
	trained := map[string]bool{}
	for _, o := range d.On(f.topics.Census) {
		ev, err := schemas.DecodeCensus(o.Value)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case ev.Kind == schemas.CensusFiltered && ev.Reason == schemas.ReasonStaleAtUpdate && ev.Stage == "train" && ev.StaleTokens > 0:
			excluded[ev.AttemptID] = true
		case ev.Kind == schemas.CensusTrained:
			trained[ev.AttemptID] = true
		default:
			t.Fatalf("unexpected census event %+v", ev)
		}
	}
	want := slices.Clone(oldIDs)
	for _, r := range stale.Rows {
		want = append(want, r.SegTrajectoryIDs...)
	}
	for _, id := range want {
		if !excluded[id] || trained[id] {
			t.Fatalf("trajectory %s: excluded %v trained %v, want excluded only", id, excluded[id], trained[id])
		}
	}
	if len(excluded) != len(want) {
		t.Fatalf("%d excluded, want %d", len(excluded), len(want))
	}
	if r := reasons(d.On(f.topics.Quarantine)); !slices.Equal(r, []string{"stale_batch"}) {
		t.Fatalf("quarantine %v, want [stale_batch]", r)
	}
}
