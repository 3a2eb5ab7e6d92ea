// Package serve serves the built-in policy (gpu/model's window MLP) over
// the network protocols of llama.cpp's llama-server, SGLang and vLLM, so
// that the protocol clients of connectors/policy can be run, tested and
// benchmarked against a server whose every sample is known: a client
// talking to a Server returns the same tokens and float32 log-prob bits as
// model.Policy.Generate in process.
//
// A Server loads trajflow policy releases from one directory
// (gpu.LoadRelease verifies the checkpoint hash and the model config
// hash) through each protocol's weight-update calls, and switches versions
// atomically: a request takes the version current when it starts and keeps
// it to its end, so no request ever sees two versions' weights (systems
// §8). See the files of each protocol for their endpoints; every protocol
// also serves OpenAI's POST /v1/completions in its real server's dialect
// (completions.go), and GET /metrics (Prometheus: requests by route and
// status, prompt and generated tokens, generation time, requests in
// flight, pause, loaded version, release loads).
package serve

import (
	"bytes"
	"fmt"
	"net/http"
	"slices"
)

// Server is an http.Handler serving one protocol.
type Server struct {
	c   *core
	mux *http.ServeMux
	h   http.Handler // mux, counted, with GET /metrics
}

// New returns a server of cfg.Protocol with no version loaded: call Load
// (or LoadNewest) before serving, or let the protocol's weight-update
// calls load one.
func New(cfg Config) (*Server, error) {
	c, err := newCore(cfg)
	if err != nil {
		return nil, err
	}
	s := &Server{c: c, mux: http.NewServeMux()}
	switch cfg.Protocol {
	case "llamacpp":
		s.llamaRoutes(s.mux)
	case "sglang":
		s.sglangRoutes(s.mux)
	case "vllm":
		s.vllmRoutes(s.mux)
	}
	s.h = c.met.instrument(s.mux, s.unserved)
	return s, nil
}

// generateRoute is each protocol's generation endpoint, named by the
// answer to a request for a route the protocol does not serve.
var generateRoute = map[string]string{
	"llamacpp": "llama-server's native API: POST /completion {prompt: [token ids], n_predict, seed, samplers}",
	"sglang":   "SGLang's native API: POST /generate {input_ids, sampling_params: {max_new_tokens, sampling_seed, ...}}",
	"vllm":     "vLLM's token-in/token-out API: POST /inference/v1/generate {token_ids, sampling_params: {max_tokens, seed, ...}}",
}

// unserved answers a request no route matches. Where the mux would answer
// 404, the answer is a JSON error naming the protocol's generation
// endpoints, so that a client of another API (an OpenAI SDK calling
// /v1/chat/completions) reads why, not a bare "404 page not found"; the
// mux's other answers (405 for a path served under another method, a
// redirect to a clean path) are passed on.
func (s *Server) unserved(w http.ResponseWriter, r *http.Request) {
	rec := &captureWriter{header: http.Header{}, code: http.StatusOK}
	s.mux.ServeHTTP(rec, r)
	if rec.code == http.StatusNotFound {
		writeError(w, http.StatusNotFound, "%s %s is not served by trajflow serve policy --protocol %s, which serves the built-in policy over %s, and over OpenAI's POST /v1/completions {model, prompt: [token ids] or text, max_tokens, seed, ...} (chat completions are not served)",
			r.Method, r.URL.Path, s.c.cfg.Protocol, generateRoute[s.c.cfg.Protocol])
		return
	}
	for k, v := range rec.header {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.code)
	w.Write(rec.body.Bytes())
}

// captureWriter holds the short answer of an unmatched request.
type captureWriter struct {
	header http.Header
	code   int
	wrote  bool
	body   bytes.Buffer
}

func (c *captureWriter) Header() http.Header { return c.header }

func (c *captureWriter) WriteHeader(code int) {
	if !c.wrote {
		c.code, c.wrote = code, true
	}
}

func (c *captureWriter) Write(b []byte) (int, error) {
	c.wrote = true
	return c.body.Write(b)
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.h.ServeHTTP(w, r) }

// Stop makes generation requests waiting at a pause, and every later one,
// answer 503 (the server is stopping); requests generating go on. Call it
// before http.Server.Shutdown, which waits for the requests in flight.
func (s *Server) Stop() { s.c.gate.close() }

// Protocol is the protocol served.
func (s *Server) Protocol() string { return s.c.cfg.Protocol }

// Load loads release v and makes it the version new requests get (for
// llama.cpp: loads the model policy.ModelName(v) beside the others).
func (s *Server) Load(v int64) error {
	if s.c.cfg.Protocol == "llamacpp" {
		return s.LoadModel(v)
	}
	l, err := s.c.load(v)
	if err != nil {
		return err
	}
	s.c.setCurrent(l)
	return nil
}

// LoadModel loads release v as the llama.cpp router model
// policy.ModelName(v) (reloading it if already loaded).
func (s *Server) LoadModel(v int64) error {
	l, err := s.c.load(v)
	if err != nil {
		return err
	}
	s.c.mu.Lock()
	s.c.models[l.name] = l
	s.c.mu.Unlock()
	return nil
}

// LoadNewest loads the newest release of the directory and returns its
// version; with no release there it loads nothing and returns 0.
func (s *Server) LoadNewest() (int64, error) {
	vs, err := s.c.available()
	if err != nil {
		return 0, err
	}
	if len(vs) == 0 {
		return 0, nil
	}
	v := vs[len(vs)-1]
	if err := s.Load(v); err != nil {
		return 0, fmt.Errorf("serve: load newest release: %w", err)
	}
	return v, nil
}

// Versions are the loaded versions: the current one (SGLang, vLLM) or the
// loaded router models (llama.cpp), ascending.
func (s *Server) Versions() []int64 {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []int64
	if c.current != nil {
		out = append(out, c.current.version)
	}
	for _, l := range c.models {
		out = append(out, l.version)
	}
	slices.Sort(out)
	return out
}

// InFlight is the number of generation requests being served now.
func (s *Server) InFlight() int {
	g := &s.c.gate
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.inflight)
}
