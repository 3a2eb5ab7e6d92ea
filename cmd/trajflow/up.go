package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

func init() {
	register("up", "up --brokers ADDR [--contract FILE] --rounds N --out DIR: start a whole fleet of a run on an existing cluster and wait for its end", cmdUp)
}

// FleetFile is OUT/fleet.json: the operators `trajflow up` started
// (`trajflow status --out DIR` checks their health).
const FleetFile = "fleet.json"

// fleetDoc is OUT/fleet.json.
type fleetDoc struct {
	Run      string `json:"run"`
	Brokers  string `json:"brokers"`
	Contract string `json:"contract,omitempty"` // the --contract file ("": the built-in demo contract)
	// ClientConfig is the absolute path of the --client-config file (TLS,
	// SASL) every operator was started with; "" on a plaintext cluster.
	ClientConfig string        `json:"client_config,omitempty"`
	Rounds       int64         `json:"rounds"`
	Operators    []fleetMember `json:"operators"`
}

// fleetMember is one operator of fleet.json.
type fleetMember struct {
	Stage  string `json:"stage"`
	PID    int    `json:"pid"`
	Health string `json:"health"` // host:port of /healthz, /readyz, /metrics
	Log    string `json:"log"`
}

// fleetStages are the operators of a run of c: the loop's; the
// evaluation plane and the gate when rollout runs the built-in policy
// (the plane runs it in process), weight sync when it generates on policy
// servers; and the snapshotter.
func fleetStages(c *contract.Contract) []string {
	stages := append([]string{}, loop.Stages...)
	for _, st := range []string{"eval", "gate", "weightsync"} {
		if operators.Needed(st, c) {
			stages = append(stages, st)
		}
	}
	return append(stages, pipeline.SnapshotStage)
}

// gated reports whether a fleet of c runs the eval and gate operators
// (dispatch then waits for the ruling on every release).
func gated(c *contract.Contract) bool { return operators.Needed("gate", c) }

func cmdUp(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("up", stderr)
	cf := addClientFlags(fs)
	path := fs.String("contract", "", "learning contract (default: the built-in demo contract)")
	rounds := fs.Int64("rounds", 0, "update rounds: the fleet ends once they are all decided and trained, and writes OUT/summary.json (0: run until interrupted)")
	out := fs.String("out", filepath.Join("out", "fleet"), "output directory: releases/, snapshots/, state/, logs/NAME.log, fleet.json, summary.json")
	healthPort := fs.Int("health-port", 0, "first health port: the operators serve /healthz, /readyz and /metrics on 127.0.0.1:PORT, PORT+1, ... in the order printed (0: free ports)")
	evalSamples := fs.Int("eval-samples", 4, "attempts per task of every evaluation suite of the eval operator and the final report")
	level := fs.String("log-level", "info", "operators' log level")
	otlp := fs.String("otlp-endpoint", "", "every operator exports its spans over OTLP/HTTP to this URL, e.g. http://127.0.0.1:4318/v1/traces: one trace per attempt from dispatch to the update that trained it (default: OTEL_EXPORTER_OTLP_ENDPOINT, which the operators inherit, else no spans)")
	wait := fs.Duration("wait", time.Minute, "how long to wait for a broker at --brokers to answer")
	linger := fs.Duration("linger", 0, "every operator's --linger: "+lingerUsage)
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return fmt.Errorf("%w: trajflow up takes no arguments (got %q)", errUsage, pos)
	}
	if *rounds < 0 || *evalSamples < 1 || *healthPort < 0 || *healthPort > 65535 || *linger < 0 {
		return fmt.Errorf("%w: --rounds must be >= 0, --eval-samples >= 1, --health-port a port, --linger >= 0", errUsage)
	}
	cc, err := cf.load()
	if err != nil {
		return err
	}
	clientConfig := ""
	if *cf.config != "" {
		// Every operator reads the same file (TLS and SASL settings; the
		// secrets stay in it, never on a command line or in fleet.json).
		if clientConfig, err = filepath.Abs(*cf.config); err != nil {
			return fmt.Errorf("up: --client-config: %w", err)
		}
	}
	c, err := contractFlag(*path, stderr)
	if err != nil {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("up: the trajflow binary: %w", err)
	}
	if err := createTopics(ctx, cc, c, topicOptions{wait: *wait}, io.Discard, stderr); err != nil {
		return err
	}
	if err := refuseUsedRun(ctx, cc, c); err != nil {
		return err
	}
	if err := clearFleetOut(*out); err != nil {
		return err
	}
	f := &fleetProcs{exe: exe, out: *out, brokers: strings.Join(cc.Brokers, ","), contract: *path, clientConfig: clientConfig, otlp: *otlp, rounds: *rounds, level: *level, run: c.RunID, stdout: stdout,
		gated: gated(c), evalSamples: *evalSamples, linger: *linger}
	start := time.Now()
	fmt.Fprintf(stdout, "fleet of run %s on %s: %d rounds; logs in %s\n", c.RunID, f.brokers, *rounds, filepath.Join(*out, "logs"))
	for i, name := range fleetStages(c) {
		port := 0
		if *healthPort > 0 {
			port = *healthPort + i
		}
		if err := f.start(name, port); err != nil {
			f.stop()
			return err
		}
	}
	if err := f.writeMembers(); err != nil {
		f.stop()
		return err
	}
	if err := f.wait(ctx); err != nil {
		return err
	}
	if *rounds == 0 || ctx.Err() != nil {
		fmt.Fprintln(stdout, "fleet stopped")
		return nil
	}
	return writeFleetReport(ctx, loop.ReportConfig{Contract: c, Client: cc, Rounds: int(*rounds), EvalSamples: int32(*evalSamples)},
		start, *out, stdout)
}

