package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

func init() {
	register("status", "status [--out DIR | --brokers ADDR --contract FILE]: where a run stands: rounds, updates, lag per consumer group, quarantine, last release, operators' health", cmdStatus)
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
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	doc, err := readFleetDoc(*out)
	if err != nil {
		return err
	}
	if *out != "" {
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
	printProgress(stdout, p, *rounds, max(1, c.Dispatch.GroupsPerUpdate), want)
	if err := printGroupLag(sctx, stdout, cc, c.RunID, topics, fleetStages(c)); err != nil {
		return err
	}
	if err := printQuarantine(sctx, stdout, cfg, topics.Quarantine); err != nil {
		return err
	}
	printHealth(ctx, stdout, doc.Operators)
	return nil
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
		if p.done() {
			state = "done"
		}
		fmt.Fprintf(stdout, "rounds:     %d of %d decided (%d of %d groups), %s\n", p.Decided/perRound, rounds, p.Decided, want, state)
	} else {
		fmt.Fprintf(stdout, "rounds:     %d decided (%d groups; no round limit given)\n", p.Decided/perRound, p.Decided)
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
		if !committed {
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

// printHealth asks every operator of fleet.json for /readyz.
func printHealth(ctx context.Context, w io.Writer, ops []fleetMember) {
	if len(ops) == 0 {
		return
	}
	fmt.Fprintln(w, "operators (/readyz):")
	cl := http.Client{Timeout: 2 * time.Second}
	for _, m := range ops {
		state := ""
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+m.Health+"/readyz", nil)
		if err == nil {
			var resp *http.Response
			if resp, err = cl.Do(req); err == nil {
				b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
				resp.Body.Close()
				state = fmt.Sprintf("%d %s", resp.StatusCode, strings.TrimSpace(string(b)))
			}
		}
		if err != nil {
			state = "not answering (stopped, or not started yet)"
		}
		fmt.Fprintf(w, "  %-10s pid %-7d http://%-21s %s\n", m.Stage, m.PID, m.Health, state)
	}
}
