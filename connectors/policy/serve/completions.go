package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
)

// OpenAI's completions API, which each real server offers beside its
// native one, in each protocol's dialect:
//
//	POST /v1/completions {model, prompt, max_tokens, temperature, top_p, n, seed,
//	     logprobs, stop, stream, echo, best_of, suffix, user, + the protocol's fields}
//	  → {id: "cmpl-…", object: "text_completion", created, model,
//	     choices: [{index: 0, text, logprobs, finish_reason, + the protocol's fields}],
//	     usage: {prompt_tokens, completion_tokens, total_tokens}}
//
// prompt is a list of token ids, or a text, which is tokenized with the
// built-in vocabulary (vocab.go) after a <bos>, as the real servers'
// tokenizers add a model's BOS to a text prompt (vLLM: unless
// add_special_tokens is false); a list of prompts is refused (one per
// request). model, when given, must name the model served (vLLM, SGLang:
// the current version's policy-vNNNNNNNN, listed by GET /v1/models;
// llama.cpp: a loaded model, as its native completion); another is
// answered 404, as vLLM answers a model it does not serve. Fields absent
// take the dialect's defaults, and the protocol's own sampling fields are
// read with the rules of its native endpoint (the same settings, the same
// refusals, named by their field here):
//
//   - vLLM: max_tokens 16, temperature 1, top_p 1, top_k all, min_p 0;
//     top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos,
//     min_tokens, skip_special_tokens, spaces_between_special_tokens,
//     include_stop_str_in_output, return_token_ids (choices[0].token_ids
//     and prompt_token_ids), return_tokens_as_token_ids (logprobs.tokens as
//     "token_id:N"), add_special_tokens, request_id, priority (0), and
//     prompt_logprobs, detokenize (refused). choices[0] also has
//     stop_reason (the stop id that ended it, else null).
//   - SGLang: max_tokens 16, temperature 1, top_p 1, top_k -1, min_p 0;
//     top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos,
//     min_tokens, skip_special_tokens, no_stop_trim, regex, json_schema,
//     ebnf (refused), rid. choices[0] also has matched_stop.
//   - llama.cpp: llama-server's sampler defaults and fields (those of POST
//     /completion: samplers, min_p, n_probs, post_sampling_probs,
//     trajflow_seed, ...); max_tokens (or n_predict) is required, since
//     llama-server's default is unbounded; generation ends at an
//     end-of-generation id.
//
// Every dialect requires seed (vLLM, SGLang: a signed 64-bit integer, read
// as its two's-complement 64 bits, so that seed s and s-2^64 draw the same
// sample; llama.cpp: llama-server's 32-bit seed) and refuses stream, echo,
// n or best_of other than 1, a suffix, stop strings (stop_token_ids end a
// generation) and what the native endpoint refuses, with 400 naming the
// field. logprobs n (0..20) returns each sampled id's log-prob and, in
// top_logprobs, it and the n likeliest ids of its position, likeliest
// first; the log-probs are those of the sampling distribution (vLLM's
// processed log-probs, SGLang's), bit for bit the native endpoint's, or for
// llama.cpp those of the raw distribution unless post_sampling_probs is
// set, as llama-server's. text is the words of the generated ids; a final
// stop id's word is left out unless include_stop_str_in_output (vLLM) or
// no_stop_trim (SGLang) is set. A request runs on the version current when
// it passes the pause gate, as on the native endpoint: one that named the
// version replaced while it waited is answered 404; one aborted by a pause
// is answered with finish_reason "abort" and no ids.

// maxLogprobs is the most alternatives a completion's logprobs may ask
// for per position (vLLM's default max_logprobs).
const maxLogprobs = 20

// oaiExtras are the completions fields no native endpoint has.
type oaiExtras struct {
	Echo          bool            `json:"echo"`
	BestOf        *int            `json:"best_of"`
	Suffix        *string         `json:"suffix"`
	User          *string         `json:"user"` // an end user's id, not a setting
	StreamOptions json.RawMessage `json:"stream_options"`
}

