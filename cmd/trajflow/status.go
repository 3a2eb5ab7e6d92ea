package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

func init() {
	register("status", "status [--out DIR | --brokers ADDR --contract FILE]: where a run stands: rounds, updates, lag per consumer group, quarantine, last release, operators' health and backpressure", cmdStatus)
}

func cmdStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("status", stderr)
	cf := addClientFlags(fs)
	path := fs.String("contract", "", "learning contract (default: fleet.json's with --out, else the built-in demo contract)")
	out := fs.String("out", "", "output directory of trajflow up: its fleet.json gives the brokers, the contract, the rounds and the operators' health addresses")
	rounds := fs.Int64("rounds", 0, "the run's round limit (default: fleet.json's with --out; 0: none)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return fmt.Errorf("%w: trajflow status takes no arguments (got %q)", errUsage, pos)
	}
	if *rounds < 0 {
		return fmt.Errorf("%w: --rounds %d: want 0 (no round limit) or more", errUsage, *rounds)
	}
	doc, err := readFleetDoc(*out)
	if err != nil {
		return err
	}
	if *out != "" {
		fleetDefaults(fs, doc, cf, path, rounds)
	}
	cc, err := cf.load()
	if err != nil {
		return err
	}
	c, err := loadContract(*path)
	if err != nil {
		return err
	}
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	brokers, err := kafka.ListBrokers(sctx, cc, cc.Brokers)
	if err != nil {
		return brokerUnreachable(strings.Join(cc.Brokers, ","), 0, err)
	}
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return err
	}
	dialer, err := cc.Dialer()
	if err != nil {
		return err
	}
	transport, err := cc.Transport()
	if err != nil {
		return err
	}
	defer transport.CloseIdleConnections()
	cfg := &pipeline.Config{Brokers: cc.Brokers, Dialer: dialer, Transport: transport, MaxMessageBytes: c.Topics.MaxMessageBytes}
	want := int(*rounds) * c.Dispatch.GroupsPerUpdate
	p, err := readProgress(sctx, cfg, topics, want, c.Dispatch.GroupsPerUpdate)
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	fmt.Fprintf(stdout, "run %s (contract %s) on %d broker(s) at %s\n", c.RunID, c.Hash(), len(brokers), strings.Join(cc.Brokers, ","))
	health := probeOperators(ctx, doc.Operators)
	if len(health) > 0 && !p.done() && !anyAnswered(health) {
		// No operator of fleet.json answers: the fleet is not running,
		// whatever its progress says.
		p.Stopped = true
	}
	printProgress(stdout, p, *rounds, max(1, c.Dispatch.GroupsPerUpdate), want)
	if err := printGroupLag(sctx, stdout, cc, c.RunID, topics, fleetStages(c)); err != nil {
		return err
	}
	if err := printQuarantine(sctx, stdout, cfg, topics.Quarantine); err != nil {
		return err
	}
	printHealth(stdout, health)
	return nil
}

// fleetDefaults sets every flag of status the command line left unset
// from fleet.json: the brokers, the contract, the client config, the
// rounds.
func fleetDefaults(fs *flag.FlagSet, doc fleetDoc, cf clientFlags, path *string, rounds *int64) {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if !set["brokers"] {
		*cf.brokers = doc.Brokers
	}
	if !set["contract"] {
		*path = doc.Contract
	}
	if !set["client-config"] {
		*cf.config = doc.ClientConfig
	}
	if !set["rounds"] {
		*rounds = doc.Rounds
	}
}

// readFleetDoc reads out's fleet.json (nothing without out).
func readFleetDoc(out string) (fleetDoc, error) {
	var doc fleetDoc
	if out == "" {
		return doc, nil
	}
	b, err := os.ReadFile(filepath.Join(out, FleetFile))
	if err != nil {
		return doc, fmt.Errorf("%w: --out: %w (is %s the --out of trajflow up?)", errUsage, err, out)
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		return doc, fmt.Errorf("status: %s: %w", filepath.Join(out, FleetFile), err)
	}
	return doc, nil
}

