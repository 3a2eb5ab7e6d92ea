package loop

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// Task families of Options.Tasks.
const (
	TasksKV   = "kv"   // the built-in key-value lookup task on the built-in vocabulary (default)
	TasksText = "text" // the text tool task, for a language model on a policy server (rollout.FamilyText)
)

// ParsePolicy reads `trajflow demo --policy`: comma-separated replica URLs
// of one protocol, each sglang://HOST:PORT, vllm://HOST:PORT,
// llamacpp://HOST:PORT (the protocol named by the scheme; the replica is
// http://HOST:PORT), or http(s)://HOST:PORT with the protocol given
// separately (protocol; "" refuses such URLs). It returns the contract's
// policy section (timeouts and retries left to the contract's defaults).
func ParsePolicy(urls, protocol string) (contract.Policy, error) {
	var p contract.Policy
	for _, raw := range strings.Split(urls, ",") {
		raw = strings.TrimSpace(raw)
		if raw == "" {
			continue
		}
		u, err := url.Parse(raw)
		if err != nil || u.Host == "" {
			return contract.Policy{}, fmt.Errorf("--policy %q: want PROTOCOL://HOST:PORT (sglang, vllm, llamacpp) or http://HOST:PORT", raw)
		}
		proto, scheme := u.Scheme, "http"
		switch u.Scheme {
		case contract.PolicySGLang, contract.PolicyVLLM, contract.PolicyLlamaCpp:
		case "http", "https":
			if protocol == "" {
				return contract.Policy{}, fmt.Errorf("--policy %q: an http(s) URL needs the protocol (--policy-protocol sglang|vllm|llamacpp, or write sglang://, vllm://, llamacpp://)", raw)
			}
			proto, scheme = protocol, u.Scheme
		default:
			return contract.Policy{}, fmt.Errorf("--policy %q: unknown protocol %q (want sglang, vllm, llamacpp, or http with --policy-protocol)", raw, u.Scheme)
		}
		if p.Protocol != "" && p.Protocol != proto {
			return contract.Policy{}, fmt.Errorf("--policy: replicas of two protocols, %s and %s", p.Protocol, proto)
		}
		p.Protocol = proto
		p.Endpoints = append(p.Endpoints, scheme+"://"+u.Host)
	}
	if p.Protocol == "" {
		return contract.Policy{}, fmt.Errorf("--policy %q: no replica URL", urls)
	}
	return p, nil
}

// served reports whether the run's policy runs on servers.
func (o Options) served() bool {
	return o.Policy.Protocol != "" && o.Policy.Protocol != contract.PolicyBuiltin
}

// check refuses option combinations the loop cannot run.
func (o Options) check() error {
	switch o.Trainer {
	case "", TrainerBuiltin:
	case TrainerExternal:
		if o.NoTrain {
			return fmt.Errorf("loop: --trainer external and --no-train: an external trainer trains; leave out one of them")
		}
	default:
		return fmt.Errorf("loop: --trainer %q: want %s or %s", o.Trainer, TrainerBuiltin, TrainerExternal)
	}
	switch o.Tasks {
	case "", TasksKV:
	case TasksText:
		if !o.served() {
			return fmt.Errorf("loop: --tasks text needs a language model on a policy server (--policy llamacpp://HOST:PORT)")
		}
		if !o.NoTrain && !o.external() {
			return fmt.Errorf("loop: --tasks text needs --no-train or --trainer external (python -m trajflow.train --model gguf:PATH): the built-in trainer trains only the built-in window-MLP, not the server's language model")
		}
	default:
		return fmt.Errorf("loop: --tasks %q: want %s or %s", o.Tasks, TasksKV, TasksText)
	}
	return nil
}

// stages are the operators the run starts: Stages, with weight sync when
// the policy runs on servers and without train under NoTrain.
func (r *runner) stages() []string {
	var out []string
	for _, s := range Stages {
		if s == "train" && (r.o.NoTrain || r.o.external()) {
			continue
		}
		out = append(out, s)
	}
	if r.o.served() {
		out = append(out, "weightsync")
	}
	return out
}

// applyPolicy writes o's policy section and task family into c (before
// Resolve).
func applyPolicy(c *contract.Contract, o Options) {
	if o.served() {
		def := c.Policy
		c.Policy = o.Policy
		if c.Policy.TimeoutMS == 0 {
			c.Policy.TimeoutMS = def.TimeoutMS
		}
		if c.Policy.Retries == 0 {
			c.Policy.Retries = def.Retries
		}
		if c.Policy.Concurrency == 0 {
			c.Policy.Concurrency = def.Concurrency
		}
	}
	if o.Tasks == TasksText {
		textKnobs(c)
	}
	if o.StopTokenIDs != nil {
		c.Sampler.StopTokenIDs = slices.Clone(o.StopTokenIDs)
	}
}

