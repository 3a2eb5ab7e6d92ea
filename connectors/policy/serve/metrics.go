package serve

import (
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics are a server's Prometheus collectors, served at GET /metrics
// under every protocol: what an operator watches on a fleet of replicas
// (load, tokens, weight updates) without the protocols' own names.
type metrics struct {
	reg       *prometheus.Registry
	requests  *prometheus.CounterVec
	prompt    prometheus.Counter
	generated prometheus.Counter
	genTime   *prometheus.HistogramVec
	loads     *prometheus.CounterVec
}

func newMetrics(c *core) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_policy_server_requests_total", Help: "HTTP requests by route and status code."}, []string{"route", "code"}),
		prompt: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "trajflow_policy_server_prompt_tokens_total", Help: "Prompt tokens of the generation requests served."}),
		generated: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "trajflow_policy_server_generated_tokens_total", Help: "Tokens generated for the requests served."}),
		genTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "trajflow_policy_server_generate_seconds", Help: "Generation of one request, by outcome (ok, error: cancelled or refused by the model).",
			Buckets: prometheus.ExponentialBuckets(1e-4, 2, 20)}, []string{"outcome"}),
		loads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_policy_server_release_loads_total", Help: "Releases loaded from the releases directory, by outcome (ok, error)."}, []string{"outcome"}),
	}
	inflight := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "trajflow_policy_server_requests_in_flight", Help: "Generation requests being served."}, func() float64 {
		c.gate.mu.Lock()
		defer c.gate.mu.Unlock()
		return float64(len(c.gate.inflight))
	})
	paused := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "trajflow_policy_server_paused", Help: "1 while generation is paused for a weight update."}, func() float64 {
		if c.gate.isPaused() {
			return 1
		}
		return 0
	})
	version := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "trajflow_policy_server_version", Help: "The newest policy version loaded (SGLang, vLLM: the one new requests get; -1: none)."}, func() float64 {
		c.mu.Lock()
		defer c.mu.Unlock()
		v := int64(-1)
		if c.current != nil {
			v = c.current.version
		}
		for _, l := range c.models {
			v = max(v, l.version)
		}
		return float64(v)
	})
	m.reg.MustRegister(m.requests, m.prompt, m.generated, m.genTime, m.loads, inflight, paused, version)
	return m
}

// observeGenerate counts one generation of n prompt tokens.
func (m *metrics) observeGenerate(start time.Time, prompt, generated int, err error) {
	outcome := "ok"
	if err != nil {
		outcome = "error"
	}
	m.genTime.WithLabelValues(outcome).Observe(time.Since(start).Seconds())
	m.prompt.Add(float64(prompt))
	m.generated.Add(float64(generated))
}

// observeLoad counts one release load.
func (m *metrics) observeLoad(err error) {
	if err != nil {
		m.loads.WithLabelValues("error").Inc()
		return
	}
	m.loads.WithLabelValues("ok").Inc()
}

// instrument counts the requests of mux by the pattern they match (one
// label value per route, never the raw path) and status code. A request
// no pattern matches goes to unmatched (which may hand it to mux).
func (m *metrics) instrument(mux *http.ServeMux, unmatched http.HandlerFunc) http.Handler {
	mux.Handle("GET /metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &statusWriter{ResponseWriter: w, code: http.StatusOK}
		_, route := mux.Handler(r)
		if route == "" {
			route = "unmatched"
			unmatched(rec, r)
		} else {
			mux.ServeHTTP(rec, r)
		}
		m.requests.WithLabelValues(route, strconv.Itoa(rec.code)).Inc()
	})
}

// statusWriter remembers the status code written.
type statusWriter struct {
	http.ResponseWriter
	code  int
	wrote bool
}

func (w *statusWriter) WriteHeader(code int) {
	if !w.wrote {
		w.code, w.wrote = code, true
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	w.wrote = true
	return w.ResponseWriter.Write(b)
}

// Unwrap gives http.ResponseController the connection's writer (read and
// write deadlines).
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// Flush passes flushes through (a streamed answer).
func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}
