package serve

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// The llama.cpp protocol (llama-server in router mode):
//
//	POST /completion          token-id prompt → tokens, completion_probabilities, stop_type
//	POST /v1/completions      OpenAI's (completions.go)
//	POST /tokenize, /detokenize, /apply-template
//	GET  /health, /props, /models, /v1/models
//	POST /models/load {"model": NAME}, /models/unload {"model": NAME}
//
// NAME is policy.ModelName(version), "policy-vNNNNNNNN": the release whose
// manifest is NAME.json in the releases directory. Several versions may be
// loaded at once; a completion names one in "model" (it may omit it when
// exactly one is loaded). Unloading a model lets the requests holding it
// finish on it.
//
// Sampling follows llama-server: every field absent from a request takes
// llama-server's default (temperature 0.8, top_k 40, top_p 0.95, min_p
// 0.05, the default sampler order with temperature last, a random seed);
// settings the built-in policy cannot apply exactly are refused with 400:
// min_p, typical_p, penalties, DRY, XTC, mirostat, top-n-sigma and dynamic
// temperature must be neutral, the seed must be given, and top_p needs
// temperature (and top_k) before it in "samplers" because the built-in
// sampler truncates the tempered distribution. A sampler left out of
// "samplers" is not applied, as in llama-server. Generation ends after an
// end-of-generation id (Config.EOG) or n_predict ids.
//
// Log-probs: without post_sampling_probs each completion_probabilities
// entry has `logprob`, of the model's raw distribution (temperature 1, no
// grammar), as llama-server. With it, `prob` is the probability under the
// sampling distribution (temperature, grammar, top-k, top-p), and
// `trajflow_logprob` is that log-prob exactly as the sampler computed it (a
// float32 value written as the shortest decimal of that float64): a double
// `prob` cannot carry a log-prob within ~1e-9 of 0 to float32 precision.
// n_probs is at most 20 (maxLogprobs), where llama-server takes up to its
// vocabulary: the answer holds n_probs entries per generated id.
//
// Seeds: llama-server's seed is 32 bits. A request may also carry
// `trajflow_seed`, the request's whole 64-bit seed (announced by
// "trajflow_seed": true in /props; llama-server ignores the field), which
// must fold to `seed` (the xor of its halves, llamacpp.Seed32): the sample
// is then the one model.Policy.Generate draws in process for that seed.
func (s *Server) llamaRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /completion", s.llamaCompletion)
	mux.HandleFunc("POST /completions", s.llamaCompletion)
	mux.HandleFunc("POST /v1/completions", s.llamaCompletions)
	mux.HandleFunc("POST /tokenize", s.llamaTokenize)
	mux.HandleFunc("POST /detokenize", s.llamaDetokenize)
	mux.HandleFunc("POST /apply-template", s.llamaApplyTemplate)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"status": "ok"})
	})
	mux.HandleFunc("GET /props", s.llamaProps)
	mux.HandleFunc("GET /models", s.llamaModels)
	mux.HandleFunc("GET /v1/models", s.llamaModels)
	mux.HandleFunc("POST /models/load", s.llamaLoad)
	mux.HandleFunc("POST /models/unload", s.llamaUnload)
}

type llamaCompletionReq struct {
	Prompt            json.RawMessage `json:"prompt"`
	NPredict          *int            `json:"n_predict"`
	Temperature       *float64        `json:"temperature"`
	TopK              *int            `json:"top_k"`
	TopP              *float64        `json:"top_p"`
	MinP              *float64        `json:"min_p"`
	TypicalP          *float64        `json:"typical_p"`
	RepeatPenalty     *float64        `json:"repeat_penalty"`
	RepeatLastN       *int            `json:"repeat_last_n"`
	PresencePenalty   *float64        `json:"presence_penalty"`
	FrequencyPenalty  *float64        `json:"frequency_penalty"`
	DryMultiplier     *float64        `json:"dry_multiplier"`
	XTCProbability    *float64        `json:"xtc_probability"`
	Mirostat          *int            `json:"mirostat"`
	TopNSigma         *float64        `json:"top_n_sigma"`
	DynatempRange     *float64        `json:"dynatemp_range"`
	Seed              *int64          `json:"seed"`
	TrajflowSeed      *uint64         `json:"trajflow_seed"`
	Samplers          []string        `json:"samplers"`
	NProbs            int             `json:"n_probs"`
	PostSamplingProbs bool            `json:"post_sampling_probs"`
	ReturnTokens      bool            `json:"return_tokens"`
	CachePrompt       *bool           `json:"cache_prompt"`
	Stream            bool            `json:"stream"`
	Model             string          `json:"model"`
	IgnoreEOS         bool            `json:"ignore_eos"`
	Stop              []string        `json:"stop"`
	LogitBias         json.RawMessage `json:"logit_bias"`
}

