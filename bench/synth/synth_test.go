package synth

import (
	"testing"

	"github.com/trajflow/trajflow/operators/validate"
)

func TestGroupsAreDeterministicAndValid(t *testing.T) {
	c := Default()
	c.ContractHash = "sha256:x"
	a, b := c.Group(7), c.Group(7)
	if len(a) != c.GroupSize {
		t.Fatalf("group of %d, want %d", len(a), c.GroupSize)
	}
	var total, n int
	for i := range a {
		if a[i].RecordID != b[i].RecordID || len(a[i].Turns) != len(b[i].Turns) {
			t.Fatalf("member %d differs between two calls", i)
		}
		if v := validate.Check(&a[i], validate.Options{VocabSize: c.Vocab, ContractHash: c.ContractHash}); !v.OK() {
			t.Fatalf("member %d invalid: %v", i, v)
		}
	}
	for g := int64(0); g < 200; g++ {
		for _, tr := range c.Group(g) {
			all, _ := Tokens(&tr)
			if all > c.MaxTokens+2*c.MaxTurns+c.PromptTokens {
				t.Fatalf("trajectory of %d tokens beyond the cap %d", all, c.MaxTokens)
			}
			total += all
			n++
		}
	}
	mean := float64(total) / float64(n)
	if mean < 0.7*c.MeanTokens || mean > 1.3*c.MeanTokens {
		t.Fatalf("mean tokens %.0f, want about %.0f", mean, c.MeanTokens)
	}
}

// TestGeneratorShapes: the fast generator gives groups with the ids of
// Config.Group and the same length distribution, deterministic in the
// index, with every token id in the vocabulary.
func TestGeneratorShapes(t *testing.T) {
	c := Bench()
	g := c.NewGenerator(1 << 16)
	var ta, tb int
	for i := int64(0); i < 500; i++ {
		a, b, b2 := c.Group(i), g.Group(i), g.Group(i)
		for m := range a {
			if a[m].RecordID != b[m].RecordID || a[m].GroupID != b[m].GroupID {
				t.Fatalf("group %d member %d: ids differ from Config.Group", i, m)
			}
			x, _ := Tokens(&a[m])
			y, _ := Tokens(&b[m])
			y2, _ := Tokens(&b2[m])
			if y != y2 || len(b[m].Turns) != len(b2[m].Turns) {
				t.Fatalf("group %d member %d: generator not deterministic", i, m)
			}
			ta += x
			tb += y
			for k := range b[m].Turns {
				for _, id := range b[m].Turns[k].ActionIDs {
					if id < 0 || id >= c.Vocab {
						t.Fatalf("token id %d outside the vocabulary", id)
					}
				}
			}
		}
	}
	if r := float64(tb) / float64(ta); r < 0.9 || r > 1.1 {
		t.Fatalf("generator tokens %d vs Config.Group %d", tb, ta)
	}
}

// TestBenchShares: the loss shares of Bench() show up in about their
// proportions and each is refused by validation for its own reason.
func TestBenchShares(t *testing.T) {
	c := Bench()
	c.ContractHash = "sha256:x"
	opts := validate.Options{VocabSize: c.Vocab, ContractHash: c.ContractHash}
	reasons := map[string]int{}
	uniform, groups, n := 0, 2000, 0
	for i := int64(0); i < int64(groups); i++ {
		rows := c.Group(i)
		same := true
		for m := range rows {
			n++
			if len(rows[m].Turns) != len(rows[0].Turns) {
				same = false
			}
			if v := validate.Check(&rows[m], opts); !v.OK() {
				reasons[v.Reason]++
			}
		}
		if same {
			uniform++
		}
	}
	cases := []struct {
		reason string
		share  float64
	}{
		{validate.ReasonInfraFailure, c.InfraShare},
		{validate.ReasonPositiveLogprob, c.CorruptShare},
	}
	for _, tc := range cases {
		got := float64(reasons[tc.reason]) / float64(n)
		if got < 0.5*tc.share || got > 1.5*tc.share {
			t.Errorf("%s share %.4f, want about %.4f (reasons %v)", tc.reason, got, tc.share, reasons)
		}
	}
	if got := float64(uniform) / float64(groups); got < 0.5*c.UniformShare || got > 2*c.UniformShare+0.01 {
		t.Errorf("uniform groups %.3f, want about %.3f", got, c.UniformShare)
	}
}

// BenchmarkGenerator measures the synthetic source's own rate (groups
// generated, without encoding).
func BenchmarkGenerator(b *testing.B) {
	g := Bench().NewGenerator(0)
	var tokens int64
	i := int64(0)
	for b.Loop() {
		for _, t := range g.Group(i) {
			all, _ := Tokens(&t)
			tokens += int64(all)
		}
		i++
	}
	b.ReportMetric(float64(tokens)/b.Elapsed().Seconds(), "tokens/s")
}
