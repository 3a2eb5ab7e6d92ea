package peers

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/trajflow/trajflow/bench"
	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/internal/orphan"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// Systems a Run can measure.
const (
	SysTrajflow      = "trajflow"       // trajflow on the embedded broker (+ raw kafka-go and franz-go on it)
	SysTrajflowKafka = "trajflow-kafka" // trajflow on Apache Kafka (+ raw kafka-go and franz-go on it)
	SysRay           = "ray"
	SysZeroMQ        = "zeromq"
	SysZeroMQGo      = "zeromq-go"     // the Go ZeroMQ peer (package zmqpeer) on the pure-Go zmq4
	SysZeroMQLibzmq  = "zeromq-libzmq" // the same peer on libzmq (a trajflow built with -tags libzmq)
	SysFiles         = "files"         // files renamed into the next stage's directory, as prime-rl's filesystem transport
)

// The ZeroMQ implementations the Go ZeroMQ peer runs on (bench peers-zmq
// --impl; package zmqpeer): SysZeroMQGo on ZmqImplPure, SysZeroMQLibzmq on
// ZmqImplLibzmq.
const (
	ZmqImplPure   = "zmq4"
	ZmqImplLibzmq = "libzmq"
)

// The ZeroMQ transports of the ZeroMQ peers (bench peers --zmq-transport):
// TCP on 127.0.0.1, or Unix sockets (ipc://, in Linux's abstract
// namespace), the counterpart of the embedded broker's local socket.
const (
	ZmqTCP = "tcp"
	ZmqIPC = "ipc"
)

// CheckZmqTransport fails for a transport other than ZmqTCP and ZmqIPC,
// naming both.
func CheckZmqTransport(t string) error {
	if t != ZmqTCP && t != ZmqIPC {
		return fmt.Errorf("%q: want %s or %s", t, ZmqTCP, ZmqIPC)
	}
	return nil
}

// AllSystems is every system, in the order a round runs them.
var AllSystems = []string{SysTrajflow, SysTrajflowKafka, SysRay, SysZeroMQ, SysZeroMQGo, SysZeroMQLibzmq, SysFiles}

// DefaultSystems is every system a run can measure with the Apache Kafka
// at kafka ("" for none) and with libzmq compiled in or not: trajflow-kafka
// needs the one, zeromq-libzmq the other.
func DefaultSystems(kafka string, libzmq bool) []string {
	var out []string
	for _, s := range AllSystems {
		if (s != SysTrajflowKafka || kafka != "") && (s != SysZeroMQLibzmq || libzmq) {
			out = append(out, s)
		}
	}
	return out
}

// ErrConfig marks a Config that Run refuses before it runs anything: an
// unknown system or stage, or a system that this binary or configuration
// cannot run.
var ErrConfig = errors.New("peers: configuration refused")

// configError is an error of ErrConfig with its own message.
type configError struct{ error }

func (configError) Is(target error) bool { return target == ErrConfig }

// pythonSystems are the systems that run in the Python peers' virtual
// environment (python -m trajflow_peers.run).
var pythonSystems = []string{SysRay, SysZeroMQ, SysFiles}

// NeedsPython reports whether any of systems runs in the Python peers'
// virtual environment.
func NeedsPython(systems []string) bool {
	return slices.ContainsFunc(systems, func(s string) bool { return slices.Contains(pythonSystems, s) })
}

