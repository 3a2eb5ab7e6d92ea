// Package faketok is a deterministic stand-in for a policy server's
// tokenizer and chat template, for tests of the text task family and the
// agent loop only: byte-level ids plus two special tokens and a ChatML
// template. It is not any model's tokenizer; real runs use the policy
// server's (rollout.Tokenizer from connectors/policy).
package faketok

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"sync/atomic"

	"github.com/trajflow/trajflow/operators/rollout"
)

// Ids of the special tokens; byte b has id ByteBase+b.
const (
	IMStart  int32 = 1
	IMEnd    int32 = 2
	ByteBase int32 = 3
	// VocabSize is the number of ids.
	VocabSize = int(ByteBase) + 256
)

const (
	imStart = "<|im_start|>"
	imEnd   = "<|im_end|>"
	// DefaultSystem is the system message the template adds when the
	// conversation has none (as some models' templates do).
	DefaultSystem = "You are a helpful assistant."
)

// Tokenizer implements rollout.Tokenizer. The zero value is ready; Calls
// counts the calls of each method (tests check that earlier turns are
// never re-tokenized).
type Tokenizer struct {
	TemplateCalls, TokenizeCalls, DetokenizeCalls atomic.Int64
}

var _ rollout.Tokenizer = (*Tokenizer)(nil)

// ApplyTemplate implements rollout.Tokenizer: ChatML, with DefaultSystem
// first when msgs do not start with a system message.
func (t *Tokenizer) ApplyTemplate(ctx context.Context, msgs []rollout.ChatMessage, addGenerationPrompt bool) (string, error) {
	t.TemplateCalls.Add(1)
	if err := ctx.Err(); err != nil {
		return "", err
	}
	var b strings.Builder
	if len(msgs) == 0 || msgs[0].Role != "system" {
		b.WriteString(imStart + "system\n" + DefaultSystem + imEnd + "\n")
	}
	for _, m := range msgs {
		b.WriteString(imStart + m.Role + "\n" + m.Content + imEnd + "\n")
	}
	if addGenerationPrompt {
		b.WriteString(imStart + "assistant\n")
	}
	return b.String(), nil
}

// Tokenize implements rollout.Tokenizer: the two special tokens are
// parsed, every other byte is its own id.
func (t *Tokenizer) Tokenize(ctx context.Context, text string) ([]int32, error) {
	t.TokenizeCalls.Add(1)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return Encode(text), nil
}

// Detokenize implements rollout.Tokenizer.
func (t *Tokenizer) Detokenize(ctx context.Context, ids []int32) (string, error) {
	t.DetokenizeCalls.Add(1)
	if err := ctx.Err(); err != nil {
		return "", err
	}
	return Decode(ids), nil
}

// TokenizerHash implements rollout.Tokenizer.
func (*Tokenizer) TokenizerHash() string { return hash("trajflow/faketok/v1") }

// ChatTemplateHash implements rollout.Tokenizer.
func (*Tokenizer) ChatTemplateHash() string { return hash("trajflow/faketok/chatml/v1") }

// Encode returns the ids of text.
func Encode(text string) []int32 {
	out := make([]int32, 0, len(text))
	for i := 0; i < len(text); {
		switch {
		case strings.HasPrefix(text[i:], imStart):
			out = append(out, IMStart)
			i += len(imStart)
		case strings.HasPrefix(text[i:], imEnd):
			out = append(out, IMEnd)
			i += len(imEnd)
		default:
			out = append(out, ByteBase+int32(text[i]))
			i++
		}
	}
	return out
}

// Decode returns the text of ids (ids outside the vocabulary are dropped).
func Decode(ids []int32) string {
	var b strings.Builder
	for _, id := range ids {
		switch {
		case id == IMStart:
			b.WriteString(imStart)
		case id == IMEnd:
			b.WriteString(imEnd)
		case id >= ByteBase && int(id) < VocabSize:
			b.WriteByte(byte(id - ByteBase))
		}
	}
	return b.String()
}

func hash(s string) string {
	h := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(h[:])
}