func (o *oaiExtras) check() error {
	switch {
	case o.Echo:
		return errors.New("echo is not served (the answer carries the generated ids only)")
	case o.BestOf != nil && *o.BestOf != 1:
		return fmt.Errorf("best_of %d: one sample per request", *o.BestOf)
	case o.Suffix != nil && *o.Suffix != "":
		return errors.New("suffix is not served (the built-in policy continues a prompt)")
	case !emptyJSON(o.StreamOptions):
		return errors.New("stream_options: stream is not served")
	}
	return nil
}

// completion is a /v1/completions request as a dialect reads it.
type completion struct {
	model  string          // the model named ("": the one served)
	prompt json.RawMessage // token ids, or a text
	bos    bool            // a text prompt gets <bos> first
	// logprobs is nil for no log-probs, else how many alternatives each
	// position lists besides the sampled id.
	logprobs *int
	// settings maps the request to the built-in settings on a version, or
	// names what cannot be applied; maxField is the request's name for the
	// number of tokens.
	settings func(l *loaded) (model.Settings, uint64, error)
	maxField string
	raw      bool // log-probs of the raw distribution (llama.cpp without post_sampling_probs)
	idTokens bool // logprobs.tokens as "token_id:N"
	keepStop bool // text keeps a final stop id's word
	id       string
	// choice adds the dialect's fields to choices[0].
	choice func(ch map[string]any, prompt []int32, smp model.Sample)
}

// pickFunc picks the version a completion naming a model runs on, or
// says why none (with the status to answer).
type pickFunc func(name string) (*loaded, int, error)

// pickCurrent picks the current version (SGLang, vLLM).
func (c *core) pickCurrent(name string) (*loaded, int, error) {
	l := c.getCurrent()
	switch {
	case l == nil:
		return nil, http.StatusServiceUnavailable, errors.New("no weights loaded")
	case name != "" && name != l.name:
		return nil, http.StatusNotFound, fmt.Errorf("the model `%s` does not exist (this server serves %s)", name, l.name)
	}
	return l, 0, nil
}

// pickLoaded picks a loaded llama.cpp router model.
func (c *core) pickLoaded(name string) (*loaded, int, error) {
	l, err := c.llamaModel(name)
	switch {
	case err == nil:
		return l, 0, nil
	case name != "":
		return nil, http.StatusNotFound, err
	}
	return nil, http.StatusBadRequest, err
}

// completionPrompt reads a prompt: token ids, or a text tokenized with the
// built-in vocabulary (after <bos> when bos).
func (s *Server) completionPrompt(raw json.RawMessage, bos bool) ([]int32, error) {
	switch strings.TrimSpace(string(raw)) {
	case "", "null":
		return nil, errors.New("prompt is required (a list of token ids, or a text)")
	case `""`:
		return nil, errors.New("prompt is empty")
	}
	var text string
	if json.Unmarshal(raw, &text) == nil {
		ids, err := tokenize(text, s.vocab())
		if err != nil {
			return nil, fmt.Errorf("prompt: %w", err)
		}
		if bos {
			ids = append([]int32{rollout.TokBOS}, ids...)
		}
		if len(ids) > s.c.cfg.MaxPromptTokens {
			return nil, fmt.Errorf("prompt has %d ids, more than this server's limit of %d (trajflow serve policy --max-prompt-tokens)", len(ids), s.c.cfg.MaxPromptTokens)
		}
		return ids, nil
	}
	var texts []string
	if json.Unmarshal(raw, &texts) == nil && len(texts) > 0 {
		return nil, fmt.Errorf("prompt is a batch of %d prompts: one prompt per request is served (send each in its own request)", len(texts))
	}
	return parseIDs(raw, "prompt", s.c.cfg.MaxPromptTokens)
}

