package serve

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// The SGLang protocol (native API):
//
//	POST /generate {input_ids, sampling_params, return_logprob, logprob_start_len, rid}
//	     → output_ids, meta_info {id, finish_reason, weight_version, output_token_logprobs}
//	POST /v1/completions (OpenAI's; completions.go); GET /v1/models
//	POST /update_weights_from_disk {model_path, weight_version, abort_all_requests}
//	POST /pause_generation {mode}, /continue_generation
//	GET  /get_model_info, /get_server_info, /get_weight_version, /health, /health_generate
//	POST /tokenize {prompt}, /detokenize {tokens}, /flush_cache
//
// model_path is a manifest or checkpoint file of the releases directory
// (or a policy-vNNNNNNNN name); weight_version, when given, must be that
// release's version in decimal: the served version is always the release's
// own. sampling_params fields absent take SGLang's defaults (temperature
// 1, top_p 1, top_k all, min_p 0, no penalties, max_new_tokens 128);
// sampling_seed is required. Settings the built-in policy cannot apply
// (min_p, penalties, stop strings, regex/json_schema/ebnf, logit_bias, n >
// 1, min_new_tokens) are refused with 400. Log-probs are of the sampling
// distribution (temperature, grammar, top-k, top-p), float32 values.
func (s *Server) sglangRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /generate", s.sglangGenerate)
	mux.HandleFunc("POST /v1/completions", s.sglangCompletions)
	mux.HandleFunc("GET /v1/models", s.currentModelList)
	mux.HandleFunc("POST /update_weights_from_disk", s.sglangUpdate)
	mux.HandleFunc("POST /pause_generation", s.sglangPause)
	mux.HandleFunc("POST /continue_generation", func(w http.ResponseWriter, r *http.Request) {
		s.c.gate.resume()
		writeJSON(w, http.StatusOK, map[string]any{"message": "Generation continued successfully.", "status": "ok"})
	})
	mux.HandleFunc("GET /get_model_info", s.sglangModelInfo)
	mux.HandleFunc("GET /get_server_info", s.sglangServerInfo)
	mux.HandleFunc("GET /get_weight_version", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"weight_version": s.weightVersion()})
	})
	health := func(w http.ResponseWriter, r *http.Request) {
		if s.c.getCurrent() == nil {
			writeError(w, http.StatusServiceUnavailable, "no weights loaded")
			return
		}
		w.WriteHeader(http.StatusOK)
	}
	mux.HandleFunc("GET /health", health)
	mux.HandleFunc("GET /health_generate", health)
	mux.HandleFunc("POST /tokenize", s.sglangTokenize)
	mux.HandleFunc("POST /detokenize", s.sglangDetokenize)
	mux.HandleFunc("POST /flush_cache", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.Write([]byte("Cache flushed.\nThe built-in policy keeps no prefix cache.\n"))
	})
}

// weightVersion is the served weight_version ("default" before any load,
// as SGLang reports it).
func (s *Server) weightVersion() string {
	if l := s.c.getCurrent(); l != nil {
		return policy.WeightVersion(l.version)
	}
	return "default"
}

type sglangSampling struct {
	MaxNewTokens               *int            `json:"max_new_tokens"`
	Stop                       json.RawMessage `json:"stop"`
	StopTokenIDs               []int64         `json:"stop_token_ids"`
	Temperature                *float64        `json:"temperature"`
	TopP                       *float64        `json:"top_p"`
	TopK                       *int            `json:"top_k"`
	MinP                       *float64        `json:"min_p"`
	FrequencyPenalty           *float64        `json:"frequency_penalty"`
	PresencePenalty            *float64        `json:"presence_penalty"`
	RepetitionPenalty          *float64        `json:"repetition_penalty"`
	MinNewTokens               *int            `json:"min_new_tokens"`
	N                          *int            `json:"n"`
	IgnoreEOS                  *bool           `json:"ignore_eos"`
	SkipSpecialTokens          *bool           `json:"skip_special_tokens"`
	SpacesBetweenSpecialTokens *bool           `json:"spaces_between_special_tokens"`
	NoStopTrim                 *bool           `json:"no_stop_trim"`
	JSONSchema                 *string         `json:"json_schema"`
	Regex                      *string         `json:"regex"`
	EBNF                       *string         `json:"ebnf"`
	LogitBias                  json.RawMessage `json:"logit_bias"`
	SamplingSeed               *uint64         `json:"sampling_seed"`
}