// Config configures Run.
type Config struct {
	// Binary is the trajflow binary the trajflow runs use; ContractPath
	// its contract file (Contract the same, loaded).
	Binary       string
	ContractPath string
	Contract     *contract.Contract
	// Python is the interpreter of the peers' virtual environment
	// (bench/peers/python/setup.sh); PythonPath the folder that holds
	// the trajflow_peers package.
	Python, PythonPath string
	Systems            []string
	// Kafka is the bootstrap address of an Apache Kafka for
	// trajflow-kafka; KafkaPid its broker's process id when it runs on
	// this machine (its CPU time is added to that run's figures).
	Kafka    string
	KafkaPid int
	// Libzmq says whether Binary has libzmq compiled in (build tag libzmq,
	// zmqpeer.LibzmqBuilt), which zeromq-libzmq needs.
	Libzmq bool
	// ZmqTransport is the ZeroMQ peers' transport, ZmqTCP (the default)
	// or ZmqIPC; their rows name it when it is ZmqIPC.
	ZmqTransport string
	// KafkaScript and KafkaHome start the broker when Kafka is KafkaAuto
	// (StartLocalKafka); Run stops it before it returns.
	KafkaScript, KafkaHome string
	// KafkaWarmup is how long unrecorded trajflow-kafka runs (warmKafka)
	// load the broker before the first round: a broker JVM just started
	// interprets its hot paths until the JIT compiler has compiled them,
	// which would charge the first round's runs (the raw clients'
	// baselines first) for it.
	KafkaWarmup time.Duration
	Rounds      int
	Duration    time.Duration
	Warmup      time.Duration
	Baseline    time.Duration
	// Kill names the stage whose process each kill run SIGKILLs once, half
	// way through its window ("" runs no kill runs).
	Kill             string
	CorpusGroups     int
	InFlight         int
	RayGroupsPerCall int
	// OutDir receives the corpus and every run's JSON; Log the progress.
	OutDir string
	Log    io.Writer
}

