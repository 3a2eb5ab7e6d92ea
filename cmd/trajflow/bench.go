package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/pprof"
	"strings"
	"time"

	"golang.org/x/term"

	"github.com/trajflow/trajflow/bench"
	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/pipeline/contract"
)

func init() {
	register("bench", "measure throughput of validate→reward→advantage→pack beside raw kafka-go (bench peers: beside Ray, ZeroMQ, raw clients; bench loop: the RL loop sync vs async under latency)", cmdBench)
}

// benchFlags are the flags of trajflow bench.
type benchFlags struct {
	contract, brokers, clientConfig            *string
	duration, warmup, baseline, linger         *time.Duration
	tokens, memLimit                           *int64
	baselineRate, meanTokens                   *float64
	instances, jsonOut, plot, cpuProf, memProf *string
	dataDir                                    *string
	tcpOnly, keepTopics                        *bool
	inflight, maxTokens                        *int
	asJSON, processes, cpuRoles                *bool
	cpuPids                                    *string
	logLevel, baselines, kill                  *string
	killAt                                     *time.Duration
}

func addBenchFlags(fs *flag.FlagSet) benchFlags {
	return benchFlags{
		contract:     fs.String("contract", "testdata/contracts/bench.yaml", "learning contract (sized for throughput)"),
		brokers:      fs.String("brokers", "", "comma-separated brokers of a real cluster (empty: embedded broker); the run's own topics are deleted when it ends"),
		keepTopics:   fs.Bool("keep-topics", false, "with --brokers: leave the run's topics on the cluster (they hold gigabytes until their retention ends)"),
		clientConfig: fs.String("client-config", "", "YAML file with TLS/SASL client settings"),
		duration:     fs.Duration("duration", 10*time.Second, "measurement window"),
		warmup:       fs.Duration("warmup", 3*time.Second, "warm-up before the measurement"),
		tokens:       fs.Int64("tokens", 0, "end the measurement after this many generated tokens are decided (0: --duration only)"),
		baseline:     fs.Duration("baseline", 0, "raw kafka-go baseline duration (0: a third of --duration, at least 2s; negative: skip)"),
		baselineRate: fs.Float64("baseline-rate", 0, "pace the baseline's producer to this many messages/s (0: unpaced); at the pipeline's per-hop message rate it measures the Kafka side's cost per byte at that rate"),
		instances:    fs.String("instances", "", "instances per stage in one consumer group, e.g. validate=2,reward=2"),
		linger:       fs.Duration("linger", 0, "operators' producer batch timeout (0: the runtime default)"),
		inflight:     fs.Int("inflight-groups", 192, "groups produced but not yet decided (closed loop)"),
		meanTokens:   fs.Float64("mean-tokens", 1000, "mean tokens per trajectory (log-normal)"),
		maxTokens:    fs.Int("max-tokens", 32768, "tail of the token-length distribution"),
		asJSON:       fs.Bool("json", false, "print the report as JSON"),
		jsonOut:      fs.String("json-out", "", "also write the JSON report to this file"),
		plot:         fs.String("plot", "", "write throughput per stage and the latency distribution to this PNG"),
		cpuProf:      fs.String("cpuprofile", "", "write a CPU profile of the whole run to this file"),
		cpuRoles:     fs.Bool("cpu-roles", false, "profile the CPU of each measured window (pipeline, baselines) and report it by role (broker, each stage, source, sink, raw client) in ms per MB moved; not with --cpuprofile or --processes"),
		memProf:      fs.String("memprofile", "", "write a heap profile taken at the end of the measurement window to this file"),
		memLimit:     fs.Int64("memory-limit-mib", 0, "Go soft memory limit of the bench process in MiB (broker, operators, source and sink share one heap); 0: derived from the embedded broker's retention unless GOMEMLIMIT is set; -1: leave it as it is"),
		logLevel:     fs.String("log-level", "error", "operator log level (logs go to stderr)"),
		baselines:    fs.String("baselines", "kafka-go", "raw baselines to run before the pipeline, comma-separated: kafka-go, franz-go (the ratios use kafka-go)"),
		processes:    fs.Bool("processes", false, "run every operator as a child process (trajflow run STAGE) instead of in this process"),
		kill:         fs.String("kill", "", "with --processes: SIGKILL this stage's process once in the window and restart it (the accounting shows what it cost)"),
		killAt:       fs.Duration("kill-at", 0, "when --kill strikes, into the window (0: half of --duration)"),
		dataDir:      fs.String("data-dir", "", "persist the embedded broker's log to this empty directory (as trajflow broker --data): its segments live in files, not in the bench process's heap"),
		tcpOnly:      fs.Bool("tcp-only", false, "start the embedded broker without its local socket: clients reach it over loopback TCP (as trajflow broker --tcp-only)"),
		cpuPids:      fs.String("cpu-pids", "", "comma-separated pids of other local processes whose CPU time the CPU figures add (a broker's JVM)"),
	}
}

