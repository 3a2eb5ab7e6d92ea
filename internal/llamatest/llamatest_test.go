//go:build llama

package llamatest

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"
)

// Run with: eval "$(deploy/local/llama.sh env)" && export TRAJFLOW_LLAMA_SERVER TRAJFLOW_LLAMA_MODEL &&
// go test -tags llama ./internal/llamatest/

func chatPrompt(t testing.TB, ctx context.Context, s *Server, user string) []int {
	t.Helper()
	text, err := s.ApplyTemplate(ctx, "", []ChatMessage{{Role: "user", Content: user}})
	if err != nil {
		t.Fatal(err)
	}
	ids, err := s.Tokenize(ctx, "", text)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) == 0 || ids[0] != TokenImStart {
		t.Fatalf("chat prompt %q tokenized to %v: want it to start with <|im_start|> (%d)", text, ids, TokenImStart)
	}
	return ids
}

func TestServerDeterministic(t *testing.T) {
	s := Start(t, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	prompt := chatPrompt(t, ctx, s, "Name three colors.")

	req := Neutral(prompt, 24, 1234, 2)
	first, err := s.Complete(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if len(first.Tokens) == 0 {
		t.Fatalf("no tokens: %+v", first)
	}
	if len(first.Tokens) != len(first.Probs) {
		t.Fatalf("%d tokens, %d completion_probabilities", len(first.Tokens), len(first.Probs))
	}
	if first.TokensEvaluated != len(prompt) {
		t.Errorf("tokens_evaluated %d, want %d (no BOS added to a token prompt)", first.TokensEvaluated, len(prompt))
	}
	for i, p := range first.Probs {
		if p.ID != first.Tokens[i] {
			t.Fatalf("position %d: completion_probabilities id %d, tokens %d", i, p.ID, first.Tokens[i])
		}
		if p.LogProb == nil || *p.LogProb > 0 {
			t.Fatalf("position %d: logprob %v", i, p.LogProb)
		}
	}

	// The same request again, then twice at once (both slots busy), then
	// with the prompt cache on: every answer identical, log-probs bit for
	// bit.
	same := func(name string, got *CompletionResponse) {
		t.Helper()
		if len(got.Tokens) != len(got.Probs) {
			t.Fatalf("%s: %d tokens, %d completion_probabilities", name, len(got.Tokens), len(got.Probs))
		}
		if !equalInts(got.Tokens, first.Tokens) {
			t.Fatalf("%s: tokens %v, first run %v", name, got.Tokens, first.Tokens)
		}
		for i := range got.Probs {
			if *got.Probs[i].LogProb != *first.Probs[i].LogProb {
				t.Fatalf("%s: position %d logprob %v, first run %v", name, i, *got.Probs[i].LogProb, *first.Probs[i].LogProb)
			}
		}
		if got.StopType != first.StopType {
			t.Fatalf("%s: stop_type %q, first run %q", name, got.StopType, first.StopType)
		}
	}
	again, err := s.Complete(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	same("second run", again)

	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	results := make([]*CompletionResponse, 2)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := s.Complete(ctx, req)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			results[i] = r
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Fatal(errs[0])
	}
	same("concurrent run 1", results[0])
	same("concurrent run 2", results[1])

	cached := req
	cached.CachePrompt = true
	for i := 0; i < 2; i++ {
		r, err := s.Complete(ctx, cached)
		if err != nil {
			t.Fatal(err)
		}
		same("cache_prompt run", r)
	}

	other := req
	other.Seed = 4321
	diff, err := s.Complete(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	if equalInts(diff.Tokens, first.Tokens) {
		t.Errorf("seed 4321 gave the same %d tokens as seed 1234: is the seed sent?", len(first.Tokens))
	}
}

func TestServerStopsOnEndOfTurn(t *testing.T) {
	s := Start(t, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	prompt := chatPrompt(t, ctx, s, "Say hello.")
	r, err := s.Complete(ctx, Neutral(prompt, 400, 3, 1))
	if err != nil {
		t.Fatal(err)
	}
	if r.StopType != "eos" {
		t.Fatalf("stop_type %q after %d tokens, want eos", r.StopType, len(r.Tokens))
	}
	if last := r.Tokens[len(r.Tokens)-1]; last != TokenImEnd {
		t.Fatalf("last token %d, want <|im_end|> (%d)", last, TokenImEnd)
	}
	if r.TokensPredicted != len(r.Tokens) {
		t.Errorf("tokens_predicted %d, %d tokens", r.TokensPredicted, len(r.Tokens))
	}
	if strings.Contains(r.Content, "<|im_end|>") {
		t.Errorf("content carries the end-of-turn text: %q", r.Content)
	}
	aligned, err := AlignProbs(r.Tokens, r.Probs)
	if err != nil {
		t.Fatal(err)
	}
	if aligned[len(aligned)-1] == nil {
		t.Fatalf("no log-probability for the end-of-turn token")
	}
	missing := 0
	for _, p := range aligned {
		if p == nil {
			missing++
		}
	}
	t.Logf("%d tokens, %d completion_probabilities, %d without one", len(r.Tokens), len(r.Probs), missing)
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
