package gateway

import "github.com/prometheus/client_golang/prometheus"

// metrics are the gateway's collectors, labelled by replica.
type metrics struct {
	requests    *prometheus.CounterVec   // trajflow_policy_requests_total{replica,outcome}
	latency     *prometheus.HistogramVec // trajflow_policy_request_duration_seconds{replica}
	outstanding *prometheus.GaugeVec     // trajflow_policy_outstanding_requests{replica}
	breaker     *prometheus.GaugeVec     // trajflow_policy_breaker_state{replica}
	healthy     *prometheus.GaugeVec     // trajflow_policy_replica_healthy{replica}
	ready       *prometheus.GaugeVec     // trajflow_policy_replica_ready_version{replica}
	retries     *prometheus.CounterVec   // trajflow_policy_retries_total{replica}
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	r := []string{"replica"}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "trajflow_policy_requests_total",
			Help: "Generation requests answered by a policy replica, by outcome (ok, an infrastructure failure reason, error, canceled)."},
			[]string{"replica", "outcome"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "trajflow_policy_request_duration_seconds",
			Help: "Time from sending a replica its requests to its answer.", Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}, r),
		outstanding: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "trajflow_policy_outstanding_requests",
			Help: "Requests sent to a replica and not yet answered."}, r),
		breaker: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "trajflow_policy_breaker_state",
			Help: "Circuit breaker of a replica: 0 closed, 1 half-open, 2 open."}, r),
		healthy: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "trajflow_policy_replica_healthy",
			Help: "1 when the replica's last health check passed."}, r),
		ready: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "trajflow_policy_replica_ready_version",
			Help: "Policy version weight sync acknowledged for the replica (-1: none)."}, r),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "trajflow_policy_retries_total",
			Help: "Requests sent again after an infrastructure failure on this replica."}, r),
	}
	for _, c := range []prometheus.Collector{m.requests, m.latency, m.outstanding, m.breaker, m.healthy, m.ready, m.retries} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// init creates a replica's series so that they are exported from the start.
func (m *metrics) init(name string) {
	m.outstanding.WithLabelValues(name).Set(0)
	m.breaker.WithLabelValues(name).Set(BreakerClosed)
	m.healthy.WithLabelValues(name).Set(1)
	m.ready.WithLabelValues(name).Set(-1)
	m.latency.WithLabelValues(name)
	m.retries.WithLabelValues(name)
}
