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
// also serves GET /metrics (Prometheus: requests by route and status,
// prompt and generated tokens, generation time, requests in flight, pause,
// loaded version, release loads).
package serve

import (
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
	s.h = c.met.instrument(s.mux)
	return s, nil
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