// textKnobs makes c the text tool task's contract (rollout.FamilyText) for
// a small language model on a policy server: 2 tasks x 2 groups x 4
// attempts per round, at most 3 turns of 32 tokens, 960 tokens per
// episode (a llama-server slot of -c 2048 -np 2 holds 1024), GRPO keeping
// zero-variance groups (the untrained model often fails every attempt),
// the optimizer of a pretrained language model.
// The artifacts that the server holds (model, tokenizer, chat template)
// are named as the server's; each trajectory records their hashes.
func textKnobs(c *contract.Contract) {
	a := &c.Artifacts
	a.Environment = rollout.ArtifactText
	a.TaskCorpus = "builtin:tasks/text@v1"
	a.SplitManifest = "builtin:splits/text-256-train-64-eval@v1"
	a.ToolSchemas = "builtin:tools/text-calc-lookup@v1"
	a.Validator = "builtin:validator/text_success@1"
	a.PolicyCheckpoint = "policy-server:model@v1"
	a.Tokenizer = "policy-server:tokenizer@v1"
	a.ChatTemplate = "policy-server:chat-template@v1"
	c.Objective.TargetDistribution = "builtin_text_tool_tasks_v1"
	c.Objective.Constraints["p95_turns"] = 3
	c.Rewards = []contract.Reward{{Name: rollout.EvalTextSuccess, Version: "1", Weight: 1,
		Transform: contract.TransformIdentity, Scope: schemas.ScopeTrajectory}}
	c.Sampler.MaxTokensPerAction = 32
	c.Sampler.MaxTokensPerEpisode = 960
	c.Sampler.MaxTurns = 3
	c.Sampler.GroupSize = 4
	c.Sampler.StopTokenIDs = nil
	c.Sampler.ToolTimeoutMS = 20_000
	c.Estimator.ZeroVariance = "keep"
	c.Dispatch.TasksPerUpdate, c.Dispatch.GroupsPerUpdate = 2, 2
	c.Packing.BatchGroups = 2
	c.Packing.TokenBudget = 1024
	// A trainer of the language model (--trainer external): fine-tuning
	// steps of a pretrained 135M model, one pass over each batch, no
	// entropy bonus (the demo's 0.01 and 0.05 are for the window-MLP
	// trained from scratch), and the token-mean normalization (the demo's
	// token-sum constant, 4096, is sized for the window-MLP's batches).
	c.Loss.Optimizer.LR = 1e-5
	c.Loss.Optimizer.Epochs = 1
	c.Loss.EntropyCoef = 0
	c.Loss.Normalization, c.Loss.NormTokens = objective.TokenMean, 0
}

// textStops asks the first replica for the ids that end an assistant
// turn: the first id of the chat template's assistant closing (ChatML's
// <|im_end|>) and, when the vocabulary has it as one id, <|endoftext|>
// (SmolLM2's end of text, which llama-server also ends generation at).
func textStops(ctx context.Context, o Options) ([]int32, error) {
	c := contract.Default()
	applyPolicy(c, Options{Policy: o.Policy})
	if err := c.Resolve(); err != nil {
		return nil, err
	}
	cl, err := operators.PolicyClient(c, operators.PolicyEndpoints(c)[0], nil)
	if err != nil {
		return nil, err
	}
	tok, ok := cl.(rollout.Tokenizer)
	if !ok {
		return nil, fmt.Errorf("loop: the %s client has no tokenizer", c.Policy.Protocol)
	}
	if s, ok := cl.(interface{ Served(int64) }); ok && c.Policy.Router {
		// A router's tokenizer calls name a model: version 0's, the model
		// every run starts from (its versions share the tokenizer). It
		// must be loaded on the router (examples/llm/run.sh loads it).
		s.Served(0)
	}
	// A final assistant message is rendered open (for the model to go
	// on): follow it with a user message, and take the text between them.
	msgs := []rollout.ChatMessage{{Role: "user", Content: "q"}, {Role: "assistant", Content: "\u27e6a\u27e7"}, {Role: "user", Content: "\u27e6u\u27e7"}}
	text, err := tok.ApplyTemplate(ctx, msgs, false)
	if err != nil {
		return nil, fmt.Errorf("loop: the policy server's chat template: %w", err)
	}
	_, rest, ok := strings.Cut(text, "\u27e6a\u27e7")
	closing, _, ok2 := strings.Cut(rest, "\u27e6u\u27e7")
	if !ok || !ok2 || closing == "" {
		return nil, fmt.Errorf("loop: the policy server's chat template closes no assistant message")
	}
	ids, err := tok.Tokenize(ctx, closing)
	if err != nil {
		return nil, fmt.Errorf("loop: tokenize the assistant closing %q: %w", closing, err)
	}
	if len(ids) == 0 {
		return nil, fmt.Errorf("loop: the assistant closing %q tokenizes to no ids", closing)
	}
	stops := []int32{ids[0]}
	if eot, err := tok.Tokenize(ctx, "<|endoftext|>"); err == nil && len(eot) == 1 && eot[0] != ids[0] {
		stops = append(stops, eot[0])
	}
	return stops, nil
}

