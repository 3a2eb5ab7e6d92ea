package policy

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// Protocols.
const (
	LlamaCpp = "llamacpp" // llama.cpp llama-server
	SGLang   = "sglang"   // SGLang native API
	VLLM     = "vllm"     // vLLM token-in/token-out API
)

// Identity is what a client knows of the server behind it (docs/SYSTEMS.md §8, §9):
// recorded with the samples it serves, and hashed into the sampler id.
type Identity struct {
	Protocol string `json:"protocol"`
	Addr     string `json:"addr"`
	// Server is the server software and its version or build, as the
	// server reports it ("llama.cpp b1234-abcdef", "sglang 0.5.1").
	Server string `json:"server"`
	// Model is the model id or path the server reports; ModelHash a hash
	// of it when the server reports one.
	Model     string `json:"model"`
	ModelHash string `json:"model_hash,omitempty"`
	// Vocab is the vocabulary size (0: the server does not say; sampled
	// ids are then only checked to be non-negative).
	Vocab int `json:"vocab"`
	// TokenizerHash and ChatTemplateHash: "sha256:<hex>". The template hash
	// is of the template text when the server reports it; the tokenizer
	// hash is the one the server reports, else the one the client was
	// configured with (the release manifest's), else "".
	TokenizerHash    string `json:"tokenizer_hash"`
	ChatTemplateHash string `json:"chat_template_hash"`
	// Grammar is the id of the constrained-decoding grammar the server
	// applies to every request ("" none): requests must carry the same
	// grammar in their settings (model.Settings.Grammar.ID()).
	Grammar string `json:"grammar"`
	// Logprobs says which distribution the returned log-probs are of
	// (always the sampling distribution after temperature and truncation
	// for these clients; recorded for the reader).
	Logprobs string `json:"logprobs"`
	// Seed64 says that a llama.cpp-protocol server reads the request's
	// whole 64-bit seed ("trajflow_seed", trajflow serve policy only).
	Seed64 bool `json:"seed64,omitempty"`
	// Endpoint is the generation call the client makes where its protocol
	// offers more than one ("POST /inference/v1/generate", or vLLM's
	// OpenAI-style "POST /v1/completions" once a server has answered the
	// former 404); "" where there is one. It is not hashed into the
	// sampler id: a client sends the same sampler fields whichever it
	// uses, so the samples of both are of one sampler.
	Endpoint string `json:"endpoint,omitempty"`
}

// Want is a requirement on the weight version a request is served by: the
// served version must equal Version, or be at least Version when AtLeast.
// The zero Want accepts any version; version 0 (the initial policy) is
// required exactly with Exact (Exactly(0)).
type Want struct {
	Version int64
	AtLeast bool
	Exact   bool
}

// Exactly wants version v and no other (v may be 0).
func Exactly(v int64) Want { return Want{Version: v, Exact: true} }

// AtLeast wants version v or a newer one.
func AtLeast(v int64) Want { return Want{Version: v, AtLeast: true} }

// Any reports whether w accepts every version (the zero Want).
func (w Want) Any() bool { return w.Version == 0 && !w.AtLeast && !w.Exact }

// Meets reports whether a served version meets w.
func (w Want) Meets(served int64) bool {
	return w.Any() || served == w.Version || (w.AtLeast && served > w.Version)
}

// Check reports a version_mismatch for a served version that does not meet
// w.
func (w Want) Check(addr string, served int64) error {
	if w.Meets(served) {
		return nil
	}
	rel := "version"
	if w.AtLeast {
		rel = "at least version"
	}
	return Infra(ReasonVersionMismatch, addr, "served weight version %d, wanted %s %d", served, rel, w.Version)
}