// llamaDefaultSamplers is llama-server's default sampler order.
var llamaDefaultSamplers = []string{"penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"}

// llamaSettings maps a completion request to the built-in settings, or
// says which field cannot be honored.
func (c *core) llamaSettings(q *llamaCompletionReq) (model.Settings, uint64, error) {
	f64 := func(p *float64, def float64) float64 {
		if p == nil {
			return def
		}
		return *p
	}
	order := q.Samplers
	if order == nil {
		order = llamaDefaultSamplers
	}
	at := map[string]int{}
	for i, name := range order {
		if !slices.Contains(llamaDefaultSamplers, name) {
			return model.Settings{}, 0, fmt.Errorf("samplers[%d] %q is not a llama-server sampler name", i, name)
		}
		if _, dup := at[name]; dup {
			return model.Settings{}, 0, fmt.Errorf("samplers lists %q twice", name)
		}
		at[name] = i
	}
	neutral := []struct {
		name, sampler  string
		got, def, want float64
	}{
		{"min_p", "min_p", f64(q.MinP, 0.05), 0.05, 0},
		{"typical_p", "typ_p", f64(q.TypicalP, 1), 1, 1},
		{"repeat_penalty", "penalties", f64(q.RepeatPenalty, 1), 1, 1},
		{"presence_penalty", "penalties", f64(q.PresencePenalty, 0), 0, 0},
		{"frequency_penalty", "penalties", f64(q.FrequencyPenalty, 0), 0, 0},
		{"dry_multiplier", "dry", f64(q.DryMultiplier, 0), 0, 0},
		{"xtc_probability", "xtc", f64(q.XTCProbability, 0), 0, 0},
		{"top_n_sigma", "top_n_sigma", f64(q.TopNSigma, -1), -1, -1},
		{"dynatemp_range", "temperature", f64(q.DynatempRange, 0), 0, 0},
	}
	for _, n := range neutral {
		if _, applied := at[n.sampler]; applied && n.got != n.want {
			return model.Settings{}, 0, fmt.Errorf("%s %v is not applied by the built-in policy; send %v or leave %q out of samplers (llama-server's default is %v)", n.name, n.got, n.want, n.sampler, n.def)
		}
	}
	switch {
	case q.Mirostat != nil && *q.Mirostat != 0:
		return model.Settings{}, 0, fmt.Errorf("mirostat %d is not applied by the built-in policy; send 0", *q.Mirostat)
	case q.Stream:
		return model.Settings{}, 0, fmt.Errorf("stream is not served; send stream false")
	case q.IgnoreEOS:
		return model.Settings{}, 0, fmt.Errorf("ignore_eos is not served (it masks the end-of-generation ids)")
	case len(q.Stop) > 0:
		return model.Settings{}, 0, fmt.Errorf("stop strings are not served; the built-in vocabulary stops at end-of-generation ids %v", c.cfg.EOG)
	case len(q.LogitBias) > 0 && string(q.LogitBias) != "[]" && string(q.LogitBias) != "{}" && string(q.LogitBias) != "null":
		return model.Settings{}, 0, fmt.Errorf("logit_bias is not applied by the built-in policy")
	case q.NPredict == nil || *q.NPredict <= 0:
		return model.Settings{}, 0, fmt.Errorf("n_predict must be positive (llama-server's default -1 is unbounded)")
	case q.Seed == nil:
		return model.Settings{}, 0, fmt.Errorf("seed is required (llama-server's default draws a random seed)")
	case *q.Seed < 0 || *q.Seed >= math.MaxUint32:
		return model.Settings{}, 0, fmt.Errorf("seed %d not in [0, %d) (a 32-bit seed; %d means random)", *q.Seed, uint32(math.MaxUint32), uint32(math.MaxUint32))
	}
	temp, topK, topP := f64(q.Temperature, 0.8), 40, f64(q.TopP, 0.95)
	if q.TopK != nil {
		topK = *q.TopK
	}
	if _, ok := at["temperature"]; !ok {
		temp = 1
	}
	if _, ok := at["top_k"]; !ok || topK < 0 {
		topK = 0
	}
	if _, ok := at["top_p"]; !ok || topP >= 1 {
		topP = 1
	}
	if !(temp > 0) {
		return model.Settings{}, 0, fmt.Errorf("temperature %v: the built-in policy samples at a positive temperature (llama-server samples greedily at <= 0)", temp)
	}
	if topP < 1 {
		if temp != 1 && at["temperature"] > at["top_p"] {
			return model.Settings{}, 0, fmt.Errorf("samplers %v apply top_p before temperature; the built-in policy applies temperature first", order)
		}
		if topK > 0 && at["top_k"] > at["top_p"] {
			return model.Settings{}, 0, fmt.Errorf("samplers %v apply top_p before top_k; the built-in policy applies top_k first", order)
		}
	}
	st := model.Settings{
		Behavior:  model.Behavior{Temperature: temp, TopK: topK, TopP: topP},
		MaxTokens: *q.NPredict,
		Stop:      c.cfg.EOG,
	}
	if err := st.Validate(); err != nil {
		return model.Settings{}, 0, err
	}
	seed := uint64(*q.Seed)
	if q.TrajflowSeed != nil {
		// The whole 64-bit seed (this server's extension, announced in
		// /props): the built-in policy then samples exactly as in
		// process. It must fold to the 32-bit seed sent beside it.
		if fold32(*q.TrajflowSeed) != uint32(*q.Seed) {
			return model.Settings{}, 0, fmt.Errorf("trajflow_seed %d does not fold to seed %d (the xor of its halves)", *q.TrajflowSeed, *q.Seed)
		}
		seed = *q.TrajflowSeed
	}
	return st, seed, nil
}