func (c *Config) defaults() error {
	if c.Rounds <= 0 {
		c.Rounds = 2
	}
	if c.Duration <= 0 {
		c.Duration = 15 * time.Second
	}
	if c.Warmup < 0 {
		c.Warmup = 0
	}
	if c.Baseline == 0 {
		c.Baseline = 6 * time.Second
	}
	if c.CorpusGroups <= 0 {
		c.CorpusGroups = 256
	}
	if c.InFlight <= 0 {
		c.InFlight = 192
	}
	if c.RayGroupsPerCall <= 0 {
		c.RayGroupsPerCall = 8
	}
	if len(c.Systems) == 0 {
		c.Systems = DefaultSystems(c.Kafka, c.Libzmq)
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	if c.ZmqTransport == "" {
		c.ZmqTransport = ZmqTCP
	}
	if err := CheckZmqTransport(c.ZmqTransport); err != nil {
		return configError{fmt.Errorf("peers: --zmq-transport %w", err)}
	}
	for _, s := range c.Systems {
		switch s {
		case SysTrajflow, SysRay, SysZeroMQ, SysZeroMQGo, SysFiles:
		case SysZeroMQLibzmq:
			if !c.Libzmq {
				return configError{errors.New("peers: zeromq-libzmq needs a trajflow built with libzmq: go build -tags libzmq -o bin/trajflow ./cmd/trajflow (cgo and libzmq's headers, Debian's libzmq3-dev)")}
			}
		case SysTrajflowKafka:
			if c.Kafka == "" {
				return configError{errors.New("peers: trajflow-kafka needs --kafka (bootstrap address of an Apache Kafka, e.g. deploy/local/kafka.sh up)")}
			}
			if c.Kafka == KafkaAuto && (c.KafkaScript == "" || c.KafkaHome == "") {
				return configError{errors.New("peers: --kafka auto needs the script that starts Apache Kafka and the broker's home (--kafka-script, --kafka-home)")}
			}
		default:
			return configError{fmt.Errorf("peers: --systems: no system %q (have %s)", s, strings.Join(AllSystems, ", "))}
		}
	}
	if c.Kill != "" && !slices.Contains(bench.Stages, c.Kill) {
		return configError{fmt.Errorf("peers: --kill: no stage %q (have %s)", c.Kill, strings.Join(bench.Stages, ", "))}
	}
	if c.Binary == "" || c.ContractPath == "" || c.Contract == nil || c.OutDir == "" {
		return errors.New("peers: Binary, ContractPath, Contract and OutDir are required")
	}
	return nil
}

// Row is one system's figures in one run. Policy tokens are the tokens the
// policy sampled (action tokens) of the attempts decided in the window.
type Row struct {
	System string `json:"system"`
	Round  int    `json:"round"`
	Kill   bool   `json:"kill_run"`
	// Hops is how many hops the bytes crossed (1 for a raw client).
	Hops                int     `json:"hops"`
	PolicyTokensPerS    float64 `json:"policy_tokens_per_s"`
	TokensPerS          float64 `json:"tokens_per_s"`
	MBPerS              float64 `json:"mb_s"`
	P50MS               float64 `json:"p50_ms"`
	P99MS               float64 `json:"p99_ms"`
	CPUCores            float64 `json:"cpu_cores"`
	CPUSPerMPolicy      float64 `json:"cpu_s_per_m_policy_tokens"`
	PolicyTokensPerCPUS float64 `json:"policy_tokens_per_cpu_s"`
	MBPerCPUS           float64 `json:"mb_per_cpu_s"`
	PeakMB              float64 `json:"peak_mb"`
	// Lost and Duplicated count attempts (kill runs: after the kill and
	// the drain); -1 when the system has no trainer end (raw clients).
	Lost       int64      `json:"lost_attempts"`
	Duplicated int64      `json:"duplicated_attempts"`
	Launched   int64      `json:"launched_attempts"`
	LoadAvg    [3]float64 `json:"load_avg"`
	Note       string     `json:"note,omitempty"`
	File       string     `json:"file,omitempty"`
}

// Result is a whole Run.
type Result struct {
	Started  time.Time `json:"started"`
	Machine  string    `json:"machine"`
	Command  string    `json:"command"`
	Corpus   string    `json:"corpus"`
	Rows     []Row     `json:"rows"`
	Duration float64   `json:"window_s"`
	InFlight int       `json:"inflight_groups"`
	// ActionShare is the share of policy tokens among all tokens of the
	// source (raw rows convert their tokens with it).
	ActionShare float64 `json:"action_share"`
}

// Run exports the corpus, then runs every system once per round,
// alternating, then (with Kill) one kill run of each system that has a
// trainer end, and returns every row.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.OutDir, 0o755); err != nil {
		return nil, fmt.Errorf("peers: %w", err)
	}
	res := &Result{Started: time.Now().UTC(), Machine: Machine(), Duration: cfg.Duration.Seconds(), InFlight: cfg.InFlight}
	corpusPath := filepath.Join(cfg.OutDir, "corpus.bin")
	fmt.Fprintf(cfg.Log, "exporting %d groups through the stages into %s\n", cfg.CorpusGroups, corpusPath)
	cp, err := BuildCorpus(ctx, cfg.Contract, synth.Bench(), cfg.CorpusGroups)
	if err != nil {
		return nil, err
	}
	if err := cp.Write(corpusPath); err != nil {
		return nil, err
	}
	res.Corpus = corpusPath
	onKafka := slices.Contains(cfg.Systems, SysTrajflowKafka)
	if cfg.Kafka == KafkaAuto && onKafka {
		fmt.Fprintf(cfg.Log, "starting Apache Kafka with %s (home %s)\n", cfg.KafkaScript, cfg.KafkaHome)
		k, err := StartLocalKafka(ctx, cfg.KafkaScript, cfg.KafkaHome, cfg.Log)
		if err != nil {
			return nil, err
		}
		defer func() {
			if err := k.Stop(); err != nil {
				fmt.Fprintln(cfg.Log, err)
			}
		}()
		cfg.Kafka, cfg.KafkaPid = k.Addr, k.Pid
	}
	var tok, act int64
	for _, g := range cp.Groups {
		tok += g.Tokens
		act += g.Action
	}
	res.ActionShare = float64(act) / float64(max(tok, 1))
	if cfg.KafkaWarmup > 0 && onKafka {
		if err := warmKafka(ctx, cfg, corpusPath, res.ActionShare); err != nil {
			return nil, err
		}
	}
	for round := 1; round <= cfg.Rounds; round++ {
		for _, sys := range cfg.Systems {
			rows, err := runOne(ctx, &cfg, sys, round, false, corpusPath, res.ActionShare)
			if err != nil {
				return nil, err
			}
			res.Rows = append(res.Rows, rows...)
		}
	}
	if cfg.Kill != "" {
		for _, sys := range cfg.Systems {
			if sys == SysTrajflowKafka {
				continue // the kill run of trajflow is on the embedded broker
			}
			rows, err := runOne(ctx, &cfg, sys, 0, true, corpusPath, res.ActionShare)
			if err != nil {
				return nil, err
			}
			res.Rows = append(res.Rows, rows...)
		}
	}
	return res, nil
}