// serveCompletion answers a completion: the prompt, the version (pick),
// the settings, the pause gate (after which, when repick, the version is
// picked again: it may have been switched while the request waited), the
// generation on that one version, and the answer.
func (s *Server) serveCompletion(w http.ResponseWriter, r *http.Request, q *completion, pick pickFunc, repick bool) {
	prompt, err := s.completionPrompt(q.prompt, q.bos)
	if err == nil && q.logprobs != nil && (*q.logprobs < 0 || *q.logprobs > maxLogprobs) {
		err = fmt.Errorf("logprobs %d not in [0, %d] (this server's max_logprobs)", *q.logprobs, maxLogprobs)
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, "completions: %v", err)
		return
	}
	l, code, err := pick(q.model)
	if err != nil {
		writeError(w, code, "completions: %v", err)
		return
	}
	st, seed, err := q.settings(l)
	if err == nil {
		err = s.c.checkMaxTokens(q.maxField, st.MaxTokens)
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, "completions: %v", err)
		return
	}
	ctx, leave, ok := s.c.admit(w, r, "completions")
	if !ok {
		return
	}
	defer leave() // a no-op once called below
	if now := s.c.getCurrent(); repick && now != l {
		// The weights switched while the request waited at a pause: it
		// gets the new version only if it named none.
		if l, code, err = pick(q.model); err != nil {
			leave()
			writeError(w, code, "completions: %v (the version named was replaced while the request waited)", err)
			return
		}
		if st, seed, err = q.settings(l); err != nil {
			leave()
			writeError(w, http.StatusBadRequest, "completions: %v", err)
			return
		}
	}
	smp, err := s.c.generate(ctx, l, prompt, st, seed, q.id)
	var lps []float64
	var tops [][]tokenProb
	if err == nil && q.logprobs != nil {
		lps, tops, err = s.completionLogprobs(ctx, q, l, prompt, st, smp)
	}
	abort := aborted(ctx)
	failed := err != nil && ctx.Err() != nil
	leave()
	switch {
	case abort: // the work of an aborted request is discarded
		smp, lps = model.Sample{Finish: "abort"}, nil
	case failed:
		writeError(w, http.StatusInternalServerError, "completions: %v", err)
		return
	case err != nil:
		writeError(w, http.StatusBadRequest, "completions: %v", err)
		return
	}
	writeJSON(w, http.StatusOK, s.completionAnswer(q, l, prompt, smp, lps, tops))
}

// completionLogprobs are the log-probs a completion reports for smp: the
// sampler's own (the sampling distribution), or the raw distribution's
// when q.raw; and the *q.logprobs likeliest ids of each position, of the
// same distribution (log-probs).
func (s *Server) completionLogprobs(ctx context.Context, q *completion, l *loaded, prompt []int32, st model.Settings, smp model.Sample) ([]float64, [][]tokenProb, error) {
	n := min(*q.logprobs, l.m.Config.Vocab)
	lps := make([]float64, len(smp.Logprobs))
	for i, lp := range smp.Logprobs {
		lps[i] = float64(lp)
	}
	if n == 0 && !q.raw {
		return lps, nil, nil
	}
	rawLP, rawTop, postTop, err := s.c.details(ctx, l, prompt, st, smp, n)
	if err != nil {
		return nil, nil, err
	}
	if !q.raw {
		for _, row := range postTop {
			for j := range row {
				row[j].p = math.Log(row[j].p) // probabilities to log-probs
			}
		}
		return lps, postTop, nil
	}
	for i, lp := range rawLP {
		lps[i] = float64(lp)
	}
	return lps, rawTop, nil
}

