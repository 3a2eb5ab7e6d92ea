package pipeline

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/trajflow/trajflow/internal/buildinfo"
)

// Metrics holds the Prometheus collectors of the operators of one process.
type Metrics struct {
	Registry      *prometheus.Registry
	in            *prometheus.CounterVec
	inBytes       *prometheus.CounterVec
	out           *prometheus.CounterVec
	outBytes      *prometheus.CounterVec
	busy          *prometheus.CounterVec
	quarantined   *prometheus.CounterVec
	lag           *prometheus.GaugeVec
	inFlight      *prometheus.GaugeVec
	backpressure  *prometheus.CounterVec
	commitLatency *prometheus.HistogramVec
	retries       *prometheus.CounterVec
	commits       *prometheus.CounterVec
	duplicates    *prometheus.CounterVec
	domain        *domainVecs
}

// ReplicaLabel is the label naming the operator process (its --instance,
// by default host-pid) on every operator metric. It is not "instance":
// Prometheus sets that label on every scraped series itself (the scrape
// target), and a target's own "instance" label would be renamed to
// "exported_instance" or overwrite it.
const ReplicaLabel = "replica"

// NewMetrics registers the operator collectors on reg (a new registry when
// nil), together with the standard collectors of the process: the Go
// runtime (go_*), the process (process_*, where the platform has them),
// go_build_info and trajflow_build_info (the module version, VCS revision
// and Go version of the binary). Metric names follow the Prometheus
// conventions: a unit suffix in base units (_seconds, _bytes, _records),
// _total on counters.
func NewMetrics(reg *prometheus.Registry) *Metrics {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	RegisterProcessCollectors(reg)
	lbl := []string{"stage", ReplicaLabel}
	m := &Metrics{
		Registry: reg,
		in: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_records_in_total", Help: "Records consumed."}, lbl),
		inBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_in_bytes_total", Help: "Record value bytes consumed."}, lbl),
		out: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_records_out_total", Help: "Records produced and acknowledged."}, append(lbl, "topic")),
		outBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_out_bytes_total", Help: "Record bytes (key and value) produced and acknowledged."}, lbl),
		busy: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_stage_busy_seconds_total", Help: "Time spent in the stage's own code (Process, Tick and Flush); its rate is the share of one core the stage keeps busy, the Kafka client's work excluded."}, lbl),
		quarantined: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_records_quarantined_total", Help: "Records sent to quarantine, by reason."}, append(lbl, "reason")),
		lag: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "trajflow_consumer_lag_records", Help: "Records of an input partition not yet consumed: its high-water mark minus the next offset, as of the last record fetched."}, append(lbl, "topic", "partition")),
		inFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "trajflow_in_flight_records", Help: "Records produced but not yet acknowledged."}, lbl),
		backpressure: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_backpressure_seconds_total", Help: "Time the stage waited to produce because its records in flight (produced, not yet acknowledged by the brokers) were at the runtime's bound (MaxInFlightRecords, MaxInFlightBytes); its rate is the share of time the brokers hold the stage back, and its fetching with it."}, lbl),
		commitLatency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "trajflow_commit_duration_seconds", Help: "Time an offset commit took, until the group coordinator acknowledged it.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}, lbl),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_broker_retries_total", Help: "Transient broker failures retried in place, by operation (fetch, commit)."}, append(lbl, "op")),
		commits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_commits_total", Help: "Offset commits acknowledged by the group coordinator."}, lbl),
		duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trajflow_duplicates_dropped_total", Help: "Input records a stage dropped as redelivered or re-produced duplicates of records it had already decided (pack: a trajectory already admitted; advantage: a member of a group already scored; train: a batch already trained)."}, lbl),
	}
	m.domain = newDomainVecs(reg, lbl)
	reg.MustRegister(m.in, m.inBytes, m.out, m.outBytes, m.busy, m.quarantined, m.lag, m.inFlight, m.backpressure, m.commitLatency, m.retries, m.commits, m.duplicates)
	return m
}

// RegisterProcessCollectors registers on reg the Go runtime, process and
// build-info collectors and trajflow_build_info; collectors reg already
// holds are kept.
func RegisterProcessCollectors(reg prometheus.Registerer) {
	bi := buildinfo.Read()
	build := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "trajflow_build_info", Help: "Always 1; the labels say which build of trajflow runs (module version, VCS revision, Go version).",
		ConstLabels: prometheus.Labels{"version": bi.Version, "revision": bi.Revision, "goversion": bi.Go},
	})
	build.Set(1)
	for _, c := range []prometheus.Collector{
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		collectors.NewBuildInfoCollector(),
		build,
	} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				panic(err)
			}
		}
	}
}