// clearFleetOut removes what an earlier fleet left in out (releases,
// snapshots, operator state, logs, the summary) and creates out/logs.
func clearFleetOut(out string) error {
	for _, d := range []string{"releases", "snapshots", "state", "logs"} {
		if err := os.RemoveAll(filepath.Join(out, d)); err != nil {
			return fmt.Errorf("up: clear %s: %w", filepath.Join(out, d), err)
		}
	}
	_ = os.Remove(filepath.Join(out, loop.SummaryFile))
	if err := os.MkdirAll(filepath.Join(out, "logs"), 0o755); err != nil {
		return fmt.Errorf("up: %w", err)
	}
	return nil
}

// writeFleetReport writes the ended fleet's summary (loop.FleetReport) to
// out/summary.json and prints its line.
func writeFleetReport(ctx context.Context, rc loop.ReportConfig, start time.Time, out string, stdout io.Writer) error {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	s, err := loop.FleetReport(rctx, rc)
	if err != nil {
		return fmt.Errorf("up: final report: %w", err)
	}
	s.WallSeconds = time.Since(start).Seconds()
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	sp := filepath.Join(out, loop.SummaryFile)
	if err := os.WriteFile(sp, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("up: %w", err)
	}
	fmt.Fprintln(stdout, loop.SummaryLine(s, sp))
	return nil
}

// refuseUsedRun refuses a run whose tasks topic already holds records:
// record ids derive from the run id, so a second run under it would be
// deduplicated against the first, and its end would be counted wrong.
func refuseUsedRun(ctx context.Context, cc kafka.ClientConfig, c *contract.Contract) error {
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return err
	}
	dialer, err := cc.Dialer()
	if err != nil {
		return err
	}
	used := false
	err = pipeline.ScanTail(ctx, &pipeline.Config{Brokers: cc.Brokers, Dialer: dialer}, topics.Tasks, 1, func(pipeline.Message) error {
		used = true
		return nil
	})
	if err != nil {
		return fmt.Errorf("up: read %s: %w", topics.Tasks, err)
	}
	if used {
		return fmt.Errorf("%w: run %q already has records on %s: start it on an empty cluster, or give the contract another run_id", errUsage, c.RunID, topics.Tasks)
	}
	return nil
}

// fleetProcs is the operator processes of `trajflow up`.
type fleetProcs struct {
	exe, out, brokers, contract, level, run string
	clientConfig                            string // absolute path, or ""
	otlp                                    string // --otlp-endpoint, or ""
	rounds                                  int64
	gated                                   bool // dispatch waits for the gate (fleetStages has eval and gate)
	evalSamples                             int
	linger                                  time.Duration // --linger of every operator, or 0
	stdout                                  io.Writer
	members                                 []fleetMember
	procs                                   []*exec.Cmd
	logs                                    []*os.File
}