// check refuses bench's flag values that mean nothing, and flags given
// where they do nothing, before anything starts.
func (f benchFlags) check(fs *flag.FlagSet) error {
	if err := firstBad(
		flagCheck{*f.duration <= 0, fmt.Sprintf("--duration %v: want a positive window", *f.duration)},
		flagCheck{*f.warmup < 0, fmt.Sprintf("--warmup %v: want 0 or more", *f.warmup)},
		flagCheck{*f.tokens < 0, fmt.Sprintf("--tokens %d: want 0 (--duration only) or more", *f.tokens)},
		flagCheck{*f.linger < 0, fmt.Sprintf("--linger %v: want 0 (the runtime default) or more", *f.linger)},
		flagCheck{*f.inflight < 1, fmt.Sprintf("--inflight-groups %d: want 1 or more", *f.inflight)},
		flagCheck{*f.maxTokens < 1, fmt.Sprintf("--max-tokens %d: want 1 or more", *f.maxTokens)},
		flagCheck{*f.killAt < 0, fmt.Sprintf("--kill-at %v: want 0 (half of --duration) or more", *f.killAt)},
		flagCheck{*f.memLimit < -1, fmt.Sprintf("--memory-limit-mib %d: want -1 (leave it), 0 (derived) or more", *f.memLimit)},
		flagCheck{isSet(fs, "baselines") && strings.TrimSpace(*f.baselines) == "",
			`--baselines "": name kafka-go, franz-go or both (--baseline -1s runs none)`},
	); err != nil {
		return err
	}
	if err := checkFinite("--mean-tokens", *f.meanTokens, 0, true); err != nil {
		return err
	}
	if err := onlyWith(fs, *f.baseline >= 0, "a setting of the baselines, which a negative --baseline skips", "baselines", "baseline-rate"); err != nil {
		return err
	}
	if err := onlyWith(fs, *f.kill != "", "needs --kill", "kill-at"); err != nil {
		return err
	}
	if err := onlyWith(fs, *f.brokers == "", "is for the embedded broker, not --brokers", "tcp-only", "data-dir"); err != nil {
		return err
	}
	if *f.dataDir != "" {
		if err := checkOutDir("--data-dir", *f.dataDir); err != nil {
			return err
		}
	}
	for _, o := range []struct{ name, path string }{{"--json-out", *f.jsonOut}, {"--plot", *f.plot},
		{"--cpuprofile", *f.cpuProf}, {"--memprofile", *f.memProf}} {
		if err := checkOutFile(o.name, o.path); err != nil {
			return err
		}
	}
	return nil
}

// config resolves the flags into the bench's configuration.
func (f benchFlags) config(stderr io.Writer) (bench.Config, error) {
	limit := *f.memLimit
	if limit > 0 {
		limit <<= 20
	}
	c, err := contract.Load(*f.contract)
	if err != nil {
		return bench.Config{}, fmt.Errorf("%w: --contract: %w", errUsage, err)
	}
	if err := c.Resolve(); err != nil {
		return bench.Config{}, fmt.Errorf("%w: --contract %s: %w", errUsage, *f.contract, err)
	}
	inst, err := bench.ParseInstances(*f.instances)
	if err != nil {
		return bench.Config{}, fmt.Errorf("%w: --instances: %v", errUsage, err)
	}
	log, err := newLogger(stderr, *f.logLevel)
	if err != nil {
		return bench.Config{}, err
	}
	cfg := bench.Config{
		Contract: c, Warmup: *f.warmup, Duration: *f.duration, Tokens: *f.tokens, Baseline: *f.baseline, BaselineRate: *f.baselineRate,
		Instances: inst, InFlightGroups: *f.inflight, MemoryLimit: limit, DataDir: *f.dataDir, TCPOnly: *f.tcpOnly, Logger: log, BatchTimeout: *f.linger,
	}
	if cfg.Baselines, err = listFlag("--baselines", *f.baselines); err != nil {
		return bench.Config{}, err
	}
	cfg.Kill, cfg.KillAt = *f.kill, *f.killAt
	if *f.cpuRoles && *f.cpuProf != "" {
		return bench.Config{}, fmt.Errorf("%w: --cpu-roles profiles each measured window, --cpuprofile the whole run: Go runs one CPU profile at a time, give one of them", errUsage)
	}
	cfg.CPURoles = *f.cpuRoles
	if *f.keepTopics && *f.brokers == "" {
		return bench.Config{}, fmt.Errorf("%w: --keep-topics goes with --brokers (the embedded broker ends with the run)", errUsage)
	}
	cfg.KeepTopics = *f.keepTopics
	pids, err := listFlag("--cpu-pids", *f.cpuPids)
	if err != nil {
		return bench.Config{}, err
	}
	if cfg.CPUPids, err = bench.ParsePids(strings.Join(pids, ",")); err != nil {
		return bench.Config{}, fmt.Errorf("%w: --cpu-pids: %v", errUsage, err)
	}
	if err := f.clientAndProcesses(&cfg); err != nil {
		return bench.Config{}, err
	}
	s := synth.Bench()
	s.MeanTokens, s.MaxTokens = *f.meanTokens, *f.maxTokens
	cfg.Synth = s
	if err := cfg.Validate(); err != nil {
		return bench.Config{}, fmt.Errorf("%w: %w", errUsage, err)
	}
	return cfg, nil
}