type sglangGenerateReq struct {
	InputIDs             json.RawMessage `json:"input_ids"`
	Text                 json.RawMessage `json:"text"`
	SamplingParams       sglangSampling  `json:"sampling_params"`
	ReturnLogprob        bool            `json:"return_logprob"`
	LogprobStartLen      *int            `json:"logprob_start_len"`
	TopLogprobsNum       int             `json:"top_logprobs_num"`
	ReturnTextInLogprobs bool            `json:"return_text_in_logprobs"`
	Rid                  string          `json:"rid"`
	Stream               bool            `json:"stream"`
}

func emptyJSON(b json.RawMessage) bool {
	switch strings.TrimSpace(string(b)) {
	case "", "null", "[]", "{}", `""`:
		return true
	}
	return false
}

// newRequestID is a random request id: 32 hex digits, as SGLang's
// uuid.uuid4().hex.
func newRequestID() string {
	var b [16]byte
	rand.Read(b[:]) // never fails (crypto/rand)
	b[6], b[8] = b[6]&0x0f|0x40, b[8]&0x3f|0x80
	return hex.EncodeToString(b[:])
}

// sglangSettings maps sampling_params to the built-in settings; at
// prefixes the fields named in errors ("sampling_params." on the native
// endpoint).
func sglangSettings(p *sglangSampling, vocab int, at string) (model.Settings, uint64, error) {
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
		{"min_p", f(p.MinP, 0), 0}, {"frequency_penalty", f(p.FrequencyPenalty, 0), 0},
		{"presence_penalty", f(p.PresencePenalty, 0), 0}, {"repetition_penalty", f(p.RepetitionPenalty, 1), 1},
	} {
		if n.got != n.want {
			return model.Settings{}, 0, fmt.Errorf("%s%s %v is not applied by the built-in policy; send %v", at, n.name, n.got, n.want)
		}
	}
	switch {
	case !emptyJSON(p.Stop):
		return model.Settings{}, 0, fmt.Errorf("%sstop strings are not served; send stop_token_ids", at)
	case p.JSONSchema != nil || p.Regex != nil || p.EBNF != nil:
		return model.Settings{}, 0, fmt.Errorf("%sjson_schema, regex and ebnf are not served; the server applies its task grammar", at)
	case !emptyJSON(p.LogitBias):
		return model.Settings{}, 0, fmt.Errorf("%slogit_bias is not applied by the built-in policy", at)
	case p.N != nil && *p.N != 1:
		return model.Settings{}, 0, fmt.Errorf("%sn %d: one sample per request", at, *p.N)
	case p.MinNewTokens != nil && *p.MinNewTokens != 0:
		return model.Settings{}, 0, fmt.Errorf("%smin_new_tokens %d is not applied by the built-in policy", at, *p.MinNewTokens)
	case p.SamplingSeed == nil:
		return model.Settings{}, 0, fmt.Errorf("%ssampling_seed is required (samples must be reproducible)", at)
	}
	maxNew := 128
	if p.MaxNewTokens != nil {
		maxNew = *p.MaxNewTokens
	}
	temp, topP, topK := f(p.Temperature, 1), f(p.TopP, 1), -1
	if p.TopK != nil {
		topK = *p.TopK
	}
	switch {
	case !(temp >= 0):
		return model.Settings{}, 0, fmt.Errorf("%stemperature %v must be non-negative", at, temp)
	case temp < 1e-6: // SGLang: greedy is top_k 1 at temperature 1
		temp, topK = 1, 1
	}
	switch {
	case topK == -1 || topK >= 1<<30:
		topK = 0
	case topK < 1:
		return model.Settings{}, 0, fmt.Errorf("%stop_k %d must be -1 (all) or at least 1", at, topK)
	}
	if !(topP > 0 && topP <= 1) {
		return model.Settings{}, 0, fmt.Errorf("%stop_p %v not in (0, 1]", at, topP)
	}
	st := model.Settings{Behavior: model.Behavior{Temperature: temp, TopK: topK, TopP: topP}, MaxTokens: maxNew}
	for i, id := range p.StopTokenIDs {
		if id < 0 || id >= int64(vocab) {
			return model.Settings{}, 0, fmt.Errorf("%sstop_token_ids[%d] = %d, vocabulary %d", at, i, id, vocab)
		}
		st.Stop = append(st.Stop, int32(id))
	}
	if err := st.Validate(); err != nil {
		return model.Settings{}, 0, settingsErr(at, err)
	}
	return st, *p.SamplingSeed, nil
}