// warmRunMax is the longest of the unrecorded runs that warm Apache
// Kafka's JVM. Each run deletes its topics when it ends, so the broker's
// disk holds at most one short run's log at a time (a run moves a few
// hundred MB a second; one 90-s run would leave over 30 GB on the
// broker's disk until it ended).
const warmRunMax = 30 * time.Second

// warmKafka loads the broker with unrecorded trajflow-kafka runs, at most
// warmRunMax each, until cfg.KafkaWarmup of pipeline time has passed, each
// with the rounds' own baselines (so the raw clients' requests are
// compiled too, with no more baseline data than a round writes).
func warmKafka(ctx context.Context, cfg Config, corpusPath string, actionShare float64) error {
	fmt.Fprintf(cfg.Log, "warming up Apache Kafka's JVM: %s of runs, not recorded\n", cfg.KafkaWarmup)
	for _, d := range warmRuns(cfg.KafkaWarmup) {
		w := cfg
		w.Duration = d
		if _, err := runOne(ctx, &w, SysTrajflowKafka, 0, false, corpusPath, actionShare); err != nil {
			return err
		}
	}
	return nil
}

// warmRuns splits a warm-up into runs of at most warmRunMax.
func warmRuns(total time.Duration) []time.Duration {
	var runs []time.Duration
	for left := total; left > 0; left -= warmRunMax {
		runs = append(runs, min(left, warmRunMax))
	}
	return runs
}

// runOne runs one system once as a child process and returns its rows.
func runOne(ctx context.Context, cfg *Config, sys string, round int, kill bool, corpusPath string, actionShare float64) ([]Row, error) {
	tag := fmt.Sprintf("%s-r%d", sys, round)
	if kill {
		tag = sys + "-kill-" + cfg.Kill
	}
	out := filepath.Join(cfg.OutDir, tag+".json")
	load := LoadAvg()
	fmt.Fprintf(cfg.Log, "%s  %-28s load %.2f %.2f %.2f\n", time.Now().UTC().Format("15:04:05"), tag, load[0], load[1], load[2])
	var rows []Row
	var err error
	switch sys {
	case SysTrajflow, SysTrajflowKafka:
		rows, err = runTrajflow(ctx, cfg, sys, kill, out, actionShare)
	case SysZeroMQGo, SysZeroMQLibzmq:
		rows, err = runZmqGo(ctx, cfg, sys, kill, corpusPath, out)
	default:
		rows, err = runPython(ctx, cfg, sys, kill, corpusPath, out)
	}
	if err != nil {
		return nil, fmt.Errorf("peers: %s: %w", tag, err)
	}
	for i := range rows {
		rows[i].Round, rows[i].Kill, rows[i].File = round, kill, filepath.Base(out)
		if rows[i].LoadAvg == [3]float64{} {
			rows[i].LoadAvg = load
		}
	}
	return rows, nil
}