// fold32 is llamacpp.Seed32: the 32-bit llama-server seed of a 64-bit
// seed.
func fold32(s uint64) uint32 {
	x := uint32(s) ^ uint32(s>>32)
	if x == math.MaxUint32 {
		x--
	}
	return x
}

// llamaModel picks the loaded model a request names.
func (c *core) llamaModel(name string) (*loaded, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if name == "" {
		if len(c.models) == 1 {
			for _, l := range c.models {
				return l, nil
			}
		}
		return nil, fmt.Errorf("%d models are loaded: name one in \"model\"", len(c.models))
	}
	l, ok := c.models[name]
	if !ok {
		return nil, fmt.Errorf("model %q is not loaded (POST /models/load first)", name)
	}
	return l, nil
}

// parseIDs reads a list of token ids of at most max entries.
func parseIDs(raw json.RawMessage, field string, max int) ([]int32, error) {
	var ids []int64
	if err := json.Unmarshal(raw, &ids); err != nil {
		var batch [][]int64
		if json.Unmarshal(raw, &batch) == nil {
			return nil, fmt.Errorf("%s is a batch of %d prompts: one prompt per request is served (send each list of token ids in its own request)", field, len(batch))
		}
		return nil, fmt.Errorf("%s must be a list of token ids (text prompts are not served): %w", field, err)
	}
	if len(ids) > max {
		return nil, fmt.Errorf("%s has %d ids, more than this server's limit of %d (trajflow serve policy --max-prompt-tokens)", field, len(ids), max)
	}
	out := make([]int32, len(ids))
	for i, id := range ids {
		if id < 0 || id > math.MaxInt32 {
			return nil, fmt.Errorf("%s[%d] = %d is not a token id", field, i, id)
		}
		out[i] = int32(id)
	}
	return out, nil
}

