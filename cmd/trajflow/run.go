package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
)

func init() {
	register("run", "run NAME: run one operator of a run (run --help lists the stages)", cmdRun)
}

// operatorFlags configure one operator process.
type operatorFlags struct {
	client   clientFlags
	contract *string
	stateDir *string
	instance *string
	health   *string
	level    *string
	partial  *time.Duration
	maxWait  *time.Duration
	snapshot *string
	releases *string
	rounds   *int64
	snapRoll *int64
	snapAge  *time.Duration
	device   *string
	restarts *int
	otlp     *string
	gated    *bool
	samples  *int
	linger   *time.Duration
	envSvc   envFlags
}

func addOperatorFlags(fs *flag.FlagSet) operatorFlags {
	return operatorFlags{
		client:   addClientFlags(fs),
		contract: fs.String("contract", "", "learning contract (default: the built-in demo contract)"),
		stateDir: fs.String("state", "", "local state directory (default: a temporary directory; state is rebuilt from the topics when lost)"),
		instance: fs.String("instance", "", "instance name in logs and metrics (default: host-pid)"),
		health:   fs.String("health", "127.0.0.1:0", "address of /healthz, /readyz and /metrics"),
		level:    fs.String("log-level", "info", "log level: debug, info, warn or error"),
		partial:  fs.Duration("partial-group-timeout", 0, "close incomplete groups after this long (advantage; 0: wait)"),
		maxWait:  fs.Duration("window-max-wait", 0, "close a non-full pack window after this long (pack; 0: wait)"),
		snapshot: fs.String("snapshot-dir", "", "directory of the Parquet snapshots (snapshot)"),
		releases: fs.String("releases", "", "policy releases directory: train writes them; rollout, eval, gate and weightsync read them"),
		rounds:   fs.Int64("rounds", 0, "update rounds of the run: dispatch launches this many; every operator given it exits 0 once every round is decided and trained and its inputs are drained (0: run until stopped)"),
		snapRoll: fs.Int64("snapshot-roll-bytes", 0, "close a snapshot file at this many bytes (snapshot; 0: 64 MiB)"),
		snapAge:  fs.Duration("snapshot-roll-interval", 0, "close a snapshot file this long after its first message (snapshot; 0: 30s)"),
		device:   fs.String("device", "cpu", "the train stage's backend: cpu, cuda or cuda:N (GPU N; a build with the cuda tag)"),
		restarts: fs.Int("restarts", -1, "restart the operator in place after a fatal error at most this many times (-1: always); configuration errors are never retried"),
		otlp:     fs.String("otlp-endpoint", "", "export a span per processed record over OTLP/HTTP to this URL, e.g. http://127.0.0.1:4318/v1/traces (default: OTEL_EXPORTER_OTLP_ENDPOINT when set, else no spans)"),
		gated:    fs.Bool("gated", false, "launch a round at a release only once the gate ruled on it (dispatch, in a fleet with the eval and gate operators)"),
		samples:  fs.Int("eval-samples", 4, "attempts per task of every evaluation suite (eval)"),
		linger:   fs.Duration("linger", 0, lingerUsage),
		envSvc:   addEnvFlags(fs),
	}
}