// Client is a policy server client of one protocol: it implements
// rollout.Policy (a batch is sent as concurrent requests) and knows its
// server. Every error it returns for a server or network failure is an
// *InfraError.
type Client interface {
	rollout.Policy
	// GenerateEach sends every request, at most the client's concurrency
	// at a time, and returns a sample or an error per request (the error
	// slice is nil when all succeeded). A request whose served version does
	// not meet want fails with version_mismatch. ctx ending fails the
	// requests not yet answered with ctx's error.
	GenerateEach(ctx context.Context, reqs []model.Request, want Want) ([]model.Sample, []error)
	// Protocol is LlamaCpp, SGLang or VLLM; Addr the server's base URL.
	Protocol() string
	Addr() string
	// Health asks the server's health endpoint.
	Health(ctx context.Context) error
	// Identity asks the server's info endpoints (once; later calls return
	// the cached identity).
	Identity(ctx context.Context) (Identity, error)
	// SamplerID is "sha256:<hex>" of the protocol, the server's identity
	// (as last fetched), the settings' own id and the sampler fields the
	// client sends for them (docs/PIPELINE.md §5 "Record the resolved sampler").
	SamplerID(s model.Settings) string
}

// ModelName is the name of policy version v (0, the initial policy, and
// up) in a llama.cpp router's models directory and in `trajflow serve
// policy --protocol llamacpp`: "policy-v%08d", the base name of the
// release's manifest and checkpoint files (gpu.ManifestName,
// gpu.CheckpointName), so that GGUF exports named policy-v00000007.gguf in
// a router's --models-dir serve version 7.
func ModelName(v int64) string { return fmt.Sprintf("policy-v%08d", v) }

// ParseModelName returns the version of a ModelName.
func ParseModelName(name string) (int64, error) {
	s, ok := strings.CutPrefix(name, "policy-v")
	if !ok || len(s) < 8 {
		return 0, fmt.Errorf("%w: model name %q is not policy-vNNNNNNNN", ErrConfig, name)
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < 0 || ModelName(v) != name {
		return 0, fmt.Errorf("%w: model name %q is not policy-vNNNNNNNN", ErrConfig, name)
	}
	return v, nil
}

// WeightVersion is the weight_version string of policy version v over
// SGLang and vLLM: its decimal form.
func WeightVersion(v int64) string { return strconv.FormatInt(v, 10) }

// ParseWeightVersion returns the policy version of a weight_version
// string: a non-negative decimal integer in canonical form (0 is the
// initial policy; SGLang's "default", before any load, is none).
func ParseWeightVersion(s string) (int64, error) {
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < 0 || strconv.FormatInt(v, 10) != s {
		return 0, fmt.Errorf("weight_version %q is not a policy version (a non-negative decimal)", s)
	}
	return v, nil
}

// HashStrings is "sha256:<hex>" of length-prefixed parts.
func HashStrings(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(strconv.Itoa(len(p))))
		h.Write([]byte{':'})
		h.Write([]byte(p))
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

// HashText is "sha256:<hex>" of s (chat templates).
func HashText(s string) string {
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// SamplerID hashes the parts of a resolved sampler: protocol, server
// identity (software, model, tokenizer, template, grammar, log-prob
// semantics; not the endpoint), the settings' own id and the exact sampler
// fields sent.
func SamplerID(id Identity, s model.Settings, sent string) string {
	return HashStrings("policy-sampler/v1", id.Protocol, id.Server, id.Model, id.ModelHash,
		id.TokenizerHash, id.ChatTemplateHash, id.Grammar, id.Logprobs, s.ID(), sent)
}

// GrammarID is the id of a settings' grammar ("" none).
func GrammarID(s model.Settings) string {
	if s.Grammar == nil {
		return ""
	}
	return s.Grammar.ID()
}

// CheckGrammar refuses settings whose grammar is not the one the server
// applies (ErrSettings): a server applies its own grammar to every request
// or none, and the recorded log-probs are those of the masked distribution
// only when both sides agree.
func CheckGrammar(id Identity, s model.Settings) error {
	if g := GrammarID(s); g != id.Grammar {
		if id.Grammar == "" {
			return fmt.Errorf("%w: settings carry grammar %q, the %s server at %s applies none", ErrSettings, g, id.Protocol, id.Addr)
		}
		return fmt.Errorf("%w: settings carry grammar %q, the %s server at %s applies %q to every request", ErrSettings, g, id.Protocol, id.Addr, id.Grammar)
	}
	return nil
}