type llamaTop struct {
	ID      int32    `json:"id"`
	Token   string   `json:"token"`
	Bytes   []int    `json:"bytes"`
	Logprob *float64 `json:"logprob,omitempty"`
	Prob    *float64 `json:"prob,omitempty"`
}

type llamaProb struct {
	ID              int32      `json:"id"`
	Token           string     `json:"token"`
	Bytes           []int      `json:"bytes"`
	Logprob         *float64   `json:"logprob,omitempty"`
	Prob            *float64   `json:"prob,omitempty"`
	TrajflowLogprob *float64   `json:"trajflow_logprob,omitempty"`
	TopLogprobs     []llamaTop `json:"top_logprobs,omitempty"`
	TopProbs        []llamaTop `json:"top_probs,omitempty"`
}

func textBytes(s string) []int {
	b := make([]int, len(s))
	for i := 0; i < len(s); i++ {
		b[i] = int(s[i])
	}
	return b
}

func ptr(f float64) *float64 { return &f }

func (s *Server) llamaCompletion(w http.ResponseWriter, r *http.Request) {
	if a := r.URL.Query().Get("autoload"); a == "true" || a == "1" {
		writeError(w, http.StatusBadRequest, "completion: autoload: this server loads models only through POST /models/load")
		return
	}
	var q llamaCompletionReq
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "completion: %v", err)
		return
	}
	prompt, err := parseIDs(q.Prompt, "prompt", s.c.cfg.MaxPromptTokens)
	if err != nil {
		writeError(w, http.StatusBadRequest, "completion: %v", err)
		return
	}
	st, seed, err := s.c.llamaSettings(&q)
	if err == nil {
		err = s.c.checkMaxTokens("n_predict", st.MaxTokens)
	}
	if err == nil && (q.NProbs < 0 || q.NProbs > maxLogprobs) {
		// llama-server takes any n_probs up to its vocabulary, an answer
		// of n_probs × n_predict entries; this server bounds it as its
		// OpenAI endpoints bound logprobs.
		err = fmt.Errorf("n_probs %d not in [0, %d] (this server's max_logprobs)", q.NProbs, maxLogprobs)
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, "completion: %v", err)
		return
	}
	l, err := s.c.llamaModel(q.Model)
	if err != nil {
		writeError(w, http.StatusBadRequest, "completion: %v", err)
		return
	}
	ctx, leave, ok := s.c.admit(w, r, "completion")
	if !ok {
		return
	}
	defer leave() // a no-op once called below
	start := time.Now()
	smp, err := s.c.generate(ctx, l, prompt, st, seed, "")
	genTime := time.Since(start)
	if err != nil {
		code := http.StatusBadRequest
		if ctx.Err() != nil {
			code = http.StatusInternalServerError
		}
		leave()
		writeError(w, code, "completion: %v", err)
		return
	}
	n := min(q.NProbs, l.m.Config.Vocab)
	var probs []llamaProb
	if q.NProbs > 0 {
		rawLP, rawTop, postTop, err := s.c.details(ctx, l, prompt, st, smp, n)
		if err != nil {
			leave()
			writeError(w, http.StatusInternalServerError, "completion: %v", err)
			return
		}
		for k, tok := range smp.Tokens {
			e := llamaProb{ID: tok, Token: tokenText(tok), Bytes: textBytes(tokenText(tok))}
			if q.PostSamplingProbs {
				e.Prob = ptr(math.Exp(float64(smp.Logprobs[k])))
				e.TrajflowLogprob = ptr(float64(smp.Logprobs[k]))
				for _, tp := range postTop[k] {
					e.TopProbs = append(e.TopProbs, llamaTop{ID: tp.id, Token: tokenText(tp.id), Bytes: textBytes(tokenText(tp.id)), Prob: ptr(tp.p)})
				}
			} else {
				e.Logprob = ptr(float64(rawLP[k]))
				for _, tp := range rawTop[k] {
					e.TopLogprobs = append(e.TopLogprobs, llamaTop{ID: tp.id, Token: tokenText(tp.id), Bytes: textBytes(tokenText(tp.id)), Logprob: ptr(tp.p)})
				}
			}
			probs = append(probs, e)
		}
	}
	words := make([]string, len(smp.Tokens))
	for i, t := range smp.Tokens {
		words[i] = tokenText(t)
	}
	stopType := "limit"
	if smp.Finish == model.FinishStop {
		stopType = "eos"
	}
	resp := map[string]any{
		"index": 0, "content": strings.Join(words, " "), "id_slot": 0, "stop": true, "model": l.name,
		"tokens_predicted": len(smp.Tokens), "tokens_evaluated": len(prompt), "tokens_cached": 0,
		"truncated": false, "stop_type": stopType, "stopping_word": "", "has_new_line": false,
		"generation_settings": map[string]any{
			"n_predict": st.MaxTokens, "seed": seed, "temperature": st.Temperature, "top_k": st.TopK, "top_p": st.TopP,
			"min_p": 0, "samplers": q.Samplers, "grammar": policy.GrammarID(model.Settings{Behavior: model.Behavior{Grammar: s.c.cfg.Grammar}}),
			"post_sampling_probs": q.PostSamplingProbs, "n_probs": q.NProbs,
		},
	}
	// As llama-server: "tokens" is always there, the ids only with
	// return_tokens; "timings" is always there (the whole generation is
	// counted as predicted: the built-in policy has no separate prompt
	// pass).
	resp["tokens"] = []int32{}
	if q.ReturnTokens {
		resp["tokens"] = smp.Tokens
	}
	resp["timings"] = llamaTimings(len(prompt), len(smp.Tokens), genTime)
	if q.NProbs > 0 {
		resp["completion_probabilities"] = probs
	}
	leave()
	writeJSON(w, http.StatusOK, resp)
}

