// Package bench measures trajflow's throughput over a broker, side by side
// with the limit set by moving the same bytes through Kafka (docs/SYSTEMS.md §4:
// "maximize valid, appropriately on-policy, reward-bearing training tokens
// per unit time"; docs/SYSTEMS.md §18: capacity planning starts from one measured
// episode distribution).
//
// Run drives the validate → reward → advantage → pack stages as Kafka
// operators (the same runtime `trajflow run` uses) with a synthetic rollout
// source (bench/synth), after a warm-up, for a fixed duration or token
// count, and reads the batches and the census back to account for every
// attempt (internal/audit): throughput per stage and end to end, record
// latency from production to the batch that contains it, packing
// efficiency, the admitted yield with each loss itemized, and the policy
// lag distribution. In the same run it measures the raw baseline: kafka-go
// producing and consuming the same bytes, with no operator work, on the
// same broker and the same number of partitions.
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// afterBaselines, set by tests, is called when the baselines are done and
// before the pipeline starts.
var afterBaselines func()

// Stages are the stages a bench drives, in pipeline order.
var Stages = []string{"validate", "reward", "advantage", "pack"}

// Config configures a bench run.
type Config struct {
	// Contract is the resolved learning contract of the run.
	Contract *contract.Contract
	// Brokers of a real cluster; empty starts an embedded broker. On a
	// cluster the run creates topics of its own ("<run>-bench-<time>.*")
	// and deletes them when it ends, unless KeepTopics.
	Brokers    []string
	KeepTopics bool
	Client     kafka.ClientConfig
	// Warmup runs before the measurement starts; Duration is the
	// measurement window. Tokens, when > 0, ends the measurement once
	// that many generated tokens are decided (or Duration passes).
	Warmup   time.Duration
	Duration time.Duration
	Tokens   int64
	// Baseline is how long the raw kafka-go baseline runs (0: a third of
	// Duration, at least 2 s; negative: skipped).
	Baseline time.Duration
	// BaselineRate paces the baseline's producer to this many messages per
	// second (0: as fast as the broker takes them). The Kafka side's cost
	// per byte depends on the message rate of a hop (fewer records per
	// produce request and per fetch at lower rates); a paced baseline at
	// the pipeline's per-hop rate measures that cost alone.
	BaselineRate float64
	// Baselines are the clients of the raw baselines, run one after the
	// other before the pipeline (ClientKafkaGo, ClientFranzGo; default
	// kafka-go alone). The ratios compare the pipeline with kafka-go's.
	Baselines []string
	// Instances per stage (default 1 each). The pack stage is the single
	// writer of the batch sequence and runs exactly once.
	Instances map[string]int
	// Synth is the rollout distribution; its RunID, ContractHash,
	// GroupSize and MaxTurns are taken from the contract.
	Synth synth.Config
	// MemoryLimit is the Go soft memory limit set for the run (bytes);
	// 0 derives it from the embedded broker's retention unless GOMEMLIMIT
	// is set; negative leaves the process's limit as it is.
	MemoryLimit int64
	// DataDir, with the embedded broker, persists its log to this
	// directory (kafka.BrokerConfig.DataDir), as `trajflow broker --data`
	// does: the retained segments then live in files (the kernel's page
	// cache) instead of the process's heap, and the derived memory limit
	// leaves them out. It must not hold a log already (a fresh run).
	// Empty: the broker keeps its log in memory.
	DataDir string
	// TCPOnly starts the embedded broker without its local socket
	// (kafka.BrokerConfig.TCPOnly): the clients reach it over loopback
	// TCP, as they reach a broker of another host.
	TCPOnly bool
	// InFlightGroups bounds the groups produced but not yet decided
	// (the source waits): a closed loop, so the broker's backlog and the
	// process's memory stay bounded however long the run.
	InFlightGroups int
	// PartialGroupTimeout and WindowMaxWait are the advantage and pack
	// wall-clock policies (defaults 1 s and 2 s).
	PartialGroupTimeout time.Duration
	WindowMaxWait       time.Duration
	// BatchTimeout is the operators' producer linger (pipeline.Config;
	// 0: the runtime's default).
	BatchTimeout time.Duration
	// Processes, when set, runs every operator as a child process (the
	// command it returns for a stage, an instance id, a state directory
	// and the brokers; TrajflowRun gives `trajflow run STAGE ...`) instead of in this
	// process; the broker, the source and the accounting stay here. The
	// per-stage rows are then empty and the CPU figures add the children's.
	Processes func(stage, instance, stateDir string, brokers []string) *exec.Cmd
	// Kill, with Processes, names a stage whose first instance is killed
	// (SIGKILL) once, KillAt into the measurement window (default: half
	// of it), and restarted with the same state directory: the accounting
	// then shows what the crash cost (Report.Kill, Report.Accounting).
	Kill   string
	KillAt time.Duration
	// CPUPids are other processes whose CPU time the CPU figures add (a
	// broker on this machine, e.g. Apache Kafka's JVM, so the pipeline and
	// the baselines both pay for it).
	CPUPids []int
	// CPURoles profiles this process's CPU over each measured window (the
	// pipeline's and every baseline's) and reports it by role
	// (Report.CPUByRole, Baseline.CPUByRole): where the CPU per byte goes.
	// It runs the process's one CPU profile, so it excludes a profile of
	// the whole run, and it needs the operators in this process (not
	// Processes).
	CPURoles bool
	// Drain bounds the wait for in-flight attempts after the measurement
	// (default 30 s).
	Drain time.Duration
	// Progress, when set, is called about four times a second.
	Progress func(Progress)
	// Measured, when set, is called at the end of the measurement window,
	// before the drain, while everything still runs (for a heap profile).
	Measured func()
	Logger   *slog.Logger
}

