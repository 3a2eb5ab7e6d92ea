package envsvc

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// MetricsRegisterer receives the service's collectors; a
// *prometheus.Registry is one.
type MetricsRegisterer interface {
	prometheus.Registerer
	prometheus.Gatherer
}

type metrics struct {
	reg       MetricsRegisterer
	requests  *prometheus.CounterVec
	steps     *prometheus.CounterVec
	stepTime  *prometheus.HistogramVec
	persist   prometheus.Histogram
	allocated *prometheus.CounterVec
	ended     *prometheus.CounterVec
	live      prometheus.Gauge
	replays   prometheus.Counter
	renewals  prometheus.Counter
}

func newMetrics(reg MetricsRegisterer) *metrics {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := &metrics{
		reg: reg,
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_env_requests_total", Help: "Protocol requests by operation, outcome and reason."}, []string{"op", "outcome", "reason"}),
		steps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_env_actions_executed_total", Help: "Actions executed and persisted, by family."}, []string{"family"}),
		stepTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "trajflow_env_step_seconds", Help: "Execution and persistence of one action.",
			Buckets: prometheus.ExponentialBuckets(1e-5, 2, 18)}, []string{"family"}),
		persist: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "trajflow_env_persist_seconds", Help: "One record written to the store before the acknowledgement.",
			Buckets: prometheus.ExponentialBuckets(1e-5, 2, 18)}),
		allocated: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_env_episodes_allocated_total", Help: "Episodes allocated, by family."}, []string{"family"}),
		ended: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_env_episodes_ended_total", Help: "Episodes ended, by status (completed, infra) and reason."}, []string{"status", "reason"}),
		live: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "trajflow_env_episodes_live", Help: "Episodes holding a slot."}),
		replays: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "trajflow_env_replayed_transitions_total", Help: "Repeated deliveries answered with the stored transition (nothing executed)."}),
		renewals: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "trajflow_env_lease_renewals_total", Help: "Lease renewals granted."}),
	}
	reg.MustRegister(m.requests, m.steps, m.stepTime, m.persist, m.allocated, m.ended, m.live, m.replays, m.renewals)
	return m
}

func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}
