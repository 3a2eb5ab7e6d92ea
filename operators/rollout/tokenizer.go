package rollout

import "context"

// ChatMessage is one message of a chat conversation rendered by a policy
// server's chat template.
type ChatMessage struct {
	Role    string `json:"role"` // "system", "user", "assistant", "tool"
	Content string `json:"content"`
}

// Tokenizer is a policy server's own tokenizer and chat template. Task
// families that speak text (rather than the built-in token vocabulary) use
// it so that tokenization stays exact (docs/SYSTEMS.md §3, §8): the first prompt is
// rendered with the server's chat template and tokenized by the server,
// observations are tokenized by the server and appended as ids, and action
// ids are never re-tokenized from their text.
type Tokenizer interface {
	// ApplyTemplate renders msgs with the server's chat template.
	// addGenerationPrompt appends the prefix that opens the assistant's
	// next message.
	ApplyTemplate(ctx context.Context, msgs []ChatMessage, addGenerationPrompt bool) (string, error)
	// Tokenize returns the ids of text, special tokens parsed, no BOS
	// added.
	Tokenize(ctx context.Context, text string) ([]int32, error)
	// Detokenize returns the text of ids (for parsing and display only).
	Detokenize(ctx context.Context, ids []int32) (string, error)
	// TokenizerHash and ChatTemplateHash identify the vocabulary and the
	// template ("sha256:<hex>"); they are recorded with every trajectory.
	TokenizerHash() string
	ChatTemplateHash() string
}