// Progress is a running view of a bench.
type Progress struct {
	Phase   string // "baseline", "warmup", "measure", "drain"
	Elapsed time.Duration
	Total   time.Duration // of the phase
	// TokensPerS is the end-to-end rate over the last second.
	TokensPerS float64
	Decided    int64
}

// Validate reports what Run would refuse in c before it starts anything
// (c itself is left as it is).
func (c Config) Validate() error { return c.defaults() }

func (c *Config) defaults() error {
	if c.Contract == nil {
		return errors.New("bench: no contract")
	}
	if c.DataDir != "" && len(c.Brokers) > 0 {
		return fmt.Errorf("bench: a data directory (%s) is for the embedded broker, not for brokers %v", c.DataDir, c.Brokers)
	}
	if c.DataDir != "" {
		if ents, err := os.ReadDir(c.DataDir); err == nil && len(ents) > 0 {
			return fmt.Errorf("bench: data directory %s is not empty: the bench starts from a fresh log", c.DataDir)
		}
	}
	if c.Duration <= 0 {
		c.Duration = 10 * time.Second
	}
	if c.Warmup < 0 {
		c.Warmup = 0
	}
	if c.Baseline == 0 {
		c.Baseline = max(c.Duration/3, 2*time.Second)
	}
	if c.InFlightGroups <= 0 {
		c.InFlightGroups = 192
	}
	if c.PartialGroupTimeout <= 0 {
		c.PartialGroupTimeout = time.Second
	}
	if c.WindowMaxWait <= 0 {
		c.WindowMaxWait = 2 * time.Second
	}
	if c.Drain <= 0 {
		c.Drain = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if c.Synth.GroupSize == 0 {
		c.Synth = synth.Bench()
	}
	if c.Kill != "" {
		if c.Processes == nil {
			return errors.New("bench: --kill needs the operators in processes (--processes)")
		}
		if !isStage(c.Kill) {
			return fmt.Errorf("bench: --kill: no stage %q (have %s)", c.Kill, strings.Join(Stages, ", "))
		}
		if c.KillAt <= 0 {
			c.KillAt = c.Duration / 2
		}
		if c.KillAt >= c.Duration {
			return fmt.Errorf("bench: --kill-at %v: must be inside the window (--duration %v)", c.KillAt, c.Duration)
		}
	}
	if c.CPURoles && c.Processes != nil {
		return errors.New("bench: --cpu-roles profiles this process, and with --processes the operators run in others")
	}
	if len(c.Baselines) == 0 {
		c.Baselines = []string{ClientKafkaGo}
	}
	for _, b := range c.Baselines {
		if b != ClientKafkaGo && b != ClientFranzGo {
			return fmt.Errorf("bench: --baselines: no client %q (have %s, %s)", b, ClientKafkaGo, ClientFranzGo)
		}
		if b == ClientFranzGo && c.BaselineRate > 0 {
			return errors.New("bench: --baseline-rate paces the kafka-go baseline only; drop franz-go from --baselines")
		}
	}
	if c.BaselineRate < 0 || math.IsNaN(c.BaselineRate) || math.IsInf(c.BaselineRate, 0) {
		return fmt.Errorf("bench: --baseline-rate %v: want messages per second >= 0", c.BaselineRate)
	}
	for name, n := range c.Instances {
		if !isStage(name) {
			return fmt.Errorf("bench: --instances: no stage %q (have %s)", name, strings.Join(Stages, ", "))
		}
		if n < 1 {
			return fmt.Errorf("bench: --instances %s=%d: want at least 1", name, n)
		}
		if name == "pack" && n != 1 {
			return fmt.Errorf("bench: --instances pack=%d: pack is the single writer of the batch sequence and runs once", n)
		}
	}
	return nil
}

func isStage(name string) bool {
	for _, s := range Stages {
		if s == name {
			return true
		}
	}
	return false
}

// ParseInstances parses "stage=n,stage=n" ("" is none); an empty item
// (a doubled, leading or trailing comma) or a stage named twice is
// refused.
func ParseInstances(s string) (map[string]int, error) {
	out := map[string]int{}
	if strings.TrimSpace(s) == "" {
		return out, nil
	}
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			return nil, fmt.Errorf("instances %q: an empty item (a doubled, leading or trailing comma)", s)
		}
		name, num, ok := strings.Cut(p, "=")
		if !ok {
			return nil, fmt.Errorf("instances %q: want stage=n", p)
		}
		n, err := strconv.Atoi(num)
		if err != nil {
			return nil, fmt.Errorf("instances %q: %w", p, err)
		}
		name = strings.TrimSpace(name)
		if _, dup := out[name]; dup {
			return nil, fmt.Errorf("instances %q: stage %s given twice", s, name)
		}
		out[name] = n
	}
	return out, nil
}

// trans gives a client of the run (an operator, the source, the
// baseline) a transport of its own, as a separate process would have; all
// are closed when Run returns (closeTransports): a kafka-go transport's
// pools keep dialing the brokers' addresses until closed. The client
// configuration was checked by Run (its Dialer), so Transport cannot fail.
func (r *run) trans() *kafkago.Transport {
	t, _ := r.cfg.Client.Transport()
	r.transMu.Lock()
	defer r.transMu.Unlock()
	r.transports = append(r.transports, t)
	return t
}