// servedVocab asks the policy servers their vocabulary (validate and the
// snapshot bound token ids by it) when the run's tokenizer is not the
// built-in one.
func (r *runner) servedVocab(ctx context.Context) error {
	if !r.o.served() || r.deps.VocabSize > 0 {
		return nil
	}
	g, err := operators.PolicyServer(r.c, 0, "", nil)
	if err != nil {
		return err
	}
	defer g.Close()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	v, err := g.Vocab(cctx)
	if err != nil {
		return fmt.Errorf("loop: the policy servers' vocabulary: %w", err)
	}
	r.deps.VocabSize = v
	return nil
}

// publishInitial publishes release 0 when no trainer runs (NoTrain): for
// the built-in policy the trainer's own initial release (the same files
// and manifest the train stage writes at its start); for a text run the
// model the servers serve (a single-model llama-server's model file: its
// manifest names that file and its sha256, and the servers' tokenizer and
// chat template hashes), which weight sync then verifies on every replica.
func (r *runner) publishInitial(ctx context.Context) error {
	if !r.o.NoTrain {
		return nil
	}
	var rel schemas.PolicyRelease
	if r.o.Tasks != TasksText {
		mc, seed := operators.ModelConfig(r.c)
		m0, err := gpu.InitialModel(mc, seed)
		if err != nil {
			return err
		}
		cfg, err := operators.TrainConfig(r.deps)
		if err != nil {
			return err
		}
		if rel, err = gpu.ReleaseModel(r.files, m0, 0, 0, cfg.Meta); err != nil {
			return err
		}
	} else {
		var err error
		if rel, err = r.servedRelease(ctx); err != nil {
			return err
		}
	}
	b, err := schemas.EncodeRelease(rel)
	if err != nil {
		return err
	}
	id := schemas.DerivedID("release", r.c.RunID+"/0")
	hs := stagekit.Headers(schemas.KindPolicyRelease, id)
	w := &kafkago.Writer{Addr: kafkago.TCP(r.brokers...), Topic: r.topics.Policy, RequiredAcks: kafkago.RequireAll,
		BatchTimeout: time.Millisecond, Transport: r.transport, Compression: kafka.CompressionOf(r.c.Topics.Compression, "policy")}
	defer w.Close()
	msg := kafkago.Message{Key: []byte(r.c.RunID), Value: b}
	for _, h := range hs {
		msg.Headers = append(msg.Headers, kafkago.Header{Key: h.Key, Value: h.Value})
	}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := w.WriteMessages(pctx, msg); err != nil {
		return fmt.Errorf("loop: publish release 0: %w", err)
	}
	return nil
}

// servedRelease is the manifest of the model a single-model llama.cpp
// server serves (release 0 of a text run).
func (r *runner) servedRelease(ctx context.Context) (schemas.PolicyRelease, error) {
	if r.c.Policy.Protocol != contract.PolicyLlamaCpp || r.c.Policy.Router {
		return schemas.PolicyRelease{}, fmt.Errorf("loop: --no-train with text tasks runs on single-model llama.cpp servers (llama-server -m FILE), got %s (router %v)", r.c.Policy.Protocol, r.c.Policy.Router)
	}
	cl, err := operators.PolicyClient(r.c, operators.PolicyEndpoints(r.c)[0], nil)
	if err != nil {
		return schemas.PolicyRelease{}, err
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	id, err := cl.Identity(cctx)
	if err != nil {
		return schemas.PolicyRelease{}, fmt.Errorf("loop: the policy server's identity: %w", err)
	}
	sum, err := fileSHA256(id.Model)
	if err != nil {
		return schemas.PolicyRelease{}, fmt.Errorf("loop: the served model file %s (the manifest of release 0 records its hash; the server must run on this machine): %w", id.Model, err)
	}
	rel := schemas.PolicyRelease{
		PolicyVersion: 0, CheckpointHash: sum, CheckpointURI: "file://" + id.Model,
		TokenizerHash: id.TokenizerHash, ChatTemplateHash: id.ChatTemplateHash, ContractHash: r.c.Hash(),
		CreatedAt: time.Now().UTC().Format(time.RFC3339), Ready: true,
	}
	js, err := json.MarshalIndent(rel, "", "  ")
	if err != nil {
		return schemas.PolicyRelease{}, err
	}
	if _, err := r.files.Write(gpu.ManifestName(0), js); err != nil {
		return schemas.PolicyRelease{}, err
	}
	return rel, nil
}

func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

// policyNote is the header's note on where rollout generates.
func (r *runner) policyNote() string {
	p := r.c.Policy
	if !r.o.served() {
		return "built-in policy in process"
	}
	note := fmt.Sprintf("policy on %d %s replica(s) %v with weight sync", len(p.Endpoints), p.Protocol, p.Endpoints)
	if !r.o.NoTrain {
		note += " (the servers load releases from " + r.deps.ReleaseDir + ")"
	}
	return note
}