// runTrajflow runs `trajflow bench` and turns its report into rows: the
// pipeline and, outside kill runs, each raw client's baseline on the same
// broker.
func runTrajflow(ctx context.Context, cfg *Config, sys string, kill bool, out string, actionShare float64) ([]Row, error) {
	args := []string{"bench", "--contract", cfg.ContractPath, "--duration", cfg.Duration.String(), "--warmup", cfg.Warmup.String(),
		"--inflight-groups", strconv.Itoa(cfg.InFlight), "--json-out", out}
	if kill {
		args = append(args, "--processes", "--kill", cfg.Kill, "--baseline", "-1s")
	} else {
		args = append(args, "--baseline", cfg.Baseline.String(), "--baselines", bench.ClientKafkaGo+","+bench.ClientFranzGo)
	}
	where := "embedded broker"
	if sys == SysTrajflow {
		// The embedded broker keeps its log on disk, as a deployed
		// `trajflow broker --data` does: durable like Apache Kafka's, and
		// its segments in the page cache rather than in the bench
		// process's heap (bench/RESULTS.md measures both).
		dir := strings.TrimSuffix(out, ".json") + ".broker"
		if err := os.RemoveAll(dir); err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
		args = append(args, "--data-dir", dir)
		where = "embedded broker, log on disk"
	}
	if sys == SysTrajflowKafka {
		args = append(args, "--brokers", cfg.Kafka)
		where = "Apache Kafka"
		if cfg.KafkaPid > 0 {
			args = append(args, "--cpu-pids", strconv.Itoa(cfg.KafkaPid))
			where += " (its JVM's CPU counted)"
		}
	}
	cmd := exec.CommandContext(ctx, cfg.Binary, args...)
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = io.Discard, &stderr
	orphan.DieWithParent(cmd)
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("%s %s: %w: %s", cfg.Binary, strings.Join(args, " "), err, tail(stderr.String()))
	}
	b, err := os.ReadFile(out)
	if err != nil {
		return nil, err
	}
	var rep bench.Report
	if err := json.Unmarshal(b, &rep); err != nil {
		return nil, fmt.Errorf("%s: %w", out, err)
	}
	name := "trajflow (" + where + ")"
	if kill {
		name = "trajflow (operator processes)"
	}
	r := Row{System: name, Hops: len(bench.Stages) + 1, PolicyTokensPerS: rep.E2EActionTokensPerS, TokensPerS: rep.E2ETokensPerS,
		MBPerS: rep.PipelineMBPerS, P50MS: rep.LatencyMS.P50, P99MS: rep.LatencyMS.P99, CPUCores: rep.CPUCores,
		MBPerCPUS: rep.PipelineMBPerCPUS, PeakMB: peakInWindow(&rep), Lost: int64(rep.Accounting.Lost),
		Duplicated: int64(rep.Accounting.Duplicated), Launched: int64(rep.Accounting.Launched)}
	r.fillCPU()
	if kill && rep.Kill != nil {
		r.Note = fmt.Sprintf("%s SIGKILLed at %.1fs, back after %.2fs; bytes from each process's /metrics", rep.Kill.Stage, rep.Kill.AtS, rep.Kill.DownS)
	}
	rows := []Row{r}
	for _, bl := range rep.Baselines {
		br := Row{System: "raw " + bl.Client + " (" + where + ")", Hops: 1, TokensPerS: bl.TokensPerS,
			PolicyTokensPerS: bl.TokensPerS * actionShare, MBPerS: bl.MBPerS, CPUCores: bl.CPUCores, MBPerCPUS: bl.MBPerCPUS,
			Lost: -1, Duplicated: -1, Note: "one hop, no operator work; same process and broker as the trajflow row"}
		br.fillCPU()
		rows = append(rows, br)
	}
	return rows, nil
}

// fillCPU derives the per-CPU figures from the rates and the cores.
func (r *Row) fillCPU() {
	if r.CPUCores > 0 && r.PolicyTokensPerS > 0 {
		r.PolicyTokensPerCPUS = r.PolicyTokensPerS / r.CPUCores
		r.CPUSPerMPolicy = 1e6 / r.PolicyTokensPerCPUS
	}
}

// peakInWindow is the largest memory sample of the measurement window (the
// process's VmHWM also covers the baselines before it): the process's RSS,
// or with operator processes the proportional set sizes of all of them, as
// the peers' trees are measured.
func peakInWindow(rep *bench.Report) float64 {
	peak := 0.0
	for _, s := range rep.RSS {
		if s.Phase != "measure" {
			continue
		}
		if s.PSSMB > 0 {
			peak = max(peak, s.PSSMB+s.OperatorsMB)
		} else {
			peak = max(peak, s.MB)
		}
	}
	if peak == 0 {
		return rep.PeakRSSMB
	}
	return peak
}