// closeTransports closes every transport trans gave out.
func (r *run) closeTransports() {
	r.transMu.Lock()
	defer r.transMu.Unlock()
	for _, t := range r.transports {
		t.CloseIdleConnections()
	}
	r.transports = nil
}

// run is the state of one bench.
type run struct {
	cfg    Config
	runID  string
	topics pipeline.Topics
	addr   []string
	dialer *kafkago.Dialer
	// transports are those trans gave out, closed when Run returns.
	transMu    sync.Mutex
	transports []*kafkago.Transport
	gen        *synth.Generator

	stream *audit.Stream
	groups sync.Map // group id -> *groupInfo

	// Source.
	produced    atomic.Int64 // groups
	genNanos    atomic.Int64 // time spent generating and encoding
	genTokens   atomic.Int64
	genBytes    atomic.Int64
	inflight    chan struct{} // one token per undecided group
	groupsDone  atomic.Int64
	decidedToks atomic.Int64 // tokens of decided attempts

	// Sink (accounting).
	mu          sync.Mutex
	acct        *accounting // current phase's accumulator
	sinkBytes   atomic.Int64
	sinkNanos   atomic.Int64
	batchesSeen atomic.Int64

	stages []*instance
	procs  []*proc // Config.Processes
}

type groupInfo struct {
	tokens    int64
	rows      int32
	remaining atomic.Int32
}

// Run runs a bench and returns its report.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	c := cfg.Contract
	r := &run{cfg: cfg, stream: audit.NewStream()}
	var err error
	r.dialer, err = cfg.Client.Dialer()
	if err != nil {
		return nil, fmt.Errorf("bench: client: %w", err)
	}
	defer r.closeTransports()
	rep := &Report{Contract: c.RunID, ContractHash: c.Hash(), Started: time.Now().UTC(), GOMAXPROCS: runtime.GOMAXPROCS(0)}

	if cfg.MemoryLimit > 0 {
		defer debug.SetMemoryLimit(debug.SetMemoryLimit(cfg.MemoryLimit))
	}
	runID := c.RunID
	if len(cfg.Brokers) == 0 {
		// Retention bounds the embedded broker's memory: the closed loop
		// keeps every consumer far less than this behind.
		retention := r.retentionBytes()
		rep.RetentionMB = float64(retention) / (1 << 20)
		if cfg.MemoryLimit == 0 && os.Getenv("GOMEMLIMIT") == "" {
			// The heap's goal otherwise follows the transient copies of the
			// large batch messages and the slowly filling deduplication
			// memory, so its peak creeps up over a long run. The broker's
			// retained segments are most of the live heap; twice their
			// bound (the collector's headroom at GOGC 100) plus 1 GiB is
			// about the heap's peak in the first seconds. The limit holds
			// it there; once the live heap has grown, the collector runs
			// more often (bench/RESULTS.md measures the cost).
			inHeap := r.brokerBound(retention)
			if cfg.DataDir != "" {
				inHeap = 0
			}
			defer debug.SetMemoryLimit(debug.SetMemoryLimit(2*inHeap + 1<<30))
		}
		// The broker's goroutines inherit the label: a CPU profile tells its
		// share apart (go tool pprof -tagfocus role=broker).
		var b *kafka.Broker
		var err error
		pprof.Do(ctx, pprof.Labels("role", "broker"), func(ctx context.Context) {
			b, err = kafka.StartBroker(ctx, kafka.BrokerConfig{
				MaxMessageBytes: c.Topics.MaxMessageBytes, DataDir: cfg.DataDir, TCPOnly: cfg.TCPOnly,
				Retention: kafka.RetentionPolicy{Bytes: retention, CheckInterval: 250 * time.Millisecond, SegmentBytes: r.segmentSize()},
			})
		})
		if err != nil {
			return nil, fmt.Errorf("bench: start broker: %w", err)
		}
		defer b.Close()
		r.addr = []string{b.Addr()}
		rep.Broker = "embedded " + b.Addr()
	} else {
		r.addr = cfg.Brokers
		rep.Broker = strings.Join(cfg.Brokers, ",")
		// Fresh topics on a shared cluster.
		runID = c.RunID + "-bench-" + strconv.FormatInt(time.Now().Unix(), 36)
	}
	r.runID = runID
	r.topics, err = pipeline.TopicsFor(runID)
	if err != nil {
		return nil, err
	}
	rep.Run = runID
	s := cfg.Synth
	s.RunID = runID
	s.ContractHash = c.Hash()
	s.GroupSize = c.Sampler.GroupSize
	s.MaxTurns = c.Sampler.MaxTurns
	r.cfg.Synth = s
	r.gen = s.NewGenerator(0)
	rep.Synth = s

	cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	specs := operators.TopicSpecs(c, r.topics)
	base := specs[1] // same partitions and limits as the trajectories topic
	for _, client := range cfg.Baselines {
		t := base
		t.Name = runID + ".baseline-" + client
		specs = append(specs, t)
	}
	err = kafka.CreateTopics(cctx, cfg.Client, r.addr, specs)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("bench: create topics: %w", err)
	}
	switch {
	case len(cfg.Brokers) == 0:
		// The embedded broker, and its topics, end with the run.
	case cfg.KeepTopics:
		rep.Topics = "kept: " + runID + ".* (--keep-topics)"
	default:
		// A run moves gigabytes: on a shared cluster its topics would hold
		// them for their whole retention (7 days by default).
		defer func() { rep.Topics = r.cleanUp(ctx, specs) }()
	}
	rep.Partitions = base.Partitions
	if len(cfg.Brokers) == 0 {
		// One batch is many MB: give the single batches partition room for
		// the batches the closed loop can leave unread, so retention never
		// deletes a batch the trainer side has not read yet.
		if err := r.setRetentionBytes(ctx, r.topics.Batches, r.batchesRetention()); err != nil {
			return nil, err
		}
		// Low-rate topics would otherwise fill up to the broker-wide bound
		// only after minutes (memory creeping up long after the warm-up).
		for _, t := range r.lowRateRetention() {
			if err := r.setRetentionBytes(ctx, t.topic, t.bytes); err != nil {
				return nil, err
			}
		}
	}

	// Baselines first, on a quiet broker.
	if cfg.Baseline > 0 {
		for _, client := range cfg.Baselines {
			topic := runID + ".baseline-" + client
			var bl *Baseline
			pprof.Do(ctx, pprof.Labels("role", "baseline"), func(ctx context.Context) {
				if client == ClientFranzGo {
					bl, err = r.baselineFranz(ctx, topic, cfg.Baseline)
				} else {
					bl, err = r.baseline(ctx, topic, cfg.Baseline, cfg.BaselineRate)
				}
			})
			if err != nil {
				return nil, err
			}
			rep.Baselines = append(rep.Baselines, bl)
			if client == ClientKafkaGo {
				rep.Baseline = bl
			}
			// Free the baseline's data before the pipeline runs.
			if _, err := r.deleteTopics(ctx, topic); err != nil {
				return nil, err
			}
		}
	}
	if afterBaselines != nil {
		afterBaselines()
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := r.pipeline(ctx, rep); err != nil {
		return nil, err
	}
	rep.PeakRSSMB = peakRSSMB()
	if l := debug.SetMemoryLimit(-1); l < math.MaxInt64 {
		rep.MemoryLimitMB = float64(l) / (1 << 20)
	}
	rep.finish()
	return rep, nil
}