// completionAnswer is the OpenAI completion of smp.
func (s *Server) completionAnswer(q *completion, l *loaded, prompt []int32, smp model.Sample, lps []float64, tops [][]tokenProb) map[string]any {
	words := make([]string, len(smp.Tokens))
	offsets := make([]int, len(smp.Tokens))
	at := 0
	for i, t := range smp.Tokens {
		words[i] = tokenText(t)
		offsets[i] = at
		at += len(words[i]) + 1
	}
	shown := words
	if smp.Finish == model.FinishStop && !q.keepStop {
		shown = words[:len(words)-1]
	}
	text := strings.Join(shown, " ")
	// model's finish reasons are OpenAI's words: stop, length (and abort).
	ch := map[string]any{"index": 0, "text": text, "logprobs": nil, "finish_reason": smp.Finish}
	if lps != nil {
		lp := oaiLogprobs{Tokens: make([]string, len(smp.Tokens)), TokenLogprobs: lps, TopLogprobs: make([]json.RawMessage, len(smp.Tokens)), TextOffset: offsets}
		for i, t := range smp.Tokens {
			lp.Tokens[i] = q.token(t)
			lp.TextOffset[i] = min(offsets[i], len(text))
			var top []tokenProb
			if tops != nil {
				top = tops[i]
			}
			lp.TopLogprobs[i] = q.topObject(t, lps[i], top)
		}
		ch["logprobs"] = lp
	}
	q.choice(ch, prompt, smp)
	id := q.id
	if id == "" {
		id = newRequestID()
	}
	return map[string]any{
		"id": "cmpl-" + id, "object": "text_completion", "created": time.Now().Unix(), "model": l.name,
		"choices": []map[string]any{ch},
		"usage":   map[string]any{"prompt_tokens": len(prompt), "completion_tokens": len(smp.Tokens), "total_tokens": len(prompt) + len(smp.Tokens)},
	}
}

// oaiLogprobs is choices[0].logprobs of a completion.
type oaiLogprobs struct {
	Tokens        []string          `json:"tokens"`
	TokenLogprobs []float64         `json:"token_logprobs"`
	TopLogprobs   []json.RawMessage `json:"top_logprobs"`
	TextOffset    []int             `json:"text_offset"`
}

// token is the logprobs.tokens entry of id.
func (q *completion) token(id int32) string {
	if q.idTokens {
		return "token_id:" + strconv.Itoa(int(id))
	}
	return tokenText(id)
}

// topObject is a top_logprobs entry: the sampled id and its log-prob
// first, then the alternatives, likeliest first (a JSON object whose keys
// keep that order).
func (q *completion) topObject(sampled int32, lp float64, top []tokenProb) json.RawMessage {
	var b bytes.Buffer
	seen := map[int32]bool{sampled: true}
	b.WriteByte('{')
	add := func(id int32, v float64) {
		k, _ := json.Marshal(q.token(id)) // a string: cannot fail
		if b.Len() > 1 {
			b.WriteByte(',')
		}
		b.Write(k)
		b.WriteByte(':')
		b.WriteString(strconv.FormatFloat(v, 'g', -1, 64))
	}
	add(sampled, lp)
	for _, tp := range top {
		if !seen[tp.id] && !math.IsInf(tp.p, 0) && !math.IsNaN(tp.p) {
			seen[tp.id] = true
			add(tp.id, tp.p)
		}
	}
	b.WriteByte('}')
	return b.Bytes()
}

// vllmCompletionReq is vLLM's completions request: the native sampling
// fields at the top level, and OpenAI's.
type vllmCompletionReq struct {
	vllmSampling
	oaiExtras
	// Seed shadows the sampling field: a signed 64-bit integer here.
	Seed *int64 `json:"seed"`
	// Detokenize shadows the sampling field: not a completions field.
	Detokenize                 json.RawMessage `json:"detokenize"`
	Model                      *string         `json:"model"`
	Prompt                     json.RawMessage `json:"prompt"`
	Stream                     bool            `json:"stream"`
	ReturnTokenIDs             bool            `json:"return_token_ids"`
	ReturnTokensAsTokenIDs     bool            `json:"return_tokens_as_token_ids"`
	AddSpecialTokens           *bool           `json:"add_special_tokens"`
	SpacesBetweenSpecialTokens *bool           `json:"spaces_between_special_tokens"`
	RequestID                  string          `json:"request_id"`
	Priority                   int             `json:"priority"`
}