// PeerReport is what one run of a peer prints as JSON: the
// Python peers (python -m trajflow_peers.run) and the Go ZeroMQ peer
// (trajflow bench peers-zmq, package zmqpeer) alike.
type PeerReport struct {
	System           string         `json:"system"`
	GroupsPerCall    int            `json:"groups_per_call"`
	InFlightGroups   int            `json:"inflight_groups"`
	CorpusGroups     int            `json:"corpus_groups"`
	WindowS          float64        `json:"window_s"`
	Groups           int64          `json:"groups"`
	Batches          int64          `json:"batches"`
	TokensPerS       float64        `json:"tokens_per_s"`
	ActionTokensPerS float64        `json:"action_tokens_per_s"`
	MBPerS           float64        `json:"mb_s"`
	CPUS             float64        `json:"cpu_s"`
	CPUCores         float64        `json:"cpu_cores"`
	MBPerCPUS        float64        `json:"mb_per_cpu_s"`
	PeakMB           float64        `json:"peak_mb"`
	ProducedGroups   int64          `json:"produced_groups"`
	DecidedGroups    int64          `json:"decided_groups"`
	LostGroups       int64          `json:"lost_groups"`
	LostAttempts     int64          `json:"lost_attempts"`
	DuplicateGroups  int64          `json:"duplicate_groups"`
	LateGroups       int64          `json:"late_groups"`
	StartupS         float64        `json:"startup_s"`
	LoadAvg          []float64      `json:"load_avg"`
	Latency          PeerLatency    `json:"latency_ms"`
	Kill             *PeerKillEvent `json:"kill,omitempty"`
}

// PeerLatency is the distribution of the time from the rollout's send of
// a group to the trainer's receipt of its batch, in milliseconds.
type PeerLatency struct {
	P50   float64 `json:"p50"`
	P90   float64 `json:"p90"`
	P99   float64 `json:"p99"`
	Max   float64 `json:"max"`
	Count int     `json:"count"`
}

// PeerKillEvent is the kill of a kill run: the stage, when into the
// window, and how long its restart took.
type PeerKillEvent struct {
	Stage    string  `json:"stage"`
	AtS      float64 `json:"at_s"`
	RestartS float64 `json:"restart_s"`
}

// runPython runs one Python peer (python -m trajflow_peers.run).
func runPython(ctx context.Context, cfg *Config, sys string, kill bool, corpusPath, out string) ([]Row, error) {
	if cfg.Python == "" {
		return nil, errors.New("no Python interpreter for the peers (bench/peers/python/setup.sh prints it)")
	}
	args := []string{"-m", "trajflow_peers.run", "--system", sys, "--corpus", corpusPath, "--duration",
		strconv.FormatFloat(cfg.Duration.Seconds(), 'f', -1, 64), "--warmup", strconv.FormatFloat(cfg.Warmup.Seconds(), 'f', -1, 64),
		"--inflight", strconv.Itoa(cfg.InFlight), "--groups-per-call", strconv.Itoa(cfg.RayGroupsPerCall)}
	if kill {
		args = append(args, "--kill", cfg.Kill)
	}
	if sys == SysZeroMQ {
		args = append(args, "--zmq-transport", cfg.ZmqTransport)
	}
	cmd := exec.CommandContext(ctx, cfg.Python, args...)
	cmd.Env = append(os.Environ(), "PYTHONPATH="+cfg.PythonPath)
	p, err := runPeer(cmd, sys, out)
	if err != nil {
		return nil, err
	}
	name := fmt.Sprintf("Ray (actors, object store, %d groups/call)", p.GroupsPerCall)
	switch sys {
	case SysZeroMQ:
		name = "ZeroMQ + msgpack (processes)" + cfg.zmqSuffix()
	case SysFiles:
		name = FilesName
	}
	return []Row{peerRow(cfg, name, p, kill)}, nil
}

// FilesName is the files peer's row: msgpack files renamed into the next
// stage's directory on the local disk, one process per hop.
const FilesName = "files + msgpack (processes, local disk)"

// The Go ZeroMQ peer's rows, on each implementation.
const (
	ZeroMQGoName     = "ZeroMQ in Go (zmq4 frames, processes)"
	ZeroMQLibzmqName = "ZeroMQ in Go on libzmq (pebbe/zmq4 frames, processes)"
)

