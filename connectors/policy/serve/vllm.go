package serve

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// The vLLM protocol (token-in/token-out, with the RL control endpoints of
// VLLM_SERVER_DEV_MODE):
//
//	POST /inference/v1/generate {request_id, token_ids, sampling_params}
//	     → choices[0] {token_ids, logprobs.content[i].logprob, finish_reason}
//	POST /v1/completions (OpenAI's; completions.go)
//	POST /pause?mode=abort|wait|keep, /resume; GET /is_paused
//	POST /start_weight_update, /update_weights {update_info: {model_path}},
//	     /finish_weight_update {weight_version}
//	GET  /weight_info; POST /weight_checker {action: checksum|compare}
//	GET  /health, /version, /v1/models, /server_info
//	POST /tokenize {prompt}, /detokenize {tokens}
//
// /update_weights loads the release at update_info.model_path (a manifest
// or checkpoint of the releases directory) into a shadow slot, verified;
// /finish_weight_update switches new requests to it, and its
// weight_version must be the release's version in decimal. The weight
// checker's checksum is {"checkpoint": sha256 of the checkpoint file}.
// Log-probs are those of the sampling distribution (vLLM's
// processed_logprobs: after temperature, grammar, top-k and top-p), as
// /server_info says. sampling_params fields absent take vLLM's defaults
// (max_tokens 16, temperature 1, no truncation); seed is required;
// settings the built-in policy cannot apply are refused with 400.
func (s *Server) vllmRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /inference/v1/generate", s.vllmGenerate)
	mux.HandleFunc("POST /v1/completions", s.vllmCompletions)
	mux.HandleFunc("POST /pause", func(w http.ResponseWriter, r *http.Request) {
		mode := r.URL.Query().Get("mode")
		if mode == "" {
			mode = "abort"
		}
		if mode != "abort" && mode != "wait" && mode != "keep" {
			writeJSON(w, http.StatusBadRequest, map[string]any{"error": fmt.Sprintf("mode %q (want abort, wait or keep)", mode)})
			return
		}
		if err := s.c.gate.pause(r.Context(), mode); err != nil {
			writeJSON(w, http.StatusInternalServerError, map[string]any{"error": err.Error()})
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"status": "paused"})
	})
	mux.HandleFunc("POST /resume", func(w http.ResponseWriter, r *http.Request) {
		s.c.gate.resume()
		writeJSON(w, http.StatusOK, map[string]any{"status": "resumed"})
	})
	mux.HandleFunc("GET /is_paused", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"is_paused": s.c.gate.isPaused()})
	})
	mux.HandleFunc("POST /start_weight_update", func(w http.ResponseWriter, r *http.Request) {
		s.c.mu.Lock()
		s.c.shadow = nil // a new update starts from an empty shadow slot
		s.c.mu.Unlock()
		writeJSON(w, http.StatusOK, map[string]any{"message": "Weight update started"})
	})
	mux.HandleFunc("POST /update_weights", s.vllmUpdate)
	mux.HandleFunc("POST /finish_weight_update", s.vllmFinish)
	mux.HandleFunc("GET /weight_info", func(w http.ResponseWriter, r *http.Request) {
		var v any
		if l := s.c.getCurrent(); l != nil {
			v = policy.WeightVersion(l.version)
		}
		writeJSON(w, http.StatusOK, map[string]any{"weight_version": v})
	})
	mux.HandleFunc("POST /weight_checker", s.vllmChecker)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		if s.c.getCurrent() == nil {
			writeError(w, http.StatusServiceUnavailable, "no weights loaded")
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("GET /version", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"version": Software})
	})
	mux.HandleFunc("GET /v1/models", s.currentModelList)
	mux.HandleFunc("GET /server_info", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{
			"version": Software, "logprobs_mode": "processed_logprobs", "vocab_size": s.vocab(),
			"tokenizer_hash": rollout.TokenizerHash, "chat_template_hash": chatTemplateHash, "grammar": s.grammarID(),
			"max_tokens": s.c.cfg.MaxTokens,
		})
	})
	mux.HandleFunc("POST /tokenize", func(w http.ResponseWriter, r *http.Request) {
		var q struct {
			Model            string `json:"model"`
			Prompt           string `json:"prompt"`
			AddSpecialTokens *bool  `json:"add_special_tokens"`
		}
		if err := decodeStrict(w, r, &q); err != nil {
			writeError(w, http.StatusBadRequest, "tokenize: %v", err)
			return
		}
		ids, err := tokenize(q.Prompt, s.vocab())
		if err != nil {
			writeError(w, http.StatusBadRequest, "tokenize: %v", err)
			return
		}
		if q.AddSpecialTokens == nil || *q.AddSpecialTokens {
			ids = append([]int32{rollout.TokBOS}, ids...)
		}
		writeJSON(w, http.StatusOK, map[string]any{"count": len(ids), "max_model_len": s.c.contextLen(), "tokens": ids, "token_strs": nil})
	})
	mux.HandleFunc("POST /detokenize", func(w http.ResponseWriter, r *http.Request) {
		var q struct {
			Model  string  `json:"model"`
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
		writeJSON(w, http.StatusOK, map[string]any{"prompt": text})
	})
}