// pipeline runs the operators, the source and the sink.
func (r *run) pipeline(ctx context.Context, rep *Report) error {
	cfg := &r.cfg
	c := cfg.Contract
	// The trainer's version: the lag rule judges behavior versions
	// against it (docs/SYSTEMS.md §4 "appropriately on-policy").
	if err := r.publishPolicy(ctx); err != nil {
		return err
	}
	opCtx, stopOps := context.WithCancel(context.Background())
	defer stopOps()
	metrics := pipeline.NewMetrics(nil)
	var opWG sync.WaitGroup
	opErr := make(chan error, 16)
	stateRoot, err := os.MkdirTemp("", "trajflow-bench-")
	if err != nil {
		return fmt.Errorf("bench: state dir: %w", err)
	}
	defer os.RemoveAll(stateRoot)
	deps := operators.Deps{
		Contract: c, Topics: r.topics, VocabSize: r.cfg.Synth.Vocab,
		PartialGroupTimeout: cfg.PartialGroupTimeout, WindowMaxWait: cfg.WindowMaxWait,
	}
	var packReady chan struct{}
	for _, name := range Stages {
		n := max(cfg.Instances[name], 1)
		for i := 0; i < n; i++ {
			inst := &instance{stage: name, id: fmt.Sprintf("%s-%d", name, i), groups: &r.groups}
			if name == "pack" {
				inst.policyTopic, inst.policySeen = r.topics.Policy, make(chan struct{})
				packReady = inst.policySeen
			}
			pc := pipeline.Config{
				Brokers: r.addr, GroupID: r.runID + "." + name, QuarantineTopic: r.topics.Quarantine,
				Dialer: r.dialer, Transport: r.trans(),
				MaxMessageBytes: c.Topics.MaxMessageBytes, StateDir: fmt.Sprintf("%s/%s", stateRoot, inst.id),
				Logger: cfg.Logger, Metrics: metrics, Instance: inst.id,
				BatchTimeout: cfg.BatchTimeout, Hooks: []pipeline.Hook{inst.hook()},
			}
			r.stages = append(r.stages, inst)
			if cfg.Processes != nil {
				p := &proc{stage: name, id: inst.id, state: pc.StateDir}
				if err := r.startProc(p, opErr); err != nil {
					return err
				}
				r.procs = append(r.procs, p)
				continue
			}
			op, err := operators.NewOperator(name, deps, pc)
			if err != nil {
				return fmt.Errorf("bench: operator %s: %w", inst.id, err)
			}
			opWG.Add(1)
			go pprof.Do(opCtx, pprof.Labels("role", name), func(opCtx context.Context) {
				defer opWG.Done()
				err := op.Run(opCtx)
				if err != nil && !errors.Is(err, pipeline.ErrStopped) {
					opErr <- fmt.Errorf("bench: operator %s: %w", inst.id, err)
				}
			})
		}
	}
	defer func() { stopOps(); opWG.Wait() }()
	defer func() {
		for _, p := range r.procs {
			stopProc(p)
		}
	}()
	if cfg.Processes != nil {
		rep.Processes = true
		if err := r.waitPolicyRead(ctx, opErr); err != nil {
			return err
		}
		packReady = make(chan struct{})
		close(packReady)
	}

	// Pack judges lag against the trainer version: start the source once
	// pack has read the policy release (a record judged against version 0
	// would be refused as ahead of the trainer).
	select {
	case <-packReady:
	case err := <-opErr:
		return err
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(60 * time.Second):
		return errors.New("bench: pack did not read the policy release within 60s")
	}
	r.inflight = make(chan struct{}, cfg.InFlightGroups)
	// The sink and the source are waited for on every return: the sink's
	// reader leaves its group as it closes (a dial of the coordinator),
	// and the run's transports are closed after this returns.
	sinkCtx, stopSink := context.WithCancel(context.Background())
	sinkErr, sinkDone := make(chan error, 1), make(chan struct{})
	defer func() { stopSink(); <-sinkDone }()
	r.acct = newAccounting()
	sinkReady := make(chan struct{})
	go pprof.Do(sinkCtx, pprof.Labels("role", "sink"), func(ctx context.Context) {
		defer close(sinkDone)
		sinkErr <- r.sink(ctx, sinkReady)
	})
	select {
	case <-sinkReady:
	case err := <-sinkErr:
		return err
	}
	srcCtx, stopSrc := context.WithCancel(ctx)
	srcErr, srcDone := make(chan error, 1), make(chan struct{})
	defer func() { stopSrc(); <-srcDone }()
	go pprof.Do(srcCtx, pprof.Labels("role", "source"), func(ctx context.Context) {
		defer close(srcDone)
		srcErr <- r.source(ctx)
	})

	fail := func() error {
		select {
		case err := <-opErr:
			return err
		case err := <-srcErr:
			if err != nil {
				return err
			}
		case err := <-sinkErr:
			if err != nil {
				return fmt.Errorf("bench: sink: %w", err)
			}
		default:
		}
		return nil
	}
	rss := &rssSampler{}
	if len(r.procs) > 0 {
		rss.procs = r.procsPSSMB
	}
	wait := func(phase string, d time.Duration, stop func() bool) error {
		start := time.Now()
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		lastTok := r.decidedToks.Load()
		lastT := start
		rate := 0.0
		for {
			if err := fail(); err != nil {
				return err
			}
			el := time.Since(start)
			if el >= d || (stop != nil && stop()) {
				return nil
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case now := <-tick.C:
				if dt := now.Sub(lastT); dt >= time.Second {
					tok := r.decidedToks.Load()
					rate = float64(tok-lastTok) / dt.Seconds()
					lastTok, lastT = tok, now
				}
				rss.sample(phase, rate)
				if cfg.Progress != nil {
					cfg.Progress(Progress{Phase: phase, Elapsed: el, Total: d, TokensPerS: rate, Decided: r.decidedToks.Load()})
				}
			}
		}
	}
	if err := wait("warmup", cfg.Warmup, nil); err != nil {
		return err
	}
	// Measurement window.
	snapStart := r.snapshot(ctx)
	r.mu.Lock()
	r.acct = newAccounting()
	r.mu.Unlock()
	for _, in := range r.stages {
		in.resetWait()
	}
	prof, err := startWindowProfile(cfg.CPURoles)
	if err != nil {
		return err
	}
	t0 := time.Now()
	var stopAt func() bool
	if cfg.Tokens > 0 {
		base := r.decidedToks.Load()
		stopAt = func() bool { return r.decidedToks.Load()-base >= cfg.Tokens }
	}
	if cfg.Kill != "" {
		inner := stopAt
		stopAt = func() bool {
			if rep.Kill == nil && time.Since(t0) >= cfg.KillAt {
				rep.Kill = r.kill(ctx, cfg.Kill, time.Since(t0), opErr)
			}
			return inner != nil && inner()
		}
	}
	if err := wait("measure", cfg.Duration, stopAt); err != nil {
		prof.stop()
		return err
	}
	window := time.Since(t0)
	snapEnd := r.snapshot(ctx)
	roles, err := prof.stop()
	if err != nil {
		return err
	}
	if cfg.Measured != nil {
		cfg.Measured()
	}
	r.mu.Lock()
	measured := r.acct
	r.acct = newAccounting() // the drain's decisions count for correctness only
	r.mu.Unlock()
	rep.fill(measured, snapStart, snapEnd, window, r)
	rep.CPUByRole = roleTable(roles, rep.hopBytes)
	rep.RSS = rss.samples

	// Drain: stop the source, wait for every launched attempt's fate.
	stopSrc()
	if err := <-srcErr; err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	srcErr <- nil
	drainStart := time.Now()
	if err := wait("drain", cfg.Drain, func() bool { return r.stream.InFlight() == 0 }); err != nil {
		return err
	}
	rep.DrainS = time.Since(drainStart).Seconds()
	rep.Accounting = r.stream.Counts()
	if rep.Accounting.Lost > 0 {
		rep.Undecided = r.locate(ctx)
	}
	rep.Duplicates = r.stream.Duplicates()
	if len(rep.Duplicates) > 0 {
		rep.DuplicateCensus = r.censusOf(ctx, rep.Duplicates)
	}
	stopSink()
	<-sinkDone
	stopOps()
	opWG.Wait()
	for _, p := range r.procs {
		stopProc(p)
	}
	select {
	case err := <-opErr:
		return err
	default:
	}
	return nil
}