func (s *Server) sglangGenerate(w http.ResponseWriter, r *http.Request) {
	t0 := time.Now()
	var q sglangGenerateReq
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "generate: %v", err)
		return
	}
	if !emptyJSON(q.Text) {
		writeError(w, http.StatusBadRequest, "generate: text prompts are not served; send input_ids")
		return
	}
	if q.Stream {
		writeError(w, http.StatusBadRequest, "generate: stream is not served")
		return
	}
	if q.TopLogprobsNum != 0 || (q.LogprobStartLen != nil && *q.LogprobStartLen != -1 && q.ReturnLogprob) {
		writeError(w, http.StatusBadRequest, "generate: only the sampled ids' log-probs are served (top_logprobs_num 0, logprob_start_len -1)")
		return
	}
	prompt, err := parseIDs(q.InputIDs, "input_ids", s.c.cfg.MaxPromptTokens)
	if err != nil {
		writeError(w, http.StatusBadRequest, "generate: %v", err)
		return
	}
	l := s.c.getCurrent()
	if l == nil {
		writeError(w, http.StatusServiceUnavailable, "generate: no weights loaded")
		return
	}
	st, seed, err := sglangSettings(&q.SamplingParams, l.m.Config.Vocab, "sampling_params.")
	if err == nil {
		err = s.c.checkMaxTokens("sampling_params.max_new_tokens", st.MaxTokens)
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, "generate: %v", err)
		return
	}
	ctx, leave, ok := s.c.admit(w, r, "generate")
	if !ok {
		return
	}
	l = s.c.getCurrent() // the version current once the gate opened
	smp, err := s.c.generate(ctx, l, prompt, st, seed, q.Rid)
	abort := aborted(ctx)
	leave()
	rid := q.Rid
	if rid == "" { // SGLang names a request without rid: a uuid4 in hex
		rid = newRequestID()
	}
	meta := map[string]any{
		"id": rid, "prompt_tokens": len(prompt), "cached_tokens": 0, "weight_version": policy.WeightVersion(l.version),
	}
	if err != nil || abort {
		if abort { // the work of an aborted request is discarded
			meta["finish_reason"] = map[string]any{"type": "abort", "message": "aborted by pause_generation"}
			meta["completion_tokens"] = 0
			writeJSON(w, http.StatusOK, map[string]any{"text": "", "output_ids": []int32{}, "meta_info": meta})
			return
		}
		writeError(w, http.StatusBadRequest, "generate: %v", err)
		return
	}
	words := make([]string, len(smp.Tokens))
	for i, t := range smp.Tokens {
		words[i] = tokenText(t)
	}
	if smp.Finish == model.FinishStop {
		meta["finish_reason"] = map[string]any{"type": "stop", "matched": smp.Tokens[len(smp.Tokens)-1]}
	} else {
		meta["finish_reason"] = map[string]any{"type": "length", "length": len(smp.Tokens)}
	}
	meta["completion_tokens"] = len(smp.Tokens)
	if q.ReturnLogprob {
		lps := make([][3]any, len(smp.Tokens))
		for i, t := range smp.Tokens {
			var text any
			if q.ReturnTextInLogprobs {
				text = tokenText(t)
			}
			lps[i] = [3]any{float64(smp.Logprobs[i]), t, text}
		}
		meta["output_token_logprobs"] = lps
		meta["input_token_logprobs"] = [][3]any{}
	}
	meta["e2e_latency"] = time.Since(t0).Seconds()
	writeJSON(w, http.StatusOK, map[string]any{"text": strings.Join(words, " "), "output_ids": smp.Tokens, "meta_info": meta})
}

