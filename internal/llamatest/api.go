package llamatest

import (
	"context"
	"fmt"
)

// SmolLM2's special token ids (checked with POST /tokenize on
// SmolLM2-135M-Instruct; vocabulary size 49152).
const (
	TokenEndOfText = 0 // <|endoftext|>
	TokenImStart   = 1 // <|im_start|>, the GGUF's BOS token (never added to token prompts)
	TokenImEnd     = 2 // <|im_end|>, the GGUF's EOS token: ends an assistant turn
	VocabSize      = 49152
)

// RandomSeed is the seed value llama-server treats as "pick one at random"
// (also what it reports when a request sends no seed or -1). Larger seeds
// wrap modulo 2^32.
const RandomSeed = 0xFFFFFFFF

// CompletionRequest is the body of POST /completion with a token-id prompt.
// Every sampler setting is sent, never left to the server's defaults (which
// are temperature 0.8, top_k 40, top_p 0.95, min_p 0.05).
type CompletionRequest struct {
	// Model selects the model in router mode; "" on a single-model server.
	Model             string   `json:"model,omitempty"`
	Prompt            []int    `json:"prompt"`
	NPredict          int      `json:"n_predict"`
	Seed              uint32   `json:"seed"`
	ReturnTokens      bool     `json:"return_tokens"`
	NProbs            int      `json:"n_probs"`
	PostSamplingProbs bool     `json:"post_sampling_probs"`
	CachePrompt       bool     `json:"cache_prompt"`
	Temperature       float64  `json:"temperature"`
	TopK              int      `json:"top_k"`
	TopP              float64  `json:"top_p"`
	MinP              float64  `json:"min_p"`
	TypicalP          float64  `json:"typical_p"`
	TopNSigma         float64  `json:"top_n_sigma"`
	RepeatPenalty     float64  `json:"repeat_penalty"`
	RepeatLastN       int      `json:"repeat_last_n"`
	PresencePenalty   float64  `json:"presence_penalty"`
	FrequencyPenalty  float64  `json:"frequency_penalty"`
	DryMultiplier     float64  `json:"dry_multiplier"`
	XTCProbability    float64  `json:"xtc_probability"`
	Mirostat          int      `json:"mirostat"`
	DynatempRange     float64  `json:"dynatemp_range"`
	Samplers          []string `json:"samplers"`
	IgnoreEOS         bool     `json:"ignore_eos"`
	Stop              []string `json:"stop"`
}

// Neutral is a request whose sampler chain leaves the model's distribution
// untouched: temperature 1, no truncation, no penalties, and the chain
// restricted to temperature. With it the sampled tokens follow the model's
// softmax and each `logprob` is the behavior log-probability. nProbs is the
// number of alternatives returned per position (at least 1 so that the
// sampled token's log-probability comes back). The seed must not be
// RandomSeed for a reproducible answer.
func Neutral(prompt []int, nPredict int, seed uint32, nProbs int) CompletionRequest {
	return CompletionRequest{
		Prompt:        prompt,
		NPredict:      nPredict,
		Seed:          seed,
		ReturnTokens:  true,
		NProbs:        nProbs,
		CachePrompt:   false,
		Temperature:   1,
		TopK:          0,
		TopP:          1,
		MinP:          0,
		TypicalP:      1,
		TopNSigma:     -1,
		RepeatPenalty: 1,
		RepeatLastN:   0,
		Samplers:      []string{"temperature"},
		Stop:          []string{},
	}
}

// CompletionResponse is the answer of a non-streamed POST /completion.
type CompletionResponse struct {
	Content string `json:"content"`
	// Tokens are the sampled ids (return_tokens), the EOS token included
	// when the generation stopped on it.
	Tokens []int `json:"tokens"`
	// Probs has one entry per sampled token (n_probs > 0).
	Probs []TokenProb `json:"completion_probabilities"`
	// StopType is "eos", "limit" (n_predict or the slot's context reached)
	// or "word" (a stop string).
	StopType     string `json:"stop_type"`
	StoppingWord string `json:"stopping_word"`
	// Truncated is true when the prompt plus the generation reached the
	// slot's context (-c divided by -np).
	Truncated       bool    `json:"truncated"`
	TokensEvaluated int     `json:"tokens_evaluated"`
	TokensPredicted int     `json:"tokens_predicted"`
	TokensCached    int     `json:"tokens_cached"`
	IDSlot          int     `json:"id_slot"`
	Model           string  `json:"model"`
	Timings         Timings `json:"timings"`
}