// decodeCompletion reads a completions request into q, whose OpenAI
// fields are extras, and checks those, then the dialect's own refusals
// (more); a refused request is answered 400 naming the field, and false
// returned.
func decodeCompletion(w http.ResponseWriter, r *http.Request, q any, extras *oaiExtras, more func() error) bool {
	err := decodeStrict(w, r, q)
	if err == nil {
		err = extras.check()
	}
	if err == nil {
		err = more()
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, "completions: %v", err)
		return false
	}
	return true
}

func (s *Server) vllmCompletions(w http.ResponseWriter, r *http.Request) {
	var q vllmCompletionReq
	if !decodeCompletion(w, r, &q, &q.oaiExtras, func() error {
		switch {
		case q.Stream:
			return errors.New("stream is not served")
		case !emptyJSON(q.Detokenize):
			return errors.New("detokenize is not a field of /v1/completions (the text is always made)")
		case q.Priority != 0:
			return fmt.Errorf("priority %d: the server does not schedule by priority", q.Priority)
		}
		return nil
	}) {
		return
	}
	p := q.vllmSampling
	logprobs := p.Logprobs
	p.Logprobs = nil // served here with alternatives
	if q.Seed != nil {
		seed := uint64(*q.Seed)
		p.Seed = &seed
	}
	s.serveCompletion(w, r, &completion{
		model: deref(q.Model), prompt: q.Prompt, bos: q.AddSpecialTokens == nil || *q.AddSpecialTokens, logprobs: logprobs,
		settings: func(l *loaded) (model.Settings, uint64, error) { return vllmSettings(&p, l.m.Config.Vocab, "") },
		maxField: "max_tokens", idTokens: q.ReturnTokensAsTokenIDs, id: q.RequestID,
		keepStop: p.IncludeStopStrInOutput != nil && *p.IncludeStopStrInOutput,
		choice: func(ch map[string]any, prompt []int32, smp model.Sample) {
			ch["stop_reason"], ch["token_ids"], ch["prompt_token_ids"], ch["prompt_logprobs"] = stopID(smp), nil, nil, nil
			if q.ReturnTokenIDs {
				ch["token_ids"], ch["prompt_token_ids"] = append([]int32{}, smp.Tokens...), prompt
			}
		},
	}, s.c.pickCurrent, true)
}

// stopID is the stop id that ended smp, else nil.
func stopID(smp model.Sample) any {
	if smp.Finish != model.FinishStop || len(smp.Tokens) == 0 {
		return nil
	}
	return smp.Tokens[len(smp.Tokens)-1]
}

func deref[T any](p *T) T {
	var v T
	if p != nil {
		v = *p
	}
	return v
}

// sglangCompletionReq is SGLang's completions request.
type sglangCompletionReq struct {
	oaiExtras
	Model             *string         `json:"model"`
	Prompt            json.RawMessage `json:"prompt"`
	MaxTokens         *int            `json:"max_tokens"`
	Temperature       *float64        `json:"temperature"`
	TopP              *float64        `json:"top_p"`
	TopK              *int            `json:"top_k"`
	MinP              *float64        `json:"min_p"`
	N                 *int            `json:"n"`
	Stream            bool            `json:"stream"`
	Logprobs          *int            `json:"logprobs"`
	Stop              json.RawMessage `json:"stop"`
	StopTokenIDs      []int64         `json:"stop_token_ids"`
	Seed              *int64          `json:"seed"`
	PresencePenalty   *float64        `json:"presence_penalty"`
	FrequencyPenalty  *float64        `json:"frequency_penalty"`
	RepetitionPenalty *float64        `json:"repetition_penalty"`
	LogitBias         json.RawMessage `json:"logit_bias"`
	MinTokens         *int            `json:"min_tokens"`
	IgnoreEOS         *bool           `json:"ignore_eos"`
	SkipSpecialTokens *bool           `json:"skip_special_tokens"`
	NoStopTrim        *bool           `json:"no_stop_trim"`
	Regex             *string         `json:"regex"`
	JSONSchema        *string         `json:"json_schema"`
	EBNF              *string         `json:"ebnf"`
	Rid               string          `json:"rid"`
}