func (r *run) publishPolicy(ctx context.Context) error {
	rel := schemas.PolicyRelease{
		PolicyVersion: r.cfg.Synth.PolicyVersion, TrainingStep: r.cfg.Synth.PolicyVersion,
		ContractHash: r.cfg.Contract.Hash(), CreatedAt: time.Now().UTC().Format(time.RFC3339), Ready: true,
	}
	b, err := schemas.EncodeRelease(rel)
	if err != nil {
		return fmt.Errorf("bench: encode policy release: %w", err)
	}
	w := &kafkago.Writer{Addr: kafkago.TCP(r.addr...), Topic: r.topics.Policy, RequiredAcks: kafkago.RequireAll, Transport: r.trans(),
		Compression: kafka.CompressionOf(r.cfg.Contract.Topics.Compression, "policy")}
	defer w.Close()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := w.WriteMessages(cctx, kafkago.Message{Key: []byte("policy"), Value: b}); err != nil {
		return fmt.Errorf("bench: publish policy release: %w", err)
	}
	return nil
}

// source produces synthetic groups, one message per group keyed by group
// id, as fast as the closed loop allows.
func (r *run) source(ctx context.Context) error {
	w := &kafkago.Writer{
		Addr: kafkago.TCP(r.addr...), Topic: r.topics.Trajectories, Balancer: &kafkago.Murmur2Balancer{},
		RequiredAcks: kafkago.RequireAll, Async: true, BatchSize: 64, BatchTimeout: 2 * time.Millisecond,
		BatchBytes: kafka.WriterBatchBytes(r.cfg.Contract.Topics.MaxMessageBytes),
		// Its requests are charged to the role of ctx in CPU profiles.
		Transport:   kafka.LabelRequests(ctx, r.trans()),
		Compression: kafka.CompressionOf(r.cfg.Contract.Topics.Compression, "trajectories"),
	}
	var werr atomic.Value
	w.Completion = func(msgs []kafkago.Message, err error) {
		if err != nil {
			werr.Store(err)
			return
		}
		for _, m := range msgs {
			m.WriterData.(func())() // the pooled buffer is written: recycle it
		}
	}
	trainer := r.cfg.Synth.PolicyVersion
	for g := int64(0); ; g++ {
		select {
		case <-ctx.Done():
			// Close flushes what was enqueued; a failed write would leave
			// launched attempts undecided, so it is reported.
			if err := w.Close(); err != nil {
				return fmt.Errorf("bench: produce: %w", err)
			}
			if err, _ := werr.Load().(error); err != nil {
				return fmt.Errorf("bench: produce: %w", err)
			}
			return nil
		case r.inflight <- struct{}{}:
		}
		if err, _ := werr.Load().(error); err != nil {
			w.Close()
			return fmt.Errorf("bench: produce: %w", err)
		}
		t0 := time.Now()
		rows := r.gen.Group(g)
		b, release, err := schemas.Trajectories.EncodePooled(rows)
		if err != nil {
			w.Close()
			return fmt.Errorf("bench: encode group %d: %w", g, err)
		}
		info := &groupInfo{rows: int32(len(rows))}
		info.remaining.Store(int32(len(rows)))
		now := time.Now()
		for i := range rows {
			all, act := synth.Tokens(&rows[i])
			oldest := trainer
			for k := range rows[i].Turns {
				oldest = min(oldest, rows[i].Turns[k].PolicyVersion)
			}
			info.tokens += int64(all)
			r.stream.Launch(rows[i].RecordID, audit.Attempt{
				Seq: g, Group: rows[i].GroupID, Tokens: all, ActionTokens: act,
				Lag: trainer - oldest, ProducedAt: now.UnixNano(),
			})
		}
		r.groups.Store(rows[0].GroupID, info)
		r.genNanos.Add(int64(time.Since(t0)))
		r.genTokens.Add(info.tokens)
		r.genBytes.Add(int64(len(b)))
		// Launched attempts must be produced: the write is not tied to ctx
		// (the async writer only enqueues; Close flushes).
		if err := w.WriteMessages(context.Background(), kafkago.Message{Key: []byte(rows[0].GroupID), Value: b, WriterData: release}); err != nil {
			w.Close()
			return fmt.Errorf("bench: produce: %w", err)
		}
		r.produced.Add(1)
	}
}