// TokenProb is one entry of completion_probabilities. Without
// post_sampling_probs the server fills LogProb (log-softmax of the raw
// logits, whatever the temperature) and TopLogProbs; with it, Prob (after
// the sampler chain) and TopProbs.
type TokenProb struct {
	ID int `json:"id"`
	// Token is the piece cut to valid UTF-8; Bytes is the whole piece.
	Token       string     `json:"token"`
	Bytes       []int      `json:"bytes"`
	LogProb     *float64   `json:"logprob,omitempty"`
	Prob        *float64   `json:"prob,omitempty"`
	TopLogProbs []TopToken `json:"top_logprobs,omitempty"`
	TopProbs    []TopToken `json:"top_probs,omitempty"`
}

// TopToken is one alternative of a position.
type TopToken struct {
	ID      int      `json:"id"`
	Token   string   `json:"token"`
	Bytes   []int    `json:"bytes"`
	LogProb *float64 `json:"logprob,omitempty"`
	Prob    *float64 `json:"prob,omitempty"`
}

// Timings is the server's own account of a request.
type Timings struct {
	CacheN             int     `json:"cache_n"`
	PromptN            int     `json:"prompt_n"`
	PromptMS           float64 `json:"prompt_ms"`
	PredictedN         int     `json:"predicted_n"`
	PredictedMS        float64 `json:"predicted_ms"`
	PredictedPerSecond float64 `json:"predicted_per_second"`
}

// Complete sends a non-streamed POST /completion.
func (s *Server) Complete(ctx context.Context, req CompletionRequest) (*CompletionResponse, error) {
	var out CompletionResponse
	if err := s.Post(ctx, "/completion", req, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// AlignProbs pairs each sampled token with its completion_probabilities
// entry. The server sends no entry for a token after which the generated
// text ends inside a UTF-8 character, nor for the tokens of a matched stop
// string, so the entries are a subsequence of the tokens. aligned[i] is nil
// where token i has no entry, or where two placements of the entries are
// possible (a dropped token followed by the same id). It is an error when
// the entries are not a subsequence of the tokens.
func AlignProbs(tokens []int, probs []TokenProb) ([]*TokenProb, error) {
	n, m := len(tokens), len(probs)
	// Earliest and latest position of each entry: where they agree the
	// placement is certain.
	first := make([]int, m)
	for i, j := 0, 0; j < m; i++ {
		if i == n {
			return nil, fmt.Errorf("completion_probabilities[%d] (id %d) matches no remaining token", j, probs[j].ID)
		}
		if tokens[i] == probs[j].ID {
			first[j] = i
			j++
		}
	}
	aligned := make([]*TokenProb, n)
	for i, j := n-1, m-1; j >= 0; i-- {
		if tokens[i] == probs[j].ID {
			if i == first[j] {
				aligned[i] = &probs[j]
			}
			j--
		}
	}
	return aligned, nil
}

// Tokenize returns the ids of text without BOS. Special tokens written in
// the text (<|im_start|>, <|im_end|>) are parsed as such.
func (s *Server) Tokenize(ctx context.Context, model, text string) ([]int, error) {
	body := map[string]any{"content": text, "add_special": false, "parse_special": true}
	if model != "" {
		body["model"] = model
	}
	var out struct {
		Tokens []int `json:"tokens"`
	}
	if err := s.Post(ctx, "/tokenize", body, &out); err != nil {
		return nil, err
	}
	return out.Tokens, nil
}

// ChatMessage is one message for /apply-template.
type ChatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// ApplyTemplate renders messages with the model's chat template and the
// assistant header appended. A final assistant message is rendered open
// (no <|im_end|>) for the model to continue, unless the server was started
// with --no-prefill-assistant.
func (s *Server) ApplyTemplate(ctx context.Context, model string, messages []ChatMessage) (string, error) {
	body := map[string]any{"messages": messages}
	if model != "" {
		body["model"] = model
	}
	var out struct {
		Prompt string `json:"prompt"`
	}
	if err := s.Post(ctx, "/apply-template", body, &out); err != nil {
		return "", err
	}
	return out.Prompt, nil
}