// stageList lists every registered stage with its one-line doc.
func stageList() string {
	var b strings.Builder
	for _, s := range operators.Specs() {
		fmt.Fprintf(&b, "  %-10s %s\n", s.Name, s.Doc)
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// operatorEnv resolves an operator's configuration.
type operatorEnv struct {
	deps    operators.Deps
	cfg     pipeline.Config
	cleanup func()
}

// stageFlags are the flags of run that one stage alone reads: another
// stage refuses them rather than ignore them.
var stageFlags = map[string][]string{
	"advantage": {"partial-group-timeout"},
	"pack":      {"window-max-wait"},
	"snapshot":  {"snapshot-dir", "snapshot-roll-bytes", "snapshot-roll-interval"},
	"dispatch":  {"gated"},
	"eval":      {"eval-samples"},
	"train":     {"device"},
}

// check refuses the operator flags' impossible values, and a flag of
// another stage than name, before anything starts.
func (f operatorFlags) check(name string) error {
	for _, stage := range slices.Sorted(maps.Keys(stageFlags)) {
		if err := onlyWith(f.client.fs, stage == name, "a flag of the "+stage+" stage, not of "+name, stageFlags[stage]...); err != nil {
			return err
		}
	}
	if err := operators.CheckDevice(*f.device); err != nil {
		return fmt.Errorf("%w: --device %q: want cpu or cuda (cuda:N: GPU N)", errUsage, *f.device)
	}
	// A build without CUDA refuses --device cuda here, before the
	// operator's health server or its consumer starts.
	if _, err := operators.Backend(*f.device); err != nil {
		return fmt.Errorf("%w: --device %s: %w", errUsage, *f.device, err)
	}
	if _, err := logLevel(*f.level); err != nil {
		return err
	}
	if err := checkInt32("--eval-samples", *f.samples, 1); err != nil {
		return err
	}
	if err := checkOTLP(*f.otlp); err != nil {
		return err
	}
	return firstBad(
		flagCheck{*f.rounds < 0, fmt.Sprintf("--rounds %d: want 0 (run until stopped) or more", *f.rounds)},
		flagCheck{*f.linger < 0, fmt.Sprintf("--linger %s: want 0 (the default) or more", *f.linger)},
		flagCheck{*f.partial < 0, fmt.Sprintf("--partial-group-timeout %s: want 0 (wait) or more", *f.partial)},
		flagCheck{*f.maxWait < 0, fmt.Sprintf("--window-max-wait %s: want 0 (wait) or more", *f.maxWait)},
		flagCheck{*f.snapRoll < 0, fmt.Sprintf("--snapshot-roll-bytes %d: want 0 (64 MiB) or more", *f.snapRoll)},
		flagCheck{*f.snapAge < 0, fmt.Sprintf("--snapshot-roll-interval %s: want 0 (30s) or more", *f.snapAge)},
		flagCheck{*f.restarts < -1, fmt.Sprintf("--restarts %d: want -1 (always), 0 or more", *f.restarts)},
		flagCheck{(name == "train" || name == "eval") && *f.releases == "", fmt.Sprintf("run %s needs --releases DIR (the policy releases directory: train writes them, eval reads them)", name)},
		flagCheck{name == "snapshot" && *f.snapshot == "", "run snapshot needs --snapshot-dir DIR (where its Parquet files go)"},
	)
}

func (f operatorFlags) env(name string, stderr io.Writer) (*operatorEnv, error) {
	if err := f.check(name); err != nil {
		return nil, err
	}
	cc, err := f.client.load()
	if err != nil {
		return nil, err
	}
	c, err := contractFlag(*f.contract, stderr)
	if err != nil {
		return nil, err
	}
	deps, err := operators.BuiltinDeps(c)
	if err != nil {
		return nil, err
	}
	deps.PartialGroupTimeout, deps.WindowMaxWait = *f.partial, *f.maxWait
	deps.SnapshotDir, deps.SnapshotRollBytes, deps.SnapshotRollInterval = *f.snapshot, *f.snapRoll, *f.snapAge
	deps.ReleaseDir, deps.Rounds, deps.Device = *f.releases, *f.rounds, *f.device
	deps.Gated, deps.EvalSamples = *f.gated, int32(*f.samples)
	dialer, err := cc.Dialer()
	if err != nil {
		return nil, err
	}
	transport, err := cc.Transport()
	if err != nil {
		return nil, err
	}
	inst := *f.instance
	if inst == "" {
		h, _ := os.Hostname()
		inst = fmt.Sprintf("%s-%d", h, os.Getpid())
	}
	dir, cleanup, err := stateDir(*f.stateDir, name)
	if err != nil {
		return nil, err
	}
	log, _ := newLogger(stderr, *f.level) // checked by check
	// The operator's runtime leaves a transport it was given open: the
	// process's cleanup closes it.
	closeAll := func() { transport.CloseIdleConnections(); cleanup() }
	return &operatorEnv{deps: deps, cleanup: closeAll, cfg: pipeline.Config{
		Brokers: cc.Brokers, Dialer: dialer, Transport: transport, StateDir: dir,
		Logger: log.With("run", c.RunID), Instance: inst, BatchTimeout: *f.linger,
	}}, nil
}

// lingerUsage is the help of the operators' --linger flag.
const lingerUsage = "how long the operator's producer waits to fill a batch before it sends (Kafka's linger.ms; 0: 2ms). " +
	"Longer batches cost less CPU per byte on Apache Kafka and add up to this much latency per hop (bench/RESULTS.md)"

// stateDir is the operator's state directory: dir (created), or a
// temporary one removed by cleanup.
func stateDir(dir, name string) (string, func(), error) {
	if dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return "", nil, fmt.Errorf("%w: state directory: %w", operators.ErrConfig, err)
		}
		return filepath.Clean(dir), func() {}, nil
	}
	dir, err := os.MkdirTemp("", "trajflow-"+name+"-")
	if err != nil {
		return "", nil, fmt.Errorf("state directory: %w", err)
	}
	return dir, func() { os.RemoveAll(dir) }, nil
}

