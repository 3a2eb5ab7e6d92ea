package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

func init() {
	register("broker", "run the embedded Kafka-protocol broker (--port, --data)", cmdBroker)
	register("topics", "topics create --brokers ADDR --contract FILE: create every topic of a run", cmdTopics)
	register("run", "run NAME: run one operator (validate, reward, advantage, pack, ...)", cmdRun)
}

func newLogger(w io.Writer, level string) *slog.Logger {
	var l slog.Level
	_ = l.UnmarshalText([]byte(level))
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l}))
}

func cmdBroker(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("broker", stderr)
	host := fs.String("host", "127.0.0.1", "address to listen on and advertise")
	port := fs.Int("port", 9092, "port (0 picks a free one)")
	data := fs.String("data", "", "data directory (empty: in memory)")
	retBytes := fs.Int64("retention-bytes", 0, "per-partition retention in bytes (0: unbounded)")
	retAge := fs.Duration("retention", 7*24*time.Hour, "retention age")
	maxMsg := fs.Int("max-message-bytes", kafka.DefaultMaxMessageBytes, "largest record batch accepted")
	level := fs.String("log-level", "info", "log level")
	if _, err := parseFlags(fs, args); err != nil {
		return err
	}
	log := newLogger(stderr, *level)
	b, err := kafka.StartBroker(ctx, kafka.BrokerConfig{
		Addr: fmt.Sprintf("%s:%d", *host, *port), DataDir: *data, MaxMessageBytes: *maxMsg,
		Retention: kafka.RetentionPolicy{Bytes: *retBytes, Age: *retAge}, Logger: log,
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "broker listening on %s\n", b.Addr())
	<-ctx.Done()
	return b.Close()
}

// clientFlags are the Kafka connection flags shared by every command that
// talks to a broker.
type clientFlags struct {
	brokers *string
	config  *string
}

func addClientFlags(fs *flag.FlagSet) clientFlags {
	return clientFlags{
		brokers: fs.String("brokers", "127.0.0.1:9092", "comma-separated bootstrap brokers"),
		config:  fs.String("client-config", "", "YAML file with TLS/SASL client settings (connectors/kafka.ClientConfig)"),
	}
}

func (c clientFlags) load() (kafka.ClientConfig, error) {
	var cc kafka.ClientConfig
	if *c.config != "" {
		var err error
		if cc, err = kafka.LoadClientConfig(*c.config); err != nil {
			return cc, err
		}
	}
	if bs := splitList(*c.brokers); len(bs) > 0 && len(cc.Brokers) == 0 {
		cc.Brokers = bs
	}
	if len(cc.Brokers) == 0 {
		return cc, fmt.Errorf("%w: no brokers", errUsage)
	}
	return cc, cc.Validate()
}

func cmdTopics(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("topics create", stderr)
	cf := addClientFlags(fs)
	path := fs.String("contract", "", "learning contract (default: the built-in demo contract)")
	rf := fs.Int("replication-factor", 0, "replicas per partition (0: the contract's topics.replication when written, else 3 on 3 or more brokers, 1 on one)")
	minISR := fs.Int("min-insync-replicas", 0, "topic min.insync.replicas (0: 2 with 3 or more replicas, else 1)")
	unsafe := fs.Bool("allow-unsafe-replication", false, "accept replication that cannot survive the loss of one broker")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 || pos[0] != "create" {
		return fmt.Errorf("%w: trajflow topics create --brokers ADDR --contract FILE", errUsage)
	}
	cc, err := cf.load()
	if err != nil {
		return err
	}
	c, err := loadContract(*path)
	if err != nil {
		return err
	}
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return err
	}
	specs := operators.TopicSpecs(c, topics)
	brokers, err := kafka.ListBrokers(ctx, cc, cc.Brokers)
	if err != nil {
		return err
	}
	repl, why, err := kafka.PlanReplication(operators.ReplicationRequest(c, len(brokers), *rf, *minISR, *unsafe))
	if err != nil {
		return fmt.Errorf("topics create: %w", err)
	}
	fmt.Fprintf(stdout, "replication: %s\n", why)
	repl.Apply(specs)
	if err := kafka.CreateTopics(ctx, cc, cc.Brokers, specs); err != nil {
		return err
	}
	for _, s := range specs {
		fmt.Fprintf(stdout, "%-40s partitions=%d replication=%d min.insync.replicas=%d max.message.bytes=%d compacted=%v\n",
			s.Name, s.Partitions, s.ReplicationFactor, s.MinInsyncReplicas, s.MaxMessageBytes, s.Compacted)
	}
	return nil
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
}

