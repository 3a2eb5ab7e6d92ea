package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
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
	// Restarts counts the times up started it again (fleetProcs).
	Restarts int `json:"restarts,omitempty"`
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

// upArgs is trajflow up's command line, checked.
type upArgs struct {
	cf           clientFlags
	path, out    string // --contract ("" the built-in), --out
	level, otlp  string
	rounds       int64
	healthPort   int
	evalSamples  int
	restarts     int
	wait, linger time.Duration
	clientConfig string // absolute path of --client-config, or ""
	contractPath string // absolute path of --contract, or ""
}

// parseUp reads and checks up's flags; a wrong one is named with its value.
func parseUp(args []string, stderr io.Writer) (*upArgs, error) {
	fs := newFlags("up", stderr)
	a := &upArgs{cf: addClientFlags(fs)}
	fs.StringVar(&a.path, "contract", "", "learning contract (default: the built-in demo contract)")
	fs.Int64Var(&a.rounds, "rounds", 0, "update rounds: the fleet ends once they are all decided and trained, and writes OUT/summary.json (0: run until interrupted)")
	fs.StringVar(&a.out, "out", filepath.Join("out", "fleet"), "output directory: releases/, snapshots/, state/, logs/NAME.log, fleet.json, summary.json")
	fs.IntVar(&a.healthPort, "health-port", 0, "first health port: the operators serve /healthz, /readyz and /metrics on 127.0.0.1:PORT, PORT+1, ... in the order printed (0: free ports)")
	fs.IntVar(&a.evalSamples, "eval-samples", 4, "attempts per task of every evaluation suite of the eval operator and the final report")
	fs.StringVar(&a.level, "log-level", "info", "operators' log level: debug, info, warn or error")
	fs.StringVar(&a.otlp, "otlp-endpoint", "", "every operator exports its spans over OTLP/HTTP to this URL, e.g. http://127.0.0.1:4318/v1/traces: one trace per attempt from dispatch to the update that trained it (default: OTEL_EXPORTER_OTLP_ENDPOINT, which the operators inherit, else no spans)")
	fs.DurationVar(&a.wait, "wait", time.Minute, "how long to wait for a broker at --brokers to answer")
	fs.DurationVar(&a.linger, "linger", 0, "every operator's --linger: "+lingerUsage)
	fs.IntVar(&a.restarts, "restarts", 5, "times an operator killed by a signal or failing at run time (exit status 1) is started again, after 1 s, 2 s, ... up to 30 s (-1: without bound; 0: never, the fleet stops)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return nil, err
	}
	if err := noArgs("up", pos); err != nil {
		return nil, err
	}
	if err := firstBad(
		flagCheck{a.rounds < 0, fmt.Sprintf("--rounds %d: want 0 (until interrupted) or more", a.rounds)},
		flagCheck{a.evalSamples < 1 || a.evalSamples > math.MaxInt32, fmt.Sprintf("--eval-samples %d: want 1 to %d", a.evalSamples, math.MaxInt32)},
		flagCheck{a.healthPort < 0 || a.healthPort > 65535, fmt.Sprintf("--health-port %d: want a port, 1 to 65535 (0: free ports)", a.healthPort)},
		flagCheck{a.linger < 0, fmt.Sprintf("--linger %v: want 0 or more", a.linger)},
		flagCheck{a.restarts < -1, fmt.Sprintf("--restarts %d: want -1 (without bound), 0 or more", a.restarts)},
		flagCheck{a.wait <= 0, fmt.Sprintf("--wait %v: want a positive duration", a.wait)},
	); err != nil {
		return nil, err
	}
	if _, err := logLevel(a.level); err != nil {
		return nil, err
	}
	if err := checkOTLP(a.otlp); err != nil {
		return nil, err
	}
	if err := checkOutDir("--out", a.out); err != nil {
		return nil, err
	}
	// Every operator reads the same client config (TLS and SASL settings;
	// the secrets stay in it, never on a command line or in fleet.json)
	// and contract, and status --out may run from another directory: both
	// are named by absolute paths.
	if *a.cf.config != "" {
		if a.clientConfig, err = filepath.Abs(*a.cf.config); err != nil {
			return nil, fmt.Errorf("up: --client-config: %w", err)
		}
	}
	if a.path != "" {
		if a.contractPath, err = filepath.Abs(a.path); err != nil {
			return nil, fmt.Errorf("up: --contract: %w", err)
		}
	}
	return a, nil
}