// clientAndProcesses sets the cluster of --brokers and --client-config
// and, with --processes, the operators' command.
func (f benchFlags) clientAndProcesses(cfg *bench.Config) error {
	if *f.processes {
		bin, err := os.Executable()
		if err != nil {
			return fmt.Errorf("--processes: %w", err)
		}
		var extra []string
		if *f.clientConfig != "" {
			extra = []string{"--client-config", *f.clientConfig}
		}
		cfg.Processes = bench.TrajflowRun(bin, *f.contract, time.Second, 2*time.Second, extra...)
	}
	if *f.brokers != "" || *f.clientConfig != "" {
		cc, err := clientFlags{brokers: f.brokers, config: f.clientConfig}.load()
		if err != nil {
			return err
		}
		cfg.Brokers, cfg.Client = cc.Brokers, cc
	}
	return nil
}

func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "peers" {
		return cmdBenchPeers(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "peers-zmq" {
		return cmdBenchPeersZmq(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "loop" {
		return cmdBenchLoop(ctx, args[1:], stdout, stderr)
	}
	fs := newFlags("bench", stderr)
	f := addBenchFlags(fs)
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if err := noArgs("bench", pos); err != nil {
		return err
	}
	if err := f.check(fs); err != nil {
		return err
	}
	cfg, err := f.config(stderr)
	if err != nil {
		return err
	}
	var bar *progressBar
	if fl, ok := stdout.(*os.File); ok && term.IsTerminal(int(fl.Fd())) {
		bar = &progressBar{w: stdout}
		cfg.Progress = bar.update
	}
	stopProfiles, memErr, err := startProfiles(&cfg, *f.cpuProf, *f.memProf)
	if err != nil {
		return err
	}
	rep, err := bench.Run(ctx, cfg)
	stopProfiles()
	if err == nil && *memErr != nil {
		err = fmt.Errorf("heap profile: %w", *memErr)
	}
	if bar != nil {
		bar.clear()
	}
	if err != nil {
		return err
	}
	if err := writeBenchReport(rep, f, stdout); err != nil {
		return err
	}
	if !rep.Correct {
		return fmt.Errorf("accounting failed: %v", rep.Accounting)
	}
	return nil
}

// startProfiles starts the CPU profile (stopped by stop) and arranges the
// heap profile at the end of the measurement window (its error in *memErr).
func startProfiles(cfg *bench.Config, cpu, mem string) (stop func(), memErr *error, err error) {
	memErr = new(error)
	if stop, err = startCPUProfile(cpu); err != nil {
		return nil, nil, err
	}
	if mem != "" {
		cfg.Measured = func() {
			f, err := os.Create(mem)
			if err != nil {
				*memErr = err
				return
			}
			defer f.Close()
			runtime.GC()
			*memErr = pprof.WriteHeapProfile(f)
		}
	}
	return stop, memErr, nil
}

// startCPUProfile starts a CPU profile written to path (none when path is
// empty); stop ends it and closes the file.
func startCPUProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("cpu profile %s: %w", path, err)
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}

// writeBenchReport writes the plot and the JSON file when asked, and the
// report as a table or JSON.
func writeBenchReport(rep *bench.Report, f benchFlags, stdout io.Writer) error {
	if *f.plot != "" {
		if err := bench.WritePlot(rep, *f.plot); err != nil {
			return err
		}
	}
	if *f.jsonOut != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(*f.jsonOut, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	if *f.asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	return rep.WriteTable(stdout)
}

// progressBar draws one line, rewritten in place.
type progressBar struct {
	w     io.Writer
	width int
}

func (p *progressBar) update(pr bench.Progress) {
	frac := 0.0
	if pr.Total > 0 {
		frac = min(float64(pr.Elapsed)/float64(pr.Total), 1)
	}
	const n = 30
	done := int(frac * n)
	line := fmt.Sprintf("%-8s [%s%s] %5.1fs / %.1fs", pr.Phase, strings.Repeat("=", done), strings.Repeat(" ", n-done),
		pr.Elapsed.Seconds(), pr.Total.Seconds())
	if pr.TokensPerS > 0 {
		line += fmt.Sprintf("  %.2fM tokens/s", pr.TokensPerS/1e6)
	}
	p.width = max(p.width, len(line))
	fmt.Fprintf(p.w, "\r%-*s", p.width, line)
}

func (p *progressBar) clear() {
	if p.width > 0 {
		fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", p.width))
	}
}