// kill kills the first instance of stage and restarts it; a failure to
// restart is reported through opErr.
func (r *run) kill(ctx context.Context, stage string, at time.Duration, opErr chan error) *KillReport {
	for _, p := range r.procs {
		if p.stage != stage {
			continue
		}
		down, err := r.killProc(ctx, p, opErr)
		if err != nil {
			select {
			case opErr <- err:
			default:
			}
		}
		return &KillReport{Stage: stage, Instance: p.id, AtS: at.Seconds(), DownS: down.Seconds()}
	}
	return &KillReport{Stage: stage}
}

// decided records one attempt's fate.
func (r *run) decided(f audit.Fate, now time.Time) {
	r.decidedToks.Add(int64(f.Tokens))
	r.mu.Lock()
	r.acct.add(f, now)
	r.mu.Unlock()
	if v, ok := r.groups.Load(f.Group); ok {
		gi := v.(*groupInfo)
		if gi.remaining.Add(-1) == 0 {
			r.groups.Delete(f.Group)
			r.groupsDone.Add(1)
			<-r.inflight
		}
	}
}

// sink reads the batches and census topics (the trainer's side) and
// accounts every attempt.
func (r *run) sink(ctx context.Context, ready chan<- struct{}) error {
	rd := kafkago.NewReader(kafkago.ReaderConfig{
		Brokers: r.addr, GroupID: r.runID + ".bench-sink", GroupTopics: []string{r.topics.Batches, r.topics.Census},
		Dialer: r.dialer, MinBytes: 1, MaxBytes: r.cfg.Contract.Topics.MaxMessageBytes + (1 << 20),
		MaxWait: kafka.FetchMaxWait, StartOffset: kafkago.FirstOffset, SessionTimeout: 10 * time.Second,
		HeartbeatInterval: time.Second, JoinGroupBackoff: 200 * time.Millisecond,
		QueueCapacity: 4, // batches are large: a short queue bounds what is read ahead
	})
	defer rd.Close()
	close(ready)
	for {
		m, err := rd.FetchMessage(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		now := time.Now()
		t0 := now
		switch m.Topic {
		case r.topics.Batches:
			b, err := schemas.PackedBatches.DecodeShared(nil, m.Value)
			if err != nil {
				return fmt.Errorf("batch at %d: %w", m.Offset, err)
			}
			r.sinkBytes.Add(int64(len(m.Value) + len(m.Key)))
			r.batchesSeen.Add(1)
			r.mu.Lock()
			r.acct.batch(&b)
			if !m.Time.IsZero() {
				r.acct.batchHop.add(float64(now.Sub(m.Time).Microseconds()) / 1e3)
			}
			r.mu.Unlock()
			for _, f := range r.stream.Batch(&b) {
				r.decided(f, now)
			}
		case r.topics.Census:
			ev, err := schemas.DecodeCensus(m.Value)
			if err != nil {
				return fmt.Errorf("census at %d: %w", m.Offset, err)
			}
			if f, ok := r.stream.Census(&ev); ok {
				r.decided(f, now)
			}
		}
		r.sinkNanos.Add(int64(time.Since(t0)))
	}
}

// snapshot is the counters at one instant.
type snapshot struct {
	at       time.Time
	produced int64
	genNanos int64
	genToks  int64
	genBytes int64
	sinkB    int64
	sinkNs   int64
	stages   map[string]instanceStats
	cpu      time.Duration
}

// snapshot reads the counters; those of operator processes from their
// /metrics (stages in processes: no rows or tokens).
func (r *run) snapshot(ctx context.Context) snapshot {
	s := snapshot{
		at: time.Now(), produced: r.produced.Load(), genNanos: r.genNanos.Load(), genToks: r.genTokens.Load(),
		genBytes: r.genBytes.Load(), sinkB: r.sinkBytes.Load(), sinkNs: r.sinkNanos.Load(),
		stages: map[string]instanceStats{}, cpu: r.cpu(),
	}
	for _, in := range r.stages {
		s.stages[in.id] = in.load()
	}
	for _, p := range r.procs {
		s.stages[p.id] = p.counters(ctx)
	}
	return s
}

// sortedStageIDs lists instance ids in pipeline order.
func (r *run) instances(stage string) []*instance {
	var out []*instance
	for _, in := range r.stages {
		if in.stage == stage {
			out = append(out, in)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out
}

// segmentBytes is the embedded broker's log segment size when its log is
// in memory, where a segment is heap; on disk (Config.DataDir) it is
// onDisk times this, as every retention is. Each segment is a file and
// its index, created when the segment opens and removed with it: at the
// pipeline's ~330 MB/s, 2 MiB segments meant ~160 files opened and
// removed per second; 16 MiB ones raised the pipeline's bytes per
// CPU-second by 3-8% and the raw baseline's by 7-10% (bench/RESULTS.md).
const segmentBytes = 2 << 20

// segmentSize is the embedded broker's log segment size for this run.
func (r *run) segmentSize() int64 { return r.onDisk() * segmentBytes }

// retentionBytes is the embedded broker's retention per partition. The
// closed loop keeps at most InFlightGroups group messages unread on a
// topic, spread over its partitions by key; four times that share (with
// the pre-clip mean length, so larger than the mean message) and a
// segment is never reached by a consumer that keeps up, and never less
// than 24 MiB. TRAJFLOW_BENCH_RETENTION overrides it.
func (r *run) retentionBytes() int64 {
	if v, err := strconv.ParseInt(os.Getenv("TRAJFLOW_BENCH_RETENTION"), 10, 64); err == nil {
		return v
	}
	// ~9 bytes per token on the wire (8.1 measured for the bench source).
	share := 4 * r.inflightTokens() * 9 / float64(max(r.cfg.Contract.Topics.Partitions, 1))
	return r.onDisk() * max(24<<20, int64(share)+segmentBytes)
}

// onDisk is the factor of every retention of a broker whose log is on
// disk (Config.DataDir): the bounds above are sized to keep the heap
// small, and a disk has room for more, so a consumer that falls behind
// (a restarted operator of a kill run) finds its records further back.
func (r *run) onDisk() int64 {
	if r.cfg.DataDir != "" {
		return 8
	}
	return 1
}

// brokerBound bounds what the embedded broker retains while the pipeline
// runs (the baseline's topic is deleted before): four data topics, the
// batches topic and the low-rate topics (see the retention settings in
// Run).
func (r *run) brokerBound(retention int64) int64 {
	bound := 4*int64(max(r.cfg.Contract.Topics.Partitions, 1))*(retention+segmentBytes) + r.batchesRetention()
	for _, t := range r.lowRateRetention() {
		bound += t.bytes
	}
	return bound
}

// topicRetention is a retention in bytes set on one topic.
type topicRetention struct {
	topic string
	bytes int64
}

// lowRateRetention is the retention of the low-rate topics: the census is
// read promptly by the accounting reader, the rest is never read back
// during a bench.
func (r *run) lowRateRetention() []topicRetention {
	k := r.onDisk()
	return []topicRetention{{r.topics.Census, k * 8 << 20}, {r.topics.Quarantine, k * 2 << 20}, {r.topics.Windows, k * 2 << 20}, {r.topics.Incidents, k * 2 << 20}}
}

// inflightTokens is the tokens of the groups the closed loop keeps in
// flight, at the pre-clip mean length.
func (r *run) inflightTokens() float64 {
	return float64(r.cfg.InFlightGroups) * float64(r.cfg.Contract.Sampler.GroupSize) * r.cfg.Synth.MeanTokens
}

// batchesRetention is the batches topic's retention: room for twice the
// batches the in-flight groups fill (all of them may sit there unread),
// at least four.
func (r *run) batchesRetention() int64 {
	c := r.cfg.Contract
	n := max(4, 2*int64(math.Ceil(r.inflightTokens()/float64(max(c.Packing.BatchTokens, 1)))))
	return r.onDisk() * n * batchBytesEstimate(c)
}

// batchBytesEstimate bounds one packed batch's encoded size: ~33 bytes per
// token slot (ids, positions, segments, mask, log-probs, advantages, value
// targets, turns, versions) plus the trajectory ids.
func batchBytesEstimate(c *contract.Contract) int64 {
	return int64(c.Packing.BatchTokens+c.Packing.TokenBudget) * 40
}

func (r *run) setRetentionBytes(ctx context.Context, topic string, n int64) error {
	cl := &kafkago.Client{Addr: kafkago.TCP(r.addr...), Transport: r.trans(), Timeout: 30 * time.Second}
	resp, err := cl.AlterConfigs(ctx, &kafkago.AlterConfigsRequest{Resources: []kafkago.AlterConfigRequestResource{{
		ResourceType: kafkago.ResourceTypeTopic, ResourceName: topic,
		Configs: []kafkago.AlterConfigRequestConfig{{Name: "retention.bytes", Value: strconv.FormatInt(n, 10)}},
	}}})
	if err != nil {
		return fmt.Errorf("bench: set retention of %s: %w", topic, err)
	}
	for _, e := range resp.Errors {
		if e != nil {
			return fmt.Errorf("bench: set retention of %s: %w", topic, e)
		}
	}
	return nil
}

// cleanUp deletes the run's topics from the cluster, within 30 s even
// when ctx has ended, and says what it did for the report.
func (r *run) cleanUp(ctx context.Context, specs []kafka.TopicSpec) string {
	names := make([]string, len(specs))
	for i, s := range specs {
		names[i] = s.Name
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	n, err := r.deleteTopics(dctx, names...)
	if err != nil {
		return fmt.Sprintf("%d deleted, not deleted: %v", n, err)
	}
	return fmt.Sprintf("deleted (%d)", n)
}

// deleteTopics deletes topics (those already gone, as a baseline's after
// it ran, are no error) and returns how many it deleted.
func (r *run) deleteTopics(ctx context.Context, topics ...string) (int, error) {
	cl := &kafkago.Client{Addr: kafkago.TCP(r.addr...), Transport: r.trans(), Timeout: 30 * time.Second}
	resp, err := cl.DeleteTopics(ctx, &kafkago.DeleteTopicsRequest{Topics: topics})
	if err != nil {
		return 0, fmt.Errorf("bench: delete topics: %w", err)
	}
	deleted := 0
	var errs []error
	for _, t := range topics {
		switch e := resp.Errors[t]; {
		case e == nil:
			deleted++
		case errors.Is(e, kafkago.UnknownTopicOrPartition):
		default:
			errs = append(errs, fmt.Errorf("bench: delete %s: %w", t, e))
		}
	}
	return deleted, errors.Join(errs...)
}

// locate finds, for up to 8 undecided groups, the topics holding a message
// keyed by the group id.
func (r *run) locate(ctx context.Context) map[string][]string {
	groups := map[string]bool{}
	for _, a := range r.stream.Undecided(64) {
		if len(groups) < 8 {
			groups[a.Group] = true
		}
	}
	out := map[string][]string{}
	cfg := &pipeline.Config{Brokers: r.addr, Dialer: r.dialer}
	for _, topic := range []string{r.topics.Trajectories, r.topics.Valid, r.topics.Rewarded, r.topics.Scored, r.topics.Quarantine} {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := pipeline.ScanTail(cctx, cfg, topic, 0, func(m pipeline.Message) error {
			if groups[string(m.Key)] {
				out[string(m.Key)] = append(out[string(m.Key)], fmt.Sprintf("%s@%d/%d", topic, m.Partition, m.Offset))
			}
			return nil
		})
		cancel()
		if err != nil {
			out["error"] = append(out["error"], err.Error())
		}
	}
	for g := range groups {
		if _, ok := out[g]; !ok {
			out[g] = []string{"nowhere (retention?)"}
		}
	}
	return out
}

// censusOf lists the census events of the attempts named "id@batch".
func (r *run) censusOf(ctx context.Context, names []string) map[string][]string {
	ids := map[string]bool{}
	for _, n := range names {
		id, _, _ := strings.Cut(n, "@")
		ids[id] = true
	}
	out := map[string][]string{}
	cfg := &pipeline.Config{Brokers: r.addr, Dialer: r.dialer}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err := pipeline.ScanTail(cctx, cfg, r.topics.Census, 0, func(m pipeline.Message) error {
		ev, err := schemas.DecodeCensus(m.Value)
		if err == nil && ids[ev.AttemptID] {
			out[ev.AttemptID] = append(out[ev.AttemptID], ev.Stage+":"+ev.Kind+":"+ev.Reason+":"+ev.BatchID)
		}
		return nil
	})
	if err != nil {
		out["error"] = []string{err.Error()}
	}
	return out
}