func (s *Server) sglangCompletions(w http.ResponseWriter, r *http.Request) {
	var q sglangCompletionReq
	if !decodeCompletion(w, r, &q, &q.oaiExtras, func() error {
		if q.Stream {
			return errors.New("stream is not served")
		}
		return nil
	}) {
		return
	}
	maxTok := 16
	if q.MaxTokens != nil {
		maxTok = *q.MaxTokens
	}
	p := sglangSampling{
		MaxNewTokens: &maxTok, Stop: q.Stop, StopTokenIDs: q.StopTokenIDs, Temperature: q.Temperature, TopP: q.TopP, TopK: q.TopK,
		MinP: q.MinP, FrequencyPenalty: q.FrequencyPenalty, PresencePenalty: q.PresencePenalty, RepetitionPenalty: q.RepetitionPenalty,
		N: q.N, JSONSchema: q.JSONSchema, Regex: q.Regex, EBNF: q.EBNF, LogitBias: q.LogitBias,
	}
	settings := func(l *loaded) (model.Settings, uint64, error) {
		switch {
		case q.Seed == nil:
			return model.Settings{}, 0, errors.New("seed is required (samples must be reproducible)")
		case q.MinTokens != nil && *q.MinTokens != 0:
			return model.Settings{}, 0, fmt.Errorf("min_tokens %d is not applied by the built-in policy", *q.MinTokens)
		}
		seed := uint64(*q.Seed)
		p.SamplingSeed = &seed
		return sglangSettings(&p, l.m.Config.Vocab, "")
	}
	s.serveCompletion(w, r, &completion{
		model: deref(q.Model), prompt: q.Prompt, bos: true, logprobs: q.Logprobs, settings: settings,
		maxField: "max_tokens", id: q.Rid, keepStop: q.NoStopTrim != nil && *q.NoStopTrim,
		choice: func(ch map[string]any, _ []int32, smp model.Sample) { ch["matched_stop"] = stopID(smp) },
	}, s.c.pickCurrent, true)
}

// llamaCompletionsReq is llama-server's completions request: its native
// completion fields, and OpenAI's.
type llamaCompletionsReq struct {
	llamaCompletionReq
	oaiExtras
	MaxTokens *int `json:"max_tokens"`
	N         *int `json:"n"`
	Logprobs  *int `json:"logprobs"`
}

func (s *Server) llamaCompletions(w http.ResponseWriter, r *http.Request) {
	if a := r.URL.Query().Get("autoload"); a == "true" || a == "1" {
		writeError(w, http.StatusBadRequest, "completions: autoload: this server loads models only through POST /models/load")
		return
	}
	var q llamaCompletionsReq
	field := "n_predict"
	if !decodeCompletion(w, r, &q, &q.oaiExtras, func() error {
		if q.NPredict == nil {
			q.NPredict, field = q.MaxTokens, "max_tokens"
		}
		switch {
		case q.N != nil && *q.N != 1:
			return fmt.Errorf("n %d: one sample per request", *q.N)
		case q.NPredict == nil:
			return errors.New("max_tokens is required (llama-server's default is unbounded)")
		case *q.NPredict <= 0:
			return fmt.Errorf("%s %d must be positive", field, *q.NPredict)
		}
		return nil
	}) {
		return
	}
	logprobs := q.Logprobs
	if logprobs == nil && q.NProbs > 0 {
		logprobs = &q.NProbs
	}
	s.serveCompletion(w, r, &completion{
		model: q.Model, prompt: q.Prompt, bos: true, logprobs: logprobs,
		settings: func(*loaded) (model.Settings, uint64, error) { return s.c.llamaSettings(&q.llamaCompletionReq) },
		maxField: field, raw: !q.PostSamplingProbs,
		choice: func(map[string]any, []int32, model.Sample) {},
	}, s.c.pickLoaded, false)
}