// printProgress prints the rounds decided (of rounds, when > 0), the
// batches packed, the version trained and the last release.
func printProgress(stdout io.Writer, p runProgress, rounds int64, perRound, want int) {
	if rounds > 0 {
		state := "running"
		switch {
		case p.done():
			state = "done"
		case p.Stopped:
			state = "not running: no operator of fleet.json answers (see its logs)"
		}
		fmt.Fprintf(stdout, "rounds:     %d of %d decided (%d of %d groups), %s\n", p.Decided/perRound, rounds, p.Decided, want, state)
	} else {
		state := ""
		if p.Stopped {
			state = "; not running: no operator of fleet.json answers (see its logs)"
		}
		fmt.Fprintf(stdout, "rounds:     %d decided (%d groups; no round limit given)%s\n", p.Decided/perRound, p.Decided, state)
	}
	fmt.Fprintf(stdout, "updates:    %d batches packed, policy version %d trained\n", p.Batches, p.Version)
	if p.Gate != nil {
		d := p.Gate
		fmt.Fprintf(stdout, "gate:       %s at release %d, promoted release %d: %s\n", d.Action, d.PolicyVersion, d.Promoted, d.Reason)
	}
	if p.Halted != nil {
		fmt.Fprintf(stdout, "stopped:    %s after %d rounds\n", p.Halted.StopRule, p.Halted.RoundsDispatched)
	}
	if p.Version > 0 || p.Release.CheckpointHash != "" {
		fmt.Fprintf(stdout, "release:    v%d at %s, checkpoint %s (%s)\n", p.Release.PolicyVersion, p.Release.CreatedAt, p.Release.CheckpointHash, p.Release.CheckpointURI)
	} else {
		fmt.Fprintln(stdout, "release:    none yet")
	}
}

// printGroupLag prints, per consumer group of the operators of stages, the
// records of its inputs it has not committed (the snapshot stage commits
// when it writes a file: its lag includes what it holds unwritten).
func printGroupLag(ctx context.Context, w io.Writer, cc kafka.ClientConfig, run string, topics pipeline.Topics, stages []string) error {
	fmt.Fprintln(w, "consumer groups (lag: records of the inputs not committed yet):")
	for _, name := range stages {
		var inputs []string
		for _, s := range pipeline.InputsOf(name) {
			inputs = append(inputs, topics.Name(s))
		}
		if len(inputs) == 0 {
			continue
		}
		lags, err := kafka.GroupLag(ctx, cc, cc.Brokers, run+"."+name, inputs)
		if err != nil {
			return fmt.Errorf("status: %w", err)
		}
		var lag, records int64
		committed := false
		for _, l := range lags {
			lag += l.Lag()
			records += l.End - l.Start
			committed = committed || l.Committed >= 0
		}
		note := ""
		switch {
		case name == pipeline.SnapshotStage && lag > 0:
			// Its consumer has read further (its /metrics lag below):
			// it commits what a Parquet file it closed holds.
			note = "  (the snapshotter commits when it closes a file: records read but not yet in a closed file count here)"
		case !committed:
			note = "  (nothing committed: not started, or nothing to consume yet)"
		}
		fmt.Fprintf(w, "  %-26s lag %8d of %8d records%s\n", run+"."+name, lag, records, note)
	}
	return nil
}

// printQuarantine prints the quarantine topic's records by reason.
func printQuarantine(ctx context.Context, w io.Writer, cfg *pipeline.Config, topic string) error {
	by := map[string]int{}
	n := 0
	err := pipeline.ScanTail(ctx, cfg, topic, 0, func(m pipeline.Message) error {
		n++
		reason := "(no reason header)"
		for _, h := range m.Headers {
			if h.Key == schemas.HeaderReason {
				reason = string(h.Value)
			}
		}
		by[reason]++
		return nil
	})
	if err != nil {
		return fmt.Errorf("status: read %s: %w", topic, err)
	}
	reasons := make([]string, 0, len(by))
	for r := range by {
		reasons = append(reasons, r)
	}
	sort.Strings(reasons)
	parts := make([]string, len(reasons))
	for i, r := range reasons {
		parts[i] = fmt.Sprintf("%s %d", r, by[r])
	}
	fmt.Fprintf(w, "quarantine: %d records", n)
	if n > 0 {
		fmt.Fprintf(w, " (%s)", strings.Join(parts, ", "))
	}
	fmt.Fprintln(w)
	return nil
}

// operatorHealth is what status learned from one operator of fleet.json:
// its /readyz line (answered false when it did not answer) and, when it
// answered, its /metrics or why they did not read.
type operatorHealth struct {
	member   fleetMember
	answered bool
	ready    string
	metrics  operatorMetrics
	err      error
}

// probeOperators asks every operator of fleet.json for /readyz and, of
// those that answer, reads /metrics.
func probeOperators(ctx context.Context, ops []fleetMember) []operatorHealth {
	cl := http.Client{Timeout: 2 * time.Second}
	out := make([]operatorHealth, len(ops))
	for i, m := range ops {
		h := operatorHealth{member: m}
		body, code, err := httpGet(ctx, &cl, "http://"+m.Health+"/readyz", 512)
		if err == nil {
			h.answered, h.ready = true, fmt.Sprintf("%d %s", code, strings.TrimSpace(string(body)))
			h.metrics, h.err = readOperatorMetrics(ctx, &cl, m.Health)
		}
		out[i] = h
	}
	return out
}