// llamaTimings is llama-server's "timings" object of a completion that
// evaluated nPrompt ids and generated nPredicted in d.
func llamaTimings(nPrompt, nPredicted int, d time.Duration) map[string]any {
	ms := float64(d.Nanoseconds()) / 1e6
	perToken, perSecond := 0.0, 0.0
	if nPredicted > 0 && ms > 0 {
		perToken, perSecond = ms/float64(nPredicted), 1e3*float64(nPredicted)/ms
	}
	return map[string]any{
		"cache_n": 0, "prompt_n": nPrompt, "prompt_ms": 0.0, "prompt_per_token_ms": 0.0, "prompt_per_second": 0.0,
		"predicted_n": nPredicted, "predicted_ms": ms, "predicted_per_token_ms": perToken, "predicted_per_second": perSecond,
	}
}

func (s *Server) vocab() int {
	if l := s.anyLoaded(); l != nil {
		return l.m.Config.Vocab
	}
	return rollout.VocabSize
}

// anyLoaded is a loaded version (the current one, or for llama.cpp the
// newest loaded model), nil if none.
func (s *Server) anyLoaded() *loaded {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.current != nil {
		return c.current
	}
	var best *loaded
	for _, l := range c.models {
		if best == nil || l.version > best.version {
			best = l
		}
	}
	return best
}

func (s *Server) llamaTokenize(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Model        string `json:"model"` // accepted for router clients: every model shares the vocabulary
		Content      string `json:"content"`
		AddSpecial   bool   `json:"add_special"`
		ParseSpecial *bool  `json:"parse_special"`
		WithPieces   bool   `json:"with_pieces"`
	}
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "tokenize: %v", err)
		return
	}
	if q.ParseSpecial != nil && !*q.ParseSpecial {
		writeError(w, http.StatusBadRequest, "tokenize: parse_special false is not served: every word of the built-in vocabulary is special")
		return
	}
	ids, err := tokenize(q.Content, s.vocab())
	if err != nil {
		writeError(w, http.StatusBadRequest, "tokenize: %v", err)
		return
	}
	if q.AddSpecial {
		ids = append([]int32{rollout.TokBOS}, ids...)
	}
	if q.WithPieces {
		type piece struct {
			ID    int32  `json:"id"`
			Piece string `json:"piece"`
		}
		ps := make([]piece, len(ids))
		for i, id := range ids {
			ps[i] = piece{id, tokenText(id)}
		}
		writeJSON(w, http.StatusOK, map[string]any{"tokens": ps})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"tokens": ids})
}