// freeHealthPort returns a port of 127.0.0.1 nothing listens on now (an
// operator whose port is taken by then serves on another and says so in
// its log).
func freeHealthPort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// args is the command line of the fleet's operator name, serving its
// health endpoints on health.
func (f *fleetProcs) args(name, health string) []string {
	args := []string{"run", name, "--brokers", f.brokers, "--rounds", strconv.FormatInt(f.rounds, 10),
		"--releases", filepath.Join(f.out, "releases"), "--state", filepath.Join(f.out, "state", name),
		"--health", health, "--log-level", f.level, "--restarts", "-1"}
	if f.contract != "" {
		args = append(args, "--contract", f.contract)
	}
	if f.clientConfig != "" {
		args = append(args, "--client-config", f.clientConfig)
	}
	if f.otlp != "" {
		args = append(args, "--otlp-endpoint", f.otlp)
	}
	if f.linger > 0 {
		args = append(args, "--linger", f.linger.String())
	}
	switch name {
	case pipeline.SnapshotStage:
		args = append(args, "--snapshot-dir", filepath.Join(f.out, "snapshots"))
	case "dispatch":
		if f.gated {
			args = append(args, "--gated")
		}
	case "eval":
		args = append(args, "--eval-samples", strconv.Itoa(f.evalSamples))
	}
	return args
}

func (f *fleetProcs) start(name string, port int) error {
	if port == 0 {
		var err error
		if port, err = freeHealthPort(); err != nil {
			return fmt.Errorf("up: a health port for %s: %w", name, err)
		}
	}
	health := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	args := f.args(name, health)
	logPath := filepath.Join(f.out, "logs", name+".log")
	lf, err := os.Create(logPath)
	if err != nil {
		return fmt.Errorf("up: %w", err)
	}
	cmd := exec.Command(f.exe, args...)
	cmd.Stdout, cmd.Stderr = lf, lf
	if err := cmd.Start(); err != nil {
		lf.Close()
		return fmt.Errorf("up: start %s: %w", name, err)
	}
	f.procs = append(f.procs, cmd)
	f.logs = append(f.logs, lf)
	f.members = append(f.members, fleetMember{Stage: name, PID: cmd.Process.Pid, Health: health, Log: logPath})
	fmt.Fprintf(f.stdout, "  %-10s pid %-7d health http://%s  log %s\n", name, cmd.Process.Pid, health, logPath)
	return nil
}

func (f *fleetProcs) writeMembers() error {
	doc := fleetDoc{Run: f.run, Brokers: f.brokers, Contract: f.contract, ClientConfig: f.clientConfig, Rounds: f.rounds, Operators: f.members}
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(f.out, FleetFile), append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("up: %w", err)
	}
	return nil
}

// stop interrupts every operator still running and waits for them.
func (f *fleetProcs) stop() {
	for _, p := range f.procs {
		if p.ProcessState == nil {
			_ = p.Process.Signal(syscall.SIGINT)
		}
	}
	for i, p := range f.procs {
		if p.ProcessState == nil {
			_ = p.Wait()
		}
		f.logs[i].Close()
	}
}

// wait waits until every operator exited. The first that fails stops the
// others and is the error, with the end of its log; ctx ending interrupts
// them all (a graceful stop).
func (f *fleetProcs) wait(ctx context.Context) error {
	type exit struct {
		i   int
		err error
	}
	exits := make(chan exit, len(f.procs))
	for i, p := range f.procs {
		go func() { exits <- exit{i, p.Wait()} }()
	}
	defer func() {
		for _, l := range f.logs {
			l.Close()
		}
	}()
	var first error
	interrupted := false
	for left := len(f.procs); left > 0; {
		select {
		case <-ctx.Done():
			if !interrupted {
				interrupted = true
				f.signalAll()
			}
			continue
		case e := <-exits:
			left--
			m := f.members[e.i]
			if e.err == nil {
				fmt.Fprintf(f.stdout, "  %-10s exited 0\n", m.Stage)
				continue
			}
			if first == nil && !interrupted {
				first = fmt.Errorf("up: operator %s (pid %d) failed: %w; the end of %s:\n%s", m.Stage, m.PID, e.err, m.Log, tail(m.Log, 15))
				interrupted = true
				f.signalAll()
			}
		}
	}
	return first
}

// signalAll interrupts every operator (one that exited already ignores
// it: its process is waited for by wait's goroutines).
func (f *fleetProcs) signalAll() {
	for _, p := range f.procs {
		_ = p.Process.Signal(syscall.SIGINT)
	}
}

// tail is the last n lines of the file at path.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