func cmdUp(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	a, err := parseUp(args, stderr)
	if err != nil {
		return err
	}
	cc, err := a.cf.load()
	if err != nil {
		return err
	}
	c, err := contractFlag(a.path, stderr)
	if err != nil {
		return err
	}
	if n := len(fleetStages(c)); a.healthPort > 0 && a.healthPort+n-1 > 65535 {
		return fmt.Errorf("%w: --health-port %d: the %d operators need ports %d to %d, past 65535", errUsage, a.healthPort, n, a.healthPort, a.healthPort+n-1)
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("up: the trajflow binary: %w", err)
	}
	if err := createTopics(ctx, cc, c, topicOptions{wait: a.wait}, io.Discard, stderr); err != nil {
		return err
	}
	if err := refuseUsedRun(ctx, cc, c); err != nil {
		return err
	}
	if err := clearFleetOut(a.out); err != nil {
		return err
	}
	f := &fleetProcs{exe: exe, out: a.out, brokers: strings.Join(cc.Brokers, ","), contract: a.contractPath, clientConfig: a.clientConfig,
		otlp: a.otlp, rounds: a.rounds, level: a.level, run: c.RunID, stdout: stdout,
		gated: gated(c), evalSamples: a.evalSamples, linger: a.linger, restarts: a.restarts}
	start := time.Now()
	fmt.Fprintf(stdout, "fleet of run %s on %s: %d rounds; logs in %s\n", c.RunID, f.brokers, a.rounds, filepath.Join(a.out, "logs"))
	for i, name := range fleetStages(c) {
		port := 0
		if a.healthPort > 0 {
			port = a.healthPort + i
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
	if a.rounds == 0 || ctx.Err() != nil {
		fmt.Fprintln(stdout, "fleet stopped")
		return nil
	}
	return writeFleetReport(ctx, loop.ReportConfig{Contract: c, Client: cc, Rounds: int(a.rounds), EvalSamples: int32(a.evalSamples)},
		start, a.out, stdout)
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

// fleetProcs is the operator processes of `trajflow up`, which it
// supervises: an operator killed by a signal (kill -9, the kernel's
// out-of-memory killer) or ending with a runtime failure (exit status 1)
// is started again with the same command line, at most restarts times
// (< 0: without bound), after a backoff; its state directory and the
// committed offsets of its group bring it back where it was, and what it
// had not committed is redelivered. An operator that ends with exit status
// 2 (a configuration it refuses, a command-line mistake, a panic) is not
// restarted: the same command would end the same way.
type fleetProcs struct {
	exe, out, brokers, contract, level, run string
	clientConfig                            string // absolute path, or ""
	otlp                                    string // --otlp-endpoint, or ""
	rounds                                  int64
	gated                                   bool // dispatch waits for the gate (fleetStages has eval and gate)
	evalSamples                             int
	linger                                  time.Duration // --linger of every operator, or 0
	restarts                                int           // restarts of one operator (< 0: without bound)
	backoff                                 time.Duration // before the first restart (default 1 s); doubles up to 30 s
	stdout                                  io.Writer

	mu      sync.Mutex // guards what follows: a restart replaces an operator's process
	members []fleetMember
	procs   []*exec.Cmd
	logs    []*os.File
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

// start starts the operator name with its health endpoints on port (0: a
// free one), appends it to the fleet and prints its line.
func (f *fleetProcs) start(name string, port int) error {
	if port == 0 {
		var err error
		if port, err = freeHealthPort(); err != nil {
			return fmt.Errorf("up: a health port for %s: %w", name, err)
		}
	}
	health := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	logPath := filepath.Join(f.out, "logs", name+".log")
	cmd, lf, err := f.spawn(name, health, logPath, os.O_TRUNC)
	if err != nil {
		return err
	}
	f.mu.Lock()
	f.procs = append(f.procs, cmd)
	f.logs = append(f.logs, lf)
	f.members = append(f.members, fleetMember{Stage: name, PID: cmd.Process.Pid, Health: health, Log: logPath})
	f.mu.Unlock()
	fmt.Fprintf(f.stdout, "  %-10s pid %-7d health http://%s  log %s\n", name, cmd.Process.Pid, health, logPath)
	return nil
}

// spawn starts the process of operator name, its output to logPath opened
// with mode (os.O_TRUNC for a new log, os.O_APPEND after a restart).
func (f *fleetProcs) spawn(name, health, logPath string, mode int) (*exec.Cmd, *os.File, error) {
	lf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|mode, 0o644)
	if err != nil {
		return nil, nil, fmt.Errorf("up: %w", err)
	}
	cmd := exec.Command(f.exe, f.args(name, health)...)
	cmd.Stdout, cmd.Stderr = lf, lf
	// Its own process group: a Ctrl-C at the terminal reaches up alone,
	// which interrupts every operator once (a second signal would stop
	// an operator at once: signalContext).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		lf.Close()
		return nil, nil, fmt.Errorf("up: start %s: %w", name, err)
	}
	return cmd, lf, nil
}

func (f *fleetProcs) writeMembers() error {
	f.mu.Lock()
	doc := fleetDoc{Run: f.run, Brokers: f.brokers, Contract: f.contract, ClientConfig: f.clientConfig, Rounds: f.rounds,
		Operators: slices.Clone(f.members)}
	f.mu.Unlock()
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return err
	}
	// Written whole under a temporary name, then renamed: status never
	// reads half a file.
	path := filepath.Join(f.out, FleetFile)
	if err := os.WriteFile(path+".tmp", append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("up: %w", err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		return fmt.Errorf("up: %w", err)
	}
	return nil
}

// stop interrupts every operator still running and waits for them.
func (f *fleetProcs) stop() {
	f.mu.Lock()
	defer f.mu.Unlock()
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

// restartable reports whether an operator's end calls for a restart: a
// signal killed it, it failed at run time (exit status 1), or the Go
// runtime crashed it (a panic or fatal error also exits 2, but its log
// does not end with the command's own error line, "trajflow run: ...",
// which a configuration error's does). log is the operator's log file.
func restartable(err error, log string) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return true
	}
	switch ee.ExitCode() {
	case 1:
		return true
	case 2:
		return !strings.HasPrefix(tail(log, 1), "trajflow ")
	}
	return false
}

// wait supervises every operator until all have exited. One that ends
// restartable is started again (fleetProcs), up to the budget; the first
// that fails for good stops the others and is the error, with the end of
// its log; ctx ending interrupts them all (a graceful stop).
func (f *fleetProcs) wait(ctx context.Context) error {
	type exit struct {
		i   int
		err error
	}
	exits := make(chan exit, len(f.procs))
	stopping := make(chan struct{}) // closed when the fleet stops: no more restarts
	var wg sync.WaitGroup
	for i := range f.procs {
		wg.Add(1)
		go func() { // owned by wait: it returns only after wg.Wait
			defer wg.Done()
			exits <- exit{i, f.supervise(i, stopping)}
		}()
	}
	defer func() {
		wg.Wait()
		f.mu.Lock()
		for _, l := range f.logs {
			l.Close()
		}
		f.mu.Unlock()
	}()
	var first error
	interrupted := false
	halt := func() {
		if !interrupted {
			interrupted = true
			close(stopping)
			f.signalAll()
		}
	}
	for left := len(f.procs); left > 0; {
		select {
		case <-ctx.Done():
			halt()
			continue
		case e := <-exits:
			left--
			f.mu.Lock()
			m := f.members[e.i]
			f.mu.Unlock()
			switch {
			case e.err == nil && interrupted:
				fmt.Fprintf(f.stdout, "  %-10s stopped\n", m.Stage)
			case e.err == nil:
				fmt.Fprintf(f.stdout, "  %-10s exited 0\n", m.Stage)
			case interrupted:
				fmt.Fprintf(f.stdout, "  %-10s stopped: %v\n", m.Stage, e.err)
			default:
				first = fmt.Errorf("up: operator %s (pid %d) failed: %w; the end of %s:\n%s", m.Stage, m.PID, e.err, m.Log, tail(m.Log, 15))
				halt()
			}
		}
	}
	return first
}

// supervise waits for operator i and restarts it while its end is
// restartable, the budget lasts and the fleet is not stopping; it returns
// the last process's end (nil: exit status 0).
func (f *fleetProcs) supervise(i int, stopping <-chan struct{}) error {
	backoff := cmp.Or(f.backoff, time.Second)
	for n := 1; ; n++ {
		f.mu.Lock()
		p := f.procs[i]
		f.mu.Unlock()
		err := p.Wait()
		f.mu.Lock()
		m := f.members[i]
		f.mu.Unlock()
		if err == nil || !restartable(err, m.Log) || (f.restarts >= 0 && n > f.restarts) {
			return err
		}
		fmt.Fprintf(f.stdout, "  %-10s pid %d ended (%v); restarting it in %v (restart %d%s)\n", m.Stage, m.PID, err, backoff, n, f.budget())
		t := time.NewTimer(backoff)
		select {
		case <-stopping:
			t.Stop()
			return err
		case <-t.C:
		}
		backoff = min(2*backoff, 30*time.Second)
		if err := f.restart(i, err, stopping); err != nil {
			return err
		}
	}
}

// budget is " of N" for a bounded restart budget.
func (f *fleetProcs) budget() string {
	if f.restarts < 0 {
		return ""
	}
	return " of " + strconv.Itoa(f.restarts)
}

// restart starts operator i again after its process ended with ended,
// appending to its log, and records the new pid in fleet.json. A fleet
// that began stopping meanwhile interrupts the new process at once.
func (f *fleetProcs) restart(i int, ended error, stopping <-chan struct{}) error {
	f.mu.Lock()
	m := f.members[i]
	f.mu.Unlock()
	if lf, err := os.OpenFile(m.Log, os.O_WRONLY|os.O_APPEND, 0o644); err == nil {
		fmt.Fprintf(lf, "--- trajflow up: pid %d ended (%v); started again\n", m.PID, ended)
		lf.Close()
	}
	cmd, lf, err := f.spawn(m.Stage, m.Health, m.Log, os.O_APPEND)
	if err != nil {
		return err
	}
	f.mu.Lock()
	f.logs[i].Close()
	f.procs[i], f.logs[i] = cmd, lf
	f.members[i].PID = cmd.Process.Pid
	f.members[i].Restarts++
	select {
	case <-stopping: // halt closed it before signalAll, which waits for mu
		_ = cmd.Process.Signal(syscall.SIGINT)
	default:
	}
	f.mu.Unlock()
	fmt.Fprintf(f.stdout, "  %-10s pid %-7d restarted\n", m.Stage, cmd.Process.Pid)
	return f.writeMembers()
}

// signalAll interrupts every operator (one that exited already ignores
// it: its process is waited for by supervise).
func (f *fleetProcs) signalAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, p := range f.procs {
		_ = p.Process.Signal(syscall.SIGINT)
	}
}

// tail is the last n lines of the file at path (of its last 64 KiB).
func tail(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > 64<<10 {
		if _, err := f.Seek(st.Size()-64<<10, io.SeekStart); err != nil {
			return err.Error()
		}
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