func cmdRun(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("run", stderr)
	of := addOperatorFlags(fs)
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return fmt.Errorf("%w: trajflow run NAME, one of the stages:\n%s", errUsage, stageList())
	}
	name := pos[0]
	if _, ok := operators.Lookup(name); !ok {
		return fmt.Errorf("%w: unknown stage %q; the stages are:\n%s", errUsage, name, stageList())
	}
	if _, err := of.envSvc.check(name); err != nil {
		return err
	}
	env, err := of.env(name, stderr)
	if err != nil {
		return err
	}
	defer env.cleanup()
	env.cfg.Metrics = pipeline.NewMetrics(nil)
	tp, err := tracing(ctx, *of.otlp, "trajflow-"+name)
	if err != nil {
		return err
	}
	if tp != nil {
		env.cfg.TracerProvider = tp
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = tp.Shutdown(sctx)
		}()
	}
	hs, err := healthServer(*of.health, env.cfg.Metrics)
	if err != nil {
		return err
	}
	if taken := hs.TakenAddr(); taken != "" {
		env.cfg.Logger.Warn("health address taken; serving on a free port", "taken", taken, "addr", hs.Addr())
	}
	hctx, stopHealth := context.WithCancel(context.Background())
	healthDone := make(chan struct{})
	go func() { defer close(healthDone); _ = hs.Serve(hctx) }()
	defer func() { stopHealth(); <-healthDone }()
	fmt.Fprintln(stdout, pipeline.HealthLine(name, env.cfg.Instance, hs.Addr()))
	defer hs.SetDraining()
	if env.deps.Env, err = of.envSvc.dial(ctx, name, env.deps.Contract, env.cfg.Logger.With("stage", name)); err != nil {
		return err
	}
	if env.deps.Env != nil {
		defer env.deps.Env.Close()
	}
	policy := operators.Restarts{Max: *of.restarts, Logger: env.cfg.Logger.With("stage", name, "instance", env.cfg.Instance)}
	var watch *endWatch
	if *of.rounds > 0 {
		if watch, err = newEndWatch(of, name, env); err != nil {
			return err
		}
		wctx, stopRun := context.WithCancel(ctx)
		watchDone := make(chan struct{})
		go func() { defer close(watchDone); watch.run(wctx, stopRun) }()
		// Waited for before the transport its checks use is closed.
		defer func() { stopRun(); <-watchDone }()
		ctx = wctx
	}
	err = operators.RunRestarting(ctx, policy, func(ctx context.Context) error {
		return runOperatorOnce(ctx, name, env.deps, env.cfg, hs, watch)
	})
	if err == nil && watch != nil && watch.ended.Load() {
		p := watch.final
		fmt.Fprintf(stdout, "operator %s done: %d rounds, %d groups decided, %d batches, policy version %d; inputs drained\n",
			name, *of.rounds, p.Decided, p.Batches, p.Version)
	}
	return err
}

// newEndWatch is the end watch of an operator run with --rounds.
func newEndWatch(of operatorFlags, name string, env *operatorEnv) (*endWatch, error) {
	cc, err := of.client.load()
	if err != nil {
		return nil, err
	}
	c := env.deps.Contract
	cfg := env.cfg
	return &endWatch{cc: cc, cfg: &cfg, topics: env.deps.Topics, group: c.RunID + "." + name,
		want: int(*of.rounds) * c.Dispatch.GroupsPerUpdate, perRound: c.Dispatch.GroupsPerUpdate, every: time.Second,
		log: env.cfg.Logger.With("stage", name, "instance", env.cfg.Instance)}, nil
}

// runOperatorOnce builds the stage and its operator and runs it until a
// graceful stop (nil) or a fatal error.
func runOperatorOnce(ctx context.Context, name string, deps operators.Deps, cfg pipeline.Config, hs *pipeline.HealthServer, watch *endWatch) error {
	op, err := operators.NewOperator(name, deps, cfg)
	if err != nil {
		return err
	}
	hs.SetOperators(op)
	if watch != nil {
		watch.op.Store(op)
	}
	err = op.Run(ctx)
	if errors.Is(err, pipeline.ErrStopped) {
		return nil
	}
	return err
}

// healthServer listens for an operator's health endpoints on addr; an
// address no listener takes (no port, a port past 65535, a host that is
// not this machine's) is the command line's mistake (errUsage).
func healthServer(addr string, m *pipeline.Metrics) (*pipeline.HealthServer, error) {
	if _, _, err := net.SplitHostPort(addr); err != nil || addr == "" {
		return nil, fmt.Errorf("%w: --health %q: want HOST:PORT (127.0.0.1:0 picks a free port)", errUsage, addr)
	}
	hs, err := pipeline.NewHealthServer(addr, m)
	if err != nil {
		return nil, fmt.Errorf("%w: --health: %w", errUsage, err)
	}
	return hs, nil
}