// runZmqGo runs the Go ZeroMQ peer (trajflow bench peers-zmq) of sys on
// its ZeroMQ implementation.
func runZmqGo(ctx context.Context, cfg *Config, sys string, kill bool, corpusPath, out string) ([]Row, error) {
	impl, name := ZmqImplPure, ZeroMQGoName
	if sys == SysZeroMQLibzmq {
		impl, name = ZmqImplLibzmq, ZeroMQLibzmqName
	}
	args := []string{"bench", "peers-zmq", "--impl", impl, "--transport", cfg.ZmqTransport, "--corpus", corpusPath,
		"--duration", cfg.Duration.String(), "--warmup", cfg.Warmup.String(), "--inflight-groups", strconv.Itoa(cfg.InFlight)}
	if kill {
		args = append(args, "--kill", cfg.Kill)
	}
	p, err := runPeer(exec.CommandContext(ctx, cfg.Binary, args...), sys, out)
	if err != nil {
		return nil, err
	}
	return []Row{peerRow(cfg, name+cfg.zmqSuffix(), p, kill)}, nil
}

// zmqSuffix ends the name of a ZeroMQ row that does not run over TCP.
func (c *Config) zmqSuffix() string {
	if c.ZmqTransport == ZmqIPC {
		return " over ipc"
	}
	return ""
}

// runPeer runs one peer's command, keeps its output in out and
// reads its report: the last line of its standard output (Ray may print
// notices before it).
func runPeer(cmd *exec.Cmd, sys, out string) (*PeerReport, error) {
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	orphan.DieWithParent(cmd)
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("%s: %w: %s", strings.Join(cmd.Args, " "), err, tail(stderr.String()))
	}
	if err := os.WriteFile(out, stdout.Bytes(), 0o644); err != nil {
		return nil, err
	}
	lines := bytes.Split(bytes.TrimSpace(stdout.Bytes()), []byte("\n"))
	var p PeerReport
	if err := json.Unmarshal(lines[len(lines)-1], &p); err != nil {
		return nil, fmt.Errorf("output of %s: %w: %q", sys, err, tail(stdout.String()))
	}
	return &p, nil
}

// peerRow is the row of a peer's report.
func peerRow(cfg *Config, name string, p *PeerReport, kill bool) Row {
	r := Row{System: name, Hops: len(bench.Stages) + 1, PolicyTokensPerS: p.ActionTokensPerS, TokensPerS: p.TokensPerS,
		MBPerS: p.MBPerS, P50MS: p.Latency.P50, P99MS: p.Latency.P99, CPUCores: p.CPUCores, MBPerCPUS: p.MBPerCPUS,
		PeakMB: p.PeakMB, Lost: p.LostAttempts, Duplicated: p.DuplicateGroups * int64(cfg.Contract.Sampler.GroupSize),
		Launched: p.ProducedGroups * int64(cfg.Contract.Sampler.GroupSize)}
	r.fillCPU()
	if len(p.LoadAvg) == 3 {
		r.LoadAvg = [3]float64{p.LoadAvg[0], p.LoadAvg[1], p.LoadAvg[2]}
	}
	if kill && p.Kill != nil {
		r.Note = fmt.Sprintf("%s SIGKILLed at %.1fs and restarted", p.Kill.Stage, p.Kill.AtS)
	}
	return r
}

// tail is the last lines of a process's output, for an error.
func tail(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > 12 {
		lines = lines[len(lines)-12:]
	}
	return strings.Join(lines, "\n")
}

// LoadAvg reads the three load averages of /proc/loadavg (zeros when it
// cannot).
func LoadAvg() [3]float64 {
	var l [3]float64
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return l
	}
	f := strings.Fields(string(b))
	for i := 0; i < 3 && i < len(f); i++ {
		l[i], _ = strconv.ParseFloat(f[i], 64)
	}
	return l
}

// Machine describes this machine: CPUs, model, memory, Go version.
func Machine() string {
	model := ""
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "model name") {
				if _, v, ok := strings.Cut(line, ":"); ok {
					model = strings.TrimSpace(v)
				}
				break
			}
		}
	}
	mem := ""
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 1 {
			kb, _ := strconv.ParseFloat(f[1], 64)
			mem = fmt.Sprintf(", %.0f GiB", kb/(1<<20))
		}
	}
	return fmt.Sprintf("%d CPUs (%s)%s, %s/%s, %s", runtime.NumCPU(), model, mem, runtime.GOOS, runtime.GOARCH, runtime.Version())
}