// currentModelList answers GET /v1/models (vLLM, SGLang) with the current
// version.
func (s *Server) currentModelList(w http.ResponseWriter, r *http.Request) {
	data := []map[string]any{}
	if l := s.c.getCurrent(); l != nil {
		// vLLM's ModelCard (SGLang's has its fields): OpenAI clients
		// require id, object, created and owned_by; vLLM's read
		// max_model_len.
		data = append(data, map[string]any{"id": l.name, "object": "model", "created": time.Now().Unix(), "owned_by": "trajflow",
			"root": l.manifest, "parent": nil, "max_model_len": s.c.contextLen(), "permission": []any{}})
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

type vllmSampling struct {
	N                      *int            `json:"n"`
	MaxTokens              *int            `json:"max_tokens"`
	Temperature            *float64        `json:"temperature"`
	TopP                   *float64        `json:"top_p"`
	TopK                   *int            `json:"top_k"`
	MinP                   *float64        `json:"min_p"`
	PresencePenalty        *float64        `json:"presence_penalty"`
	FrequencyPenalty       *float64        `json:"frequency_penalty"`
	RepetitionPenalty      *float64        `json:"repetition_penalty"`
	Seed                   *uint64         `json:"seed"`
	Stop                   json.RawMessage `json:"stop"`
	StopTokenIDs           []int64         `json:"stop_token_ids"`
	IgnoreEOS              *bool           `json:"ignore_eos"`
	Logprobs               *int            `json:"logprobs"`
	PromptLogprobs         *int            `json:"prompt_logprobs"`
	MinTokens              *int            `json:"min_tokens"`
	SkipSpecialTokens      *bool           `json:"skip_special_tokens"`
	Detokenize             *bool           `json:"detokenize"`
	IncludeStopStrInOutput *bool           `json:"include_stop_str_in_output"`
	LogitBias              json.RawMessage `json:"logit_bias"`
}

// vllmSettings maps sampling_params to the built-in settings; at prefixes
// the fields named in errors ("sampling_params." on the native endpoint).
func vllmSettings(p *vllmSampling, vocab int, at string) (model.Settings, uint64, error) {
	f := func(v *float64, def float64) float64 {
		if v == nil {
			return def
		}
		return *v
	}
	for _, n := range []struct {
		name      string
		got, want float64
	}{
		{"min_p", f(p.MinP, 0), 0}, {"presence_penalty", f(p.PresencePenalty, 0), 0},
		{"frequency_penalty", f(p.FrequencyPenalty, 0), 0}, {"repetition_penalty", f(p.RepetitionPenalty, 1), 1},
	} {
		if n.got != n.want {
			return model.Settings{}, 0, fmt.Errorf("%s%s %v is not applied by the built-in policy; send %v", at, n.name, n.got, n.want)
		}
	}
	switch {
	case p.N != nil && *p.N != 1:
		return model.Settings{}, 0, fmt.Errorf("%sn %d: one sample per request", at, *p.N)
	case !emptyJSON(p.Stop):
		return model.Settings{}, 0, fmt.Errorf("%sstop strings are not served; send stop_token_ids", at)
	case !emptyJSON(p.LogitBias):
		return model.Settings{}, 0, fmt.Errorf("%slogit_bias is not applied by the built-in policy", at)
	case p.MinTokens != nil && *p.MinTokens != 0:
		return model.Settings{}, 0, fmt.Errorf("%smin_tokens %d is not applied by the built-in policy", at, *p.MinTokens)
	case p.PromptLogprobs != nil:
		return model.Settings{}, 0, fmt.Errorf("%sprompt_logprobs is not served", at)
	case p.Logprobs != nil && *p.Logprobs != 0:
		return model.Settings{}, 0, fmt.Errorf("%slogprobs %d: only the sampled ids' log-probs are served (send 0)", at, *p.Logprobs)
	case p.Seed == nil:
		return model.Settings{}, 0, fmt.Errorf("%sseed is required (samples must be reproducible)", at)
	}
	maxTok := 16
	if p.MaxTokens != nil {
		maxTok = *p.MaxTokens
	}
	temp, topP, topK := f(p.Temperature, 1), f(p.TopP, 1), 0
	if p.TopK != nil {
		topK = *p.TopK
	}
	switch {
	case !(temp >= 0):
		return model.Settings{}, 0, fmt.Errorf("%stemperature %v must be non-negative", at, temp)
	case temp < 1e-5: // vLLM: greedy
		temp, topK, topP = 1, 1, 1
	}
	switch {
	case topK == -1 || topK == 0:
		topK = 0
	case topK < 0:
		return model.Settings{}, 0, fmt.Errorf("%stop_k %d must be -1 or 0 (all) or at least 1", at, topK)
	}
	if !(topP > 0 && topP <= 1) {
		return model.Settings{}, 0, fmt.Errorf("%stop_p %v not in (0, 1]", at, topP)
	}
	st := model.Settings{Behavior: model.Behavior{Temperature: temp, TopK: topK, TopP: topP}, MaxTokens: maxTok}
	for i, id := range p.StopTokenIDs {
		if id < 0 || id >= int64(vocab) {
			return model.Settings{}, 0, fmt.Errorf("%sstop_token_ids[%d] = %d, vocabulary %d", at, i, id, vocab)
		}
		st.Stop = append(st.Stop, int32(id))
	}
	if err := st.Validate(); err != nil {
		return model.Settings{}, 0, settingsErr(at, err)
	}
	return st, *p.Seed, nil
}

func (s *Server) vllmGenerate(w http.ResponseWriter, r *http.Request) {
	var q struct {
		RequestID      string          `json:"request_id"`
		TokenIDs       json.RawMessage `json:"token_ids"`
		SamplingParams vllmSampling    `json:"sampling_params"`
		Model          *string         `json:"model"`
		Stream         bool            `json:"stream"`
		CacheSalt      *string         `json:"cache_salt"`
		Priority       int             `json:"priority"`
	}
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "generate: %v", err)
		return
	}
	if q.Stream {
		writeError(w, http.StatusBadRequest, "generate: stream is not served")
		return
	}
	if q.Priority != 0 {
		writeError(w, http.StatusBadRequest, "generate: priority %d: the server does not schedule by priority", q.Priority)
		return
	}
	prompt, err := parseIDs(q.TokenIDs, "token_ids", s.c.cfg.MaxPromptTokens)
	if err != nil {
		writeError(w, http.StatusBadRequest, "generate: %v", err)
		return
	}
	l := s.c.getCurrent()
	if l == nil {
		writeError(w, http.StatusServiceUnavailable, "generate: no weights loaded")
		return
	}
	if q.Model != nil && *q.Model != "" && *q.Model != l.name {
		writeError(w, http.StatusNotFound, "generate: model %q is not served (serving %s)", *q.Model, l.name)
		return
	}
	st, seed, err := vllmSettings(&q.SamplingParams, l.m.Config.Vocab, "sampling_params.")
	if err == nil {
		err = s.c.checkMaxTokens("sampling_params.max_tokens", st.MaxTokens)
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, "generate: %v", err)
		return
	}
	ctx, leave, ok := s.c.admit(w, r, "generate")
	if !ok {
		return
	}
	if now := s.c.getCurrent(); now != l {
		// The weights switched while the request waited at a pause: it
		// gets the new version only if it named none.
		l = now
		if q.Model != nil && *q.Model != "" && *q.Model != l.name {
			leave()
			writeError(w, http.StatusNotFound, "generate: model %q was replaced by %s while the request waited", *q.Model, l.name)
			return
		}
		if st, seed, err = vllmSettings(&q.SamplingParams, l.m.Config.Vocab, "sampling_params."); err != nil {
			leave()
			writeError(w, http.StatusBadRequest, "generate: %v", err)
			return
		}
	}
	smp, err := s.c.generate(ctx, l, prompt, st, seed, q.RequestID)
	abort := aborted(ctx)
	leave()
	if err != nil || abort {
		if abort { // the work of an aborted request is discarded
			writeJSON(w, http.StatusOK, map[string]any{"request_id": q.RequestID, "choices": []map[string]any{
				{"index": 0, "token_ids": []int32{}, "logprobs": nil, "finish_reason": "abort"}}})
			return
		}
		writeError(w, http.StatusBadRequest, "generate: %v", err)
		return
	}
	var logprobs any
	if q.SamplingParams.Logprobs != nil {
		content := make([]map[string]any, len(smp.Tokens))
		for i, t := range smp.Tokens {
			tok := "token_id:" + strconv.Itoa(int(t))
			lp := float64(smp.Logprobs[i])
			content[i] = map[string]any{"token": tok, "logprob": lp, "bytes": nil,
				"top_logprobs": []map[string]any{{"token": tok, "logprob": lp}}}
		}
		logprobs = map[string]any{"content": content}
	}
	finish := "length"
	if smp.Finish == model.FinishStop {
		finish = "stop"
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"request_id":      q.RequestID,
		"choices":         []map[string]any{{"index": 0, "token_ids": smp.Tokens, "logprobs": logprobs, "finish_reason": finish}},
		"prompt_logprobs": nil,
	})
}