func addOperatorFlags(fs *flag.FlagSet) operatorFlags {
	return operatorFlags{
		client:   addClientFlags(fs),
		contract: fs.String("contract", "", "learning contract (default: the built-in demo contract)"),
		stateDir: fs.String("state", "", "local state directory (default: a temporary directory; state is rebuilt from the topics when lost)"),
		instance: fs.String("instance", "", "instance name in logs and metrics (default: host-pid)"),
		health:   fs.String("health", "127.0.0.1:0", "address of /healthz, /readyz and /metrics"),
		level:    fs.String("log-level", "info", "log level"),
		partial:  fs.Duration("partial-group-timeout", 0, "close incomplete groups after this long (advantage; 0: wait)"),
		maxWait:  fs.Duration("window-max-wait", 0, "close a non-full pack window after this long (pack; 0: wait)"),
		snapshot: fs.String("snapshot-dir", "", "directory of the Parquet snapshots (snapshot)"),
		releases: fs.String("releases", "", "policy releases directory shared by train (writes) and rollout (train)"),
		rounds:   fs.Int64("rounds", 0, "update rounds to dispatch (dispatch; 0: until stopped)"),
		snapRoll: fs.Int64("snapshot-roll-bytes", 0, "close a snapshot file at this many bytes (snapshot; 0: 64 MiB)"),
		snapAge:  fs.Duration("snapshot-roll-interval", 0, "close a snapshot file this long after its first message (snapshot; 0: 30s)"),
	}
}

// operatorEnv resolves an operator's configuration.
type operatorEnv struct {
	contract *contract.Contract
	topics   pipeline.Topics
	cfg      pipeline.Config
	cleanup  func()
}

func (f operatorFlags) env(name string, stderr io.Writer) (*operatorEnv, error) {
	cc, err := f.client.load()
	if err != nil {
		return nil, err
	}
	c, err := loadContract(*f.contract)
	if err != nil {
		return nil, err
	}
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return nil, err
	}
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
	cleanup := func() {}
	dir := *f.stateDir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "trajflow-"+name+"-"); err != nil {
			return nil, fmt.Errorf("state directory: %w", err)
		}
		cleanup = func() { os.RemoveAll(dir) }
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	return &operatorEnv{
		contract: c, topics: topics, cleanup: cleanup,
		cfg: pipeline.Config{
			Brokers: cc.Brokers, GroupID: c.RunID + "." + name, QuarantineTopic: topics.Quarantine,
			Dialer: dialer, Transport: transport, MaxMessageBytes: c.Topics.MaxMessageBytes,
			StateDir: filepath.Clean(dir), Logger: newLogger(stderr, *f.level).With("run", c.RunID),
			Instance: inst,
		},
	}, nil
}

func cmdRun(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("run", stderr)
	of := addOperatorFlags(fs)
	restarts := fs.Int("restarts", -1, "restart the operator in place after a fatal error at most this many times (-1: always)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return fmt.Errorf("%w: trajflow run NAME (one of %v)", errUsage, operators.Names())
	}
	name := pos[0]
	env, err := of.env(name, stderr)
	if err != nil {
		return err
	}
	defer env.cleanup()
	deps, err := operatorDeps(env.contract, env.topics)
	if err != nil {
		return err
	}
	deps.PartialGroupTimeout, deps.WindowMaxWait = *of.partial, *of.maxWait
	deps.SnapshotDir, deps.SnapshotRollBytes, deps.SnapshotRollInterval = *of.snapshot, *of.snapRoll, *of.snapAge
	deps.ReleaseDir, deps.Rounds = *of.releases, *of.rounds
	env.cfg.Metrics = pipeline.NewMetrics(nil)
	hs, err := pipeline.NewHealthServer(*of.health, env.cfg.Metrics)
	if err != nil {
		return err
	}
	if taken := hs.TakenAddr(); taken != "" {
		env.cfg.Logger.Warn("health address taken; serving on a free port", "taken", taken, "addr", hs.Addr())
	}
	hctx, stopHealth := context.WithCancel(context.Background())
	defer stopHealth()
	go func() { _ = hs.Serve(hctx) }()
	fmt.Fprintf(stdout, "operator %s (%s) health on http://%s\n", name, env.cfg.Instance, hs.Addr())
	// A fatal error (broker unreachable past the client's retries, a lost
	// group generation, ...) ends the operator without committing anything
	// more; building it again is what a process restart would do (state is
	// rebuilt, uncommitted inputs are redelivered), so the operator restarts
	// in place with backoff and reconnects once the brokers are back.
	backoff := time.Second
	for attempt := 0; ; attempt++ {
		began := time.Now()
		err := runOperatorOnce(ctx, name, deps, env.cfg, hs)
		if err == nil || ctx.Err() != nil || (*restarts >= 0 && attempt >= *restarts) {
			hs.SetDraining()
			return err
		}
		if time.Since(began) > time.Minute {
			backoff = time.Second
		}
		env.cfg.Logger.Warn("operator failed; restarting", "stage", name, "instance", env.cfg.Instance, "err", err, "restart", attempt+1, "backoff", backoff)
		select {
		case <-ctx.Done():
			hs.SetDraining()
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 10*time.Second)
	}
}

// runOperatorOnce builds the stage and its operator and runs it until a
// graceful stop (nil) or a fatal error.
func runOperatorOnce(ctx context.Context, name string, deps operators.Deps, cfg pipeline.Config, hs *pipeline.HealthServer) error {
	op, err := operators.NewOperator(name, deps, cfg)
	if err != nil {
		return err
	}
	hs.SetOperators(op)
	err = op.Run(ctx)
	if errors.Is(err, pipeline.ErrStopped) {
		return nil
	}
	return err
}
