package llamatest

import (
	"strings"
	"testing"
)

func probsOf(ids ...int) []TokenProb {
	out := make([]TokenProb, len(ids))
	for i, id := range ids {
		lp := -float64(i + 1)
		out[i] = TokenProb{ID: id, LogProb: &lp}
	}
	return out
}

func TestAlignProbs(t *testing.T) {
	for _, tc := range []struct {
		name   string
		tokens []int
		probs  []TokenProb
		want   []int // index into probs, -1 for nil
	}{
		{"complete", []int{5, 6, 2}, probsOf(5, 6, 2), []int{0, 1, 2}},
		// " und", " \xc3" (dropped), "\xa4", "u": the case seen on SmolLM2.
		{"utf8 split", []int{3423, 5549, 114, 101}, probsOf(3423, 114, 101), []int{0, -1, 1, 2}},
		// a stop string's tokens at the end have no entries
		{"stop string", []int{81, 25, 198}, probsOf(81, 25), []int{0, 1, -1}},
		// the dropped token has the id of the next one: either could own
		// the entry
		{"ambiguous", []int{7, 80, 80, 9}, probsOf(7, 80, 9), []int{0, -1, -1, 2}},
		{"empty", []int{}, nil, []int{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := AlignProbs(tc.tokens, tc.probs)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("%d aligned, want %d", len(got), len(tc.want))
			}
			for i, w := range tc.want {
				switch {
				case w < 0 && got[i] != nil:
					t.Errorf("token %d: entry %+v, want none", i, *got[i])
				case w >= 0 && got[i] != &tc.probs[w]:
					t.Errorf("token %d: entry %v, want completion_probabilities[%d]", i, got[i], w)
				}
			}
		})
	}
	if _, err := AlignProbs([]int{1, 2}, probsOf(2, 1)); err == nil || !strings.Contains(err.Error(), "matches no remaining token") {
		t.Fatalf("out of order entries: %v", err)
	}
}