func (s *Server) vllmUpdate(w http.ResponseWriter, r *http.Request) {
	var q struct {
		UpdateInfo *struct {
			ModelPath string `json:"model_path"`
		} `json:"update_info"`
	}
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "update_weights: %v", err)
		return
	}
	if q.UpdateInfo == nil {
		writeError(w, http.StatusBadRequest, "update_weights: missing 'update_info' in request body")
		return
	}
	v, err := s.c.versionOfPath(q.UpdateInfo.ModelPath)
	if err != nil {
		writeError(w, http.StatusBadRequest, "update_weights: %v", err)
		return
	}
	l, err := s.c.load(v)
	if err != nil {
		writeError(w, http.StatusBadRequest, "update_weights: %v", err)
		return
	}
	s.c.mu.Lock()
	s.c.shadow = l
	s.c.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"message": "Weights updated"})
}

func (s *Server) vllmFinish(w http.ResponseWriter, r *http.Request) {
	var q struct {
		WeightVersion *string `json:"weight_version"`
	}
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "finish_weight_update: %v", err)
		return
	}
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.shadow == nil {
		writeError(w, http.StatusBadRequest, "finish_weight_update: no weights were updated since the last switch")
		return
	}
	if q.WeightVersion != nil && *q.WeightVersion != policy.WeightVersion(c.shadow.version) {
		writeError(w, http.StatusBadRequest, "finish_weight_update: weight_version %q, the updated weights are release %d", *q.WeightVersion, c.shadow.version)
		return
	}
	c.current, c.shadow = c.shadow, nil
	writeJSON(w, http.StatusOK, map[string]any{"message": "Weight update finished"})
}