func (s *Server) llamaDetokenize(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Model  string  `json:"model"` // as for /tokenize
		Tokens []int64 `json:"tokens"`
	}
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "detokenize: %v", err)
		return
	}
	text, err := detokenize(q.Tokens, s.vocab(), s.c.cfg.MaxPromptTokens)
	if err != nil {
		writeError(w, http.StatusBadRequest, "detokenize: %v", err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"content": text})
}

func (s *Server) llamaApplyTemplate(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Model               string                `json:"model"` // as for /tokenize
		Messages            []rollout.ChatMessage `json:"messages"`
		AddGenerationPrompt *bool                 `json:"add_generation_prompt"`
	}
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "apply-template: %v", err)
		return
	}
	add := q.AddGenerationPrompt == nil || *q.AddGenerationPrompt
	writeJSON(w, http.StatusOK, map[string]any{"prompt": applyTemplate(q.Messages, add)})
}

func (s *Server) llamaProps(w http.ResponseWriter, r *http.Request) {
	l := s.anyLoaded()
	path := ""
	if l != nil {
		path = l.manifest
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"build_info": Software, "model_path": path, "chat_template": chatTemplate, "total_slots": 1,
		"n_vocab": s.vocab(), "tokenizer_hash": rollout.TokenizerHash, "grammar": s.grammarID(), "trajflow_seed": true,
		"max_tokens":                  s.c.cfg.MaxTokens,
		"default_generation_settings": map[string]any{"n_ctx": s.c.contextLen()},
	})
}

func (s *Server) grammarID() string {
	if s.c.cfg.Grammar == nil {
		return ""
	}
	return s.c.cfg.Grammar.ID()
}

func (s *Server) llamaModels(w http.ResponseWriter, r *http.Request) {
	vs, err := s.c.available()
	if err != nil {
		writeError(w, http.StatusInternalServerError, "models: %v", err)
		return
	}
	s.c.mu.Lock()
	// llama-server's router entry, with the fields OpenAI clients
	// require of a model (id, object, created, owned_by).
	type entry struct {
		ID      string         `json:"id"`
		Object  string         `json:"object"`
		Created int64          `json:"created"`
		OwnedBy string         `json:"owned_by"`
		Path    string         `json:"path"`
		Status  map[string]any `json:"status"`
		Meta    map[string]any `json:"meta,omitempty"`
	}
	data := []entry{}
	now := time.Now().Unix()
	for _, v := range vs {
		name := policy.ModelName(v)
		e := entry{ID: name, Object: "model", Created: now, OwnedBy: "trajflow", Path: s.c.manifestPath(v), Status: map[string]any{"value": "unloaded"}}
		if l, ok := s.c.models[name]; ok {
			e.Status["value"] = "loaded"
			e.Meta = map[string]any{"n_vocab": l.m.Config.Vocab, "checkpoint_hash": l.rel.CheckpointHash}
		}
		data = append(data, e)
	}
	s.c.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

func (s *Server) llamaLoad(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Model string `json:"model"`
	}
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "models/load: %v", err)
		return
	}
	v, err := policy.ParseModelName(q.Model)
	if err != nil {
		writeError(w, http.StatusBadRequest, "models/load: %v", err)
		return
	}
	if err := s.LoadModel(v); err != nil {
		writeError(w, http.StatusBadRequest, "models/load: %v", err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"success": true})
}

func (s *Server) llamaUnload(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Model string `json:"model"`
	}
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "models/unload: %v", err)
		return
	}
	s.c.mu.Lock()
	_, ok := s.c.models[q.Model]
	delete(s.c.models, q.Model)
	s.c.mu.Unlock()
	if !ok {
		writeError(w, http.StatusBadRequest, "models/unload: model %q is not loaded", q.Model)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"success": true})
}