func (s *Server) sglangUpdate(w http.ResponseWriter, r *http.Request) {
	var q struct {
		ModelPath        string  `json:"model_path"`
		LoadFormat       *string `json:"load_format"`
		WeightVersion    *string `json:"weight_version"`
		AbortAllRequests bool    `json:"abort_all_requests"`
		FlushCache       *bool   `json:"flush_cache"`
	}
	fail := func(code int, format string, args ...any) {
		writeJSON(w, code, map[string]any{"success": false, "message": fmt.Sprintf(format, args...), "num_paused_requests": 0})
	}
	if err := decodeStrict(w, r, &q); err != nil {
		fail(http.StatusBadRequest, "update_weights_from_disk: %v", err)
		return
	}
	if q.LoadFormat != nil && *q.LoadFormat != "" && *q.LoadFormat != "auto" && *q.LoadFormat != "trajflow" {
		fail(http.StatusBadRequest, "update_weights_from_disk: load_format %q (the built-in policy loads trajflow releases)", *q.LoadFormat)
		return
	}
	v, err := s.c.versionOfPath(q.ModelPath)
	if err != nil {
		fail(http.StatusBadRequest, "update_weights_from_disk: %v", err)
		return
	}
	if q.WeightVersion != nil && *q.WeightVersion != policy.WeightVersion(v) {
		fail(http.StatusBadRequest, "update_weights_from_disk: weight_version %q, but %s is release %d (the served version is the release's own)", *q.WeightVersion, q.ModelPath, v)
		return
	}
	l, err := s.c.load(v)
	if err != nil {
		fail(http.StatusBadRequest, "update_weights_from_disk: %v", err)
		return
	}
	if q.AbortAllRequests {
		wasPaused := s.c.gate.isPaused()
		if err := s.c.gate.pause(r.Context(), "abort"); err != nil { // a pause it set is undone
			fail(http.StatusInternalServerError, "update_weights_from_disk: abort requests: %v", err)
			return
		}
		s.c.setCurrent(l)
		if !wasPaused {
			s.c.gate.resume()
		}
	} else {
		s.c.setCurrent(l)
	}
	writeJSON(w, http.StatusOK, map[string]any{"success": true, "num_paused_requests": 0,
		"message": fmt.Sprintf("Succeeded to update model weights. Weight version updated to %s.", policy.WeightVersion(v))})
}

func (s *Server) sglangPause(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Mode *string `json:"mode"`
	}
	if err := decodeStrict(w, r, &q); err != nil {
		writeError(w, http.StatusBadRequest, "pause_generation: %v", err)
		return
	}
	mode := "abort"
	if q.Mode != nil {
		mode = *q.Mode
	}
	if mode != "abort" && mode != "in_place" && mode != "retract" {
		writeError(w, http.StatusBadRequest, "pause_generation: mode %q (want abort, in_place or retract)", mode)
		return
	}
	if err := s.c.gate.pause(r.Context(), mode); err != nil {
		writeError(w, http.StatusInternalServerError, "pause_generation: %v", err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"message": "Generation paused successfully.", "status": "ok"})
}

func (s *Server) sglangModelInfo(w http.ResponseWriter, r *http.Request) {
	path := ""
	if l := s.c.getCurrent(); l != nil {
		path = l.manifest
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"model_path": path, "tokenizer_path": "", "is_generation": true,
		"preferred_sampling_params": nil, "weight_version": s.weightVersion(),
	})
}

func (s *Server) sglangServerInfo(w http.ResponseWriter, r *http.Request) {
	info := map[string]any{
		"version": Software, "weight_version": s.weightVersion(), "vocab_size": s.vocab(),
		"tokenizer_hash": rollout.TokenizerHash, "chat_template_hash": chatTemplateHash, "grammar": s.grammarID(),
		"skip_tokenizer_init": false, "enable_deterministic_inference": true, "max_tokens": s.c.cfg.MaxTokens,
	}
	if l := s.c.getCurrent(); l != nil {
		info["model_path"] = l.manifest
		info["checkpoint_hash"] = l.rel.CheckpointHash
	}
	writeJSON(w, http.StatusOK, info)
}

func (s *Server) sglangTokenize(w http.ResponseWriter, r *http.Request) {
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
	writeJSON(w, http.StatusOK, map[string]any{"tokens": ids, "count": len(ids), "max_model_len": s.c.contextLen()})
}

func (s *Server) sglangDetokenize(w http.ResponseWriter, r *http.Request) {
	var q struct {
		Model             string  `json:"model"`
		Tokens            []int64 `json:"tokens"`
		SkipSpecialTokens *bool   `json:"skip_special_tokens"` // the built-in vocabulary declares no special tokens: nothing to skip
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
	writeJSON(w, http.StatusOK, map[string]any{"text": text})
}