func (s *Server) vllmChecker(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Action   string            `json:"action"`
		Baseline map[string]string `json:"baseline"`
	}
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "weight_checker: %v", err)
		return
	}
	if s.c.gate.isPaused() {
		writeError(w, http.StatusConflict, "weight_checker requires an awake, unpaused engine")
		return
	}
	l := s.c.getCurrent()
	if l == nil {
		writeError(w, http.StatusServiceUnavailable, "weight_checker: no weights loaded")
		return
	}
	sums := map[string]string{"checkpoint": s.c.checksumOf(l.version)}
	switch q.Action {
	case "checksum":
		writeJSON(w, http.StatusOK, map[string]any{"checksums": sums})
	case "compare":
		if q.Baseline == nil {
			writeError(w, http.StatusBadRequest, "action='compare' requires a 'baseline' object")
			return
		}
		mismatches := []string{}
		for k, v := range sums {
			if q.Baseline[k] != v {
				mismatches = append(mismatches, k)
			}
		}
		for k := range q.Baseline {
			if _, ok := sums[k]; !ok {
				mismatches = append(mismatches, k)
			}
		}
		writeJSON(w, http.StatusOK, map[string]any{"match": len(mismatches) == 0, "mismatches": mismatches})
	default:
		writeError(w, http.StatusBadRequest, "weight_checker: action %q (this server offers checksum and compare; reset would corrupt a verified release)", q.Action)
	}
}

func (c *core) checksumOf(v int64) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.checksum[v]
}