// anyAnswered reports whether any operator answered /readyz at all.
func anyAnswered(hs []operatorHealth) bool {
	return slices.ContainsFunc(hs, func(h operatorHealth) bool { return h.answered })
}

// printHealth prints what probeOperators learned: records in, out and in
// flight, consumer lag, and the seconds each operator's stages were busy
// and held back by backpressure.
func printHealth(w io.Writer, hs []operatorHealth) {
	if len(hs) == 0 {
		return
	}
	fmt.Fprintln(w, "operators (/readyz, /metrics):")
	for _, h := range hs {
		m, state := h.member, h.ready
		if !h.answered {
			state = "not answering (stopped, or not started yet)"
		}
		if m.Restarts > 0 {
			state += fmt.Sprintf(" (restarted %d times by trajflow up)", m.Restarts)
		}
		fmt.Fprintf(w, "  %-10s pid %-7d http://%-21s %s\n", m.Stage, m.PID, m.Health, state)
		switch {
		case !h.answered:
		case h.err != nil:
			fmt.Fprintf(w, "  %-10s %v\n", "", h.err)
		default:
			fmt.Fprintf(w, "  %-10s %s\n", "", h.metrics)
		}
	}
}

// httpGet returns at most limit bytes of the body of a GET of url.
func httpGet(ctx context.Context, cl *http.Client, url string, limit int64) ([]byte, int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, 0, err
	}
	resp, err := cl.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, limit))
	return b, resp.StatusCode, err
}

// operatorMetrics is what status reads from an operator's /metrics, summed
// over its stages and their labels.
type operatorMetrics struct {
	in, out, inFlight, lag, busy, backpressure, quarantined float64
}

func (m operatorMetrics) String() string {
	return fmt.Sprintf("records in %.0f, out %.0f, in flight %.0f, consumer lag %.0f, busy %.1f s, backpressure %.1f s, quarantined %.0f",
		m.in, m.out, m.inFlight, m.lag, m.busy, m.backpressure, m.quarantined)
}

// maxMetricsBytes bounds the /metrics page status reads.
const maxMetricsBytes = 4 << 20

// readOperatorMetrics reads the /metrics of the operator process at addr.
func readOperatorMetrics(ctx context.Context, cl *http.Client, addr string) (operatorMetrics, error) {
	url := "http://" + addr + "/metrics"
	b, code, err := httpGet(ctx, cl, url, maxMetricsBytes)
	if err != nil {
		return operatorMetrics{}, fmt.Errorf("%s: %w", url, err)
	}
	if code != http.StatusOK {
		return operatorMetrics{}, fmt.Errorf("%s: HTTP %d", url, code)
	}
	m, err := parseOperatorMetrics(bytes.NewReader(b))
	if err != nil {
		return operatorMetrics{}, fmt.Errorf("%s: %w", url, err)
	}
	return m, nil
}

// parseOperatorMetrics reads the operator metrics status shows from a page
// in Prometheus's text format (pipeline/metrics.go names them). A page
// without trajflow_records_in_total is not an operator's.
func parseOperatorMetrics(r io.Reader) (operatorMetrics, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(r)
	if err != nil {
		return operatorMetrics{}, fmt.Errorf("not Prometheus's text format: %w", err)
	}
	if fams["trajflow_records_in_total"] == nil {
		return operatorMetrics{}, fmt.Errorf("no trajflow_records_in_total: not a trajflow operator's metrics")
	}
	sum := func(name string) float64 {
		var v float64
		for _, m := range fams[name].GetMetric() {
			switch {
			case m.Counter != nil:
				v += m.GetCounter().GetValue()
			case m.Gauge != nil:
				v += m.GetGauge().GetValue()
			case m.Untyped != nil:
				v += m.GetUntyped().GetValue()
			}
		}
		return v
	}
	return operatorMetrics{in: sum("trajflow_records_in_total"), out: sum("trajflow_records_out_total"),
		inFlight: sum("trajflow_in_flight_records"), lag: sum("trajflow_consumer_lag_records"),
		busy: sum("trajflow_stage_busy_seconds_total"), backpressure: sum("trajflow_backpressure_seconds_total"),
		quarantined: sum("trajflow_records_quarantined_total")}, nil
}
