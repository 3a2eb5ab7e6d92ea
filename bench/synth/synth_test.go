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