type stageMetrics struct {
	in, inBytes, outBytes prometheus.Counter
	busy, backpressure    prometheus.Counter
	out                   *prometheus.CounterVec
	quarantined           *prometheus.CounterVec
	lag                   *prometheus.GaugeVec
	inFlight              prometheus.Gauge
	commitLatency         prometheus.Observer
	retries               *prometheus.CounterVec
	commits               prometheus.Counter
	duplicates            prometheus.Counter
	domain                *Domain
}

func (m *Metrics) forStage(stage, instance string) *stageMetrics {
	l := prometheus.Labels{"stage": stage, ReplicaLabel: instance}
	return &stageMetrics{
		in:            m.in.With(l),
		inBytes:       m.inBytes.With(l),
		outBytes:      m.outBytes.With(l),
		busy:          m.busy.With(l),
		out:           m.out.MustCurryWith(l),
		quarantined:   m.quarantined.MustCurryWith(l),
		lag:           m.lag.MustCurryWith(l),
		inFlight:      m.inFlight.With(l),
		backpressure:  m.backpressure.With(l),
		commitLatency: m.commitLatency.With(l),
		retries:       m.retries.MustCurryWith(l),
		commits:       m.commits.With(l),
		duplicates:    m.duplicates.With(l),
		domain:        m.domain.forStage(l),
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

// HealthServer serves GET (and HEAD) /healthz, /readyz and /metrics for
// the operators of one process; other methods get 405.
type HealthServer struct {
	mu       sync.Mutex
	ops      []*Operator
	draining bool
	metrics  *Metrics
	srv      *http.Server
	ln       net.Listener
	taken    string
}

// healthMark precedes the address in a HealthLine.
const healthMark = " health on http://"

// HealthLine is the line an operator process (`trajflow run`) prints on
// its standard output once its health server listens at addr, without
// the newline; HealthAddrOf reads the address back.
func HealthLine(stage, instance, addr string) string {
	return "operator " + stage + " (" + instance + ")" + healthMark + addr
}

// HealthAddrOf is the address of a HealthLine; false for any other line.
func HealthAddrOf(line string) (string, bool) {
	_, addr, ok := strings.Cut(line, healthMark)
	addr = strings.TrimSpace(addr)
	return addr, ok && addr != ""
}

// NewHealthServer listens on addr ("127.0.0.1:0" picks a port). When the
// port of addr is taken, it listens on a free port of the same host
// instead, so that an operator never fails for its health port: Addr says
// where it listens, TakenAddr which address was taken. Any other listen
// error (a bad address, a host that is not local) is returned.
func NewHealthServer(addr string, m *Metrics, ops ...*Operator) (*HealthServer, error) {
	ln, err := net.Listen("tcp", addr)
	taken := ""
	if errors.Is(err, syscall.EADDRINUSE) {
		host, _, serr := net.SplitHostPort(addr)
		if serr != nil {
			return nil, fmt.Errorf("pipeline: health listener %s: %w", addr, err)
		}
		taken = addr
		if ln, err = net.Listen("tcp", net.JoinHostPort(host, "0")); err != nil {
			return nil, fmt.Errorf("pipeline: health listener: %s is taken and no free port on %q: %w", addr, host, err)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("pipeline: health listener %s: %w", addr, err)
	}
	h := &HealthServer{ops: ops, metrics: m, ln: ln, taken: taken}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if ok, why := h.isReady(); !ok {
			http.Error(w, why, http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}))
	h.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	return h, nil
}

// Addr is the address the server listens on.
func (h *HealthServer) Addr() string { return h.ln.Addr().String() }

// TakenAddr is the requested address when its port was taken and the
// server listens on another port of the same host (Addr); "" otherwise.
func (h *HealthServer) TakenAddr() string { return h.taken }

// SetOperators replaces the operators whose readiness /readyz reports (an
// operator rebuilt after a fatal error replaces the failed one).
func (h *HealthServer) SetOperators(ops ...*Operator) {
	h.mu.Lock()
	h.ops = ops
	h.mu.Unlock()
}

// SetDraining makes /readyz fail (during a graceful shutdown).
func (h *HealthServer) SetDraining() {
	h.mu.Lock()
	h.draining = true
	h.mu.Unlock()
}

func (h *HealthServer) isReady() (bool, string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.draining {
		return false, "draining"
	}
	if len(h.ops) == 0 {
		return false, "starting: no operator yet"
	}
	for _, o := range h.ops {
		select {
		case <-o.Ready():
		default:
			return false, "starting: " + o.stage.Name()
		}
	}
	return true, ""
}

// Serve serves until ctx is cancelled.
func (h *HealthServer) Serve(ctx context.Context) error {
	errc := make(chan error, 1)
	go func() { errc <- h.srv.Serve(h.ln) }()
	select {
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = h.srv.Shutdown(sctx)
		<-errc
		return nil
	case err := <-errc:
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		return fmt.Errorf("pipeline: health server: %w", err)
	}
}
