package rollout

import (
	"context"
	"fmt"
	"strings"
)

// textRenderer renders the observations of one text episode with the
// policy server's chat template and tokenizer (docs/SYSTEMS.md §3: the server's
// own tokenizer, ids appended, never re-tokenized).
//
// The template is asked once per episode, with sentinel contents, for the
// pieces around messages: the text that closes an assistant message, the
// text that opens and closes a tool message, and the generation prompt
// that opens the next assistant message. An observation then appends, as
// ids: the part of the assistant closing the sampled action did not
// already produce (a sampler that stopped at the end-of-turn token has
// produced its first id), the tool message, and its close; the next turn's
// PromptIDs are the generation prompt. Earlier ids are never re-tokenized,
// so the stream is exactly what the policy saw and sampled.
type textRenderer struct {
	tok          Tokenizer
	closeIDs     []int32 // closes an assistant message
	toolOpen     string  // opens a tool message (before its content)
	toolClose    string  // closes a tool message (before the generation prompt)
	genPrompt    []int32 // opens the next assistant message
	maxObsTokens int     // bound on the ids of one rendered observation
}

// Sentinel contents: templates copy message content verbatim, so the text
// around them is the template's own.
const (
	sentinelAction      = "\u27e6trajflow-action\u27e7"
	sentinelObservation = "\u27e6trajflow-observation\u27e7"
)

// newTextRenderer asks tok's template for the pieces around messages and
// returns the renderer and the ids of the first prompt (msgs rendered with
// the generation prompt). maxObsBytes is the episode's cap on one
// observation's text.
func newTextRenderer(ctx context.Context, tok Tokenizer, msgs []ChatMessage, maxObsBytes int) (*textRenderer, []int32, error) {
	first, err := tok.ApplyTemplate(ctx, msgs, true)
	if err != nil {
		return nil, nil, fmt.Errorf("chat template: %w", err)
	}
	base, err := tok.ApplyTemplate(ctx, msgs, false)
	if err != nil {
		return nil, nil, fmt.Errorf("chat template: %w", err)
	}
	gen, ok := strings.CutPrefix(first, base)
	if !ok || gen == "" {
		return nil, nil, fmt.Errorf("chat template: the generation prompt does not extend the rendered messages")
	}
	withA := append(append([]ChatMessage(nil), msgs...), ChatMessage{Role: "assistant", Content: sentinelAction})
	ra, err := tok.ApplyTemplate(ctx, withA, false)
	if err != nil {
		return nil, nil, fmt.Errorf("chat template: %w", err)
	}
	_, closeA, ok := strings.Cut(ra, sentinelAction)
	if !ok {
		return nil, nil, fmt.Errorf("chat template: an assistant message's content is not rendered verbatim")
	}
	withT := append(withA, ChatMessage{Role: "tool", Content: sentinelObservation})
	rt, err := tok.ApplyTemplate(ctx, withT, true)
	if err != nil {
		return nil, nil, fmt.Errorf("chat template: %w", err)
	}
	rest, ok := strings.CutPrefix(rt, ra)
	if !ok {
		return nil, nil, fmt.Errorf("chat template: a tool message does not extend the rendered conversation")
	}
	open, after, ok := strings.Cut(rest, sentinelObservation)
	if !ok {
		return nil, nil, fmt.Errorf("chat template: a tool message's content is not rendered verbatim")
	}
	toolClose, ok := strings.CutSuffix(after, gen)
	if !ok {
		return nil, nil, fmt.Errorf("chat template: a tool message does not end with the generation prompt")
	}
	r := &textRenderer{tok: tok, toolOpen: open, toolClose: toolClose}
	if r.closeIDs, err = tok.Tokenize(ctx, closeA); err != nil {
		return nil, nil, fmt.Errorf("tokenize: %w", err)
	}
	if r.genPrompt, err = tok.Tokenize(ctx, gen); err != nil {
		return nil, nil, fmt.Errorf("tokenize: %w", err)
	}
	prompt, err := tok.Tokenize(ctx, first)
	if err != nil {
		return nil, nil, fmt.Errorf("tokenize: %w", err)
	}
	if len(r.genPrompt) == 0 || len(prompt) == 0 {
		return nil, nil, fmt.Errorf("tokenize: empty prompt")
	}
	r.maxObsTokens = len(r.closeIDs) + len(open) + maxObsBytes + len(toolClose)
	return r, prompt, nil
}

// observation returns the ids that follow the sampled action ids: the rest
// of the assistant closing, then the tool message holding text.
func (r *textRenderer) observation(ctx context.Context, action []int32, text string) ([]int32, error) {
	rest := r.closeIDs[overlap(action, r.closeIDs):]
	ids, err := r.tok.Tokenize(ctx, r.toolOpen+text+r.toolClose)
	if err != nil {
		return nil, fmt.Errorf("tokenize: %w", err)
	}
	return append(append(make([]int32, 0, len(rest)+len(ids)), rest...), ids...), nil
}

// overlap returns the largest k such that the last k ids of a are the
// first k of b.
func overlap(a, b []int32) int {
	for k := min(len(a), len(b)); k > 0; k-- {
		match := true
		for j := 0; j < k; j++ {
			if a[len(a)-k+j] != b[j] {
				match = false
				break
			}
		}
		if match {
			return k
		}
	}
	return 0
}

// EscapeText makes untrusted tool output safe to render inside a chat
// message: '&', '<' and '>' become "&amp;", "&lt;" and "&gt;", so no
// template marker ("<|im_start|>"), special token or action tag
// ("<answer>") survives in it, and control characters other than newline
// and tab are dropped.
func EscapeText(s string) string {
	var b strings.Builder
	b.Grow(len(s))
	for _, c := range s {
		switch {
		case c == '&':
			b.WriteString("&amp;")
		case c == '<':
			b.WriteString("&lt;")
		case c == '>':
			b.WriteString("&gt;")
		case c == '\n' || c == '\t' || (c >= 0x20 && c != 0x7f && !(c >= 0x80 && c < 0xa0)):
			b.WriteRune(c)
		}
	}
	return b.String()
}

// IsEscaped reports whether s could be EscapeText's output: no markup
// characters and no control characters other than newline and tab.
func IsEscaped(s string) bool {
	for _, c := range s {
		if c == '<' || c == '>' || (c < 0x20 && c != '\n' && c != '\t') || c == 0x7f || (c >= 0x80 && c < 0xa0) {
			return false
		}
	}
	return true
}
