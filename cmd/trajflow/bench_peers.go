package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/trajflow/trajflow/bench/peers"
	"github.com/trajflow/trajflow/bench/peers/zmqpeer"
	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// peersFlags are the flags of trajflow bench peers.
type peersFlags struct {
	contract, systems, kafka, kill, python, pythonPath *string
	kafkaScript, kafkaHome, zmqTrans                   *string
	out, plot, jsonOut, export, fromJSON               *string
	duration, warmup, baseline, kafkaWarmup            *time.Duration
	rounds, kafkaPid, groups, inflight, perCall        *int
}

func addPeersFlags(fs interface {
	String(string, string, string) *string
	Duration(string, time.Duration, string) *time.Duration
	Int(string, int, string) *int
}) peersFlags {
	return peersFlags{
		contract: fs.String("contract", "testdata/contracts/bench.yaml", "learning contract (sized for throughput)"),
		systems: fs.String("systems", "", "systems to run in each round, in order, of "+strings.Join(peers.AllSystems, ", ")+
			" (default: every one this binary and --kafka can run: trajflow-kafka needs --kafka, zeromq-libzmq a trajflow built with -tags libzmq)"),
		kafka: fs.String("kafka", "", "bootstrap address of an Apache Kafka for trajflow-kafka (deploy/local/kafka.sh up), or "+peers.KafkaAuto+
			": start one with --kafka-script for this command and stop it at the end (java 17+ and mvn); empty: the default systems leave trajflow-kafka out"),
		kafkaPid:    fs.Int("kafka-pid", 0, "process id of that broker when it runs on this machine (its CPU is counted; --kafka "+peers.KafkaAuto+" knows its own)"),
		kafkaScript: fs.String("kafka-script", "deploy/local/kafka.sh", "with --kafka "+peers.KafkaAuto+": the script that starts Apache Kafka"),
		kafkaHome:   fs.String("kafka-home", "build/kafka-peers", "with --kafka "+peers.KafkaAuto+": the broker's home (jars cached there, data deleted after the run)"),
		kill:        fs.String("kill", "pack", "stage SIGKILLed once in each system's kill run (empty: no kill runs)"),
		python:      fs.String("python", "", "interpreter of the peers' venv (default: the one bench/peers/python/setup.sh prints)"),
		pythonPath:  fs.String("python-path", "bench/peers/python", "folder holding the trajflow_peers package"),
		out:         fs.String("out", "out/peers", "directory of the corpus and of every run's JSON"),
		plot:        fs.String("plot", "", "write every system on one chart to this PNG"),
		jsonOut:     fs.String("json-out", "", "write every row as JSON to this file"),
		export:      fs.String("export-corpus", "", "only export the corpus to this file and exit"),
		fromJSON:    fs.String("from-json", "", "run nothing: print the table (and --plot) of a --json-out file"),
		duration:    fs.Duration("duration", 15*time.Second, "measurement window of each run"),
		warmup:      fs.Duration("warmup", 3*time.Second, "warm-up of each run"),
		baseline:    fs.Duration("baseline", 6*time.Second, "window of each raw client's baseline"),
		kafkaWarmup: fs.Duration("kafka-warmup", 90*time.Second, "with trajflow-kafka: unrecorded runs (at most 30 s each) for this long before the first round, for the broker JVM's compiler (0: none)"),
		rounds:      fs.Int("rounds", 2, "rounds: every system once per round, alternating"),
		groups:      fs.Int("corpus-groups", 256, "groups of the synthetic source exported through the stages"),
		inflight:    fs.Int("inflight-groups", 192, "groups produced and not yet decided, for every system"),
		perCall:     fs.Int("ray-groups-per-call", 8, "groups per Ray actor call (one DataProto)"),
		zmqTrans:    fs.String("zmq-transport", peers.ZmqTCP, "the ZeroMQ peers' transport: tcp (127.0.0.1) or ipc (Unix sockets, as trajflow's clients reach the embedded broker)"),
	}
}

// cmdBenchPeers runs trajflow bench peers.
func cmdBenchPeers(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("bench peers", stderr)
	f := addPeersFlags(fs)
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if err := noArgs("bench peers", pos); err != nil {
		return err
	}
	if err := f.check(fs); err != nil {
		return err
	}
	if *f.fromJSON != "" {
		return peersReport(*f.fromJSON, *f.plot, stdout)
	}
	c, err := contract.Load(*f.contract)
	if err != nil {
		return fmt.Errorf("%w: --contract: %w", errUsage, err)
	}
	if err := c.Resolve(); err != nil {
		return fmt.Errorf("%w: --contract %s: %w", errUsage, *f.contract, err)
	}
	if *f.export != "" {
		cp, err := peers.BuildCorpus(ctx, c, synth.Bench(), *f.groups)
		if err != nil {
			return err
		}
		return cp.Write(*f.export)
	}
	bin, err := os.Executable()
	if err != nil {
		return err
	}
	cfg := peers.Config{Binary: bin, ContractPath: *f.contract, Contract: c, Python: *f.python, PythonPath: *f.pythonPath,
		Kafka: *f.kafka, KafkaPid: *f.kafkaPid, KafkaWarmup: *f.kafkaWarmup, KafkaScript: *f.kafkaScript, KafkaHome: *f.kafkaHome, Rounds: *f.rounds, Duration: *f.duration, Warmup: *f.warmup, Baseline: *f.baseline,
		Kill: *f.kill, CorpusGroups: *f.groups, InFlight: *f.inflight, RayGroupsPerCall: *f.perCall, ZmqTransport: *f.zmqTrans, OutDir: *f.out, Log: stderr}
	cfg.Libzmq = zmqpeer.LibzmqBuilt
	if err := peersSystems(ctx, fs, *f.systems, &cfg); err != nil {
		return err
	}
	res, err := peers.Run(ctx, cfg)
	if errors.Is(err, peers.ErrConfig) {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if err != nil {
		return err
	}
	res.Command = "trajflow bench peers " + strings.Join(args, " ")
	if *f.plot != "" {
		if err := res.WritePlot(*f.plot); err != nil {
			return err
		}
	}
	if *f.jsonOut != "" {
		b, err := json.MarshalIndent(res, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(*f.jsonOut, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	return res.WriteTable(stdout)
}

// check refuses bench peers' flag values that mean nothing and flags
// that the mode given does not read, before anything starts.
func (f peersFlags) check(fs *flag.FlagSet) error {
	switch {
	case *f.fromJSON != "":
		if err := onlyFlags(fs, "--from-json runs nothing: it prints a saved table (and --plot)", "from-json", "plot"); err != nil {
			return err
		}
		if err := checkInFile("--from-json", *f.fromJSON); err != nil {
			return err
		}
		return checkOutFile("--plot", *f.plot)
	case *f.export != "":
		if err := onlyFlags(fs, "--export-corpus only exports the corpus", "export-corpus", "contract", "corpus-groups"); err != nil {
			return err
		}
		return errors.Join(checkOutFile("--export-corpus", *f.export),
			firstBad(flagCheck{*f.groups < 1, fmt.Sprintf("--corpus-groups %d: want 1 or more", *f.groups)}))
	}
	if err := f.checkKafka(fs); err != nil {
		return err
	}
	if err := firstBad(
		flagCheck{*f.rounds < 1, fmt.Sprintf("--rounds %d: want 1 or more", *f.rounds)},
		flagCheck{*f.duration <= 0, fmt.Sprintf("--duration %v: want a positive window", *f.duration)},
		flagCheck{*f.warmup < 0, fmt.Sprintf("--warmup %v: want 0 or more", *f.warmup)},
		flagCheck{*f.baseline <= 0, fmt.Sprintf("--baseline %v: want a positive window", *f.baseline)},
		flagCheck{*f.groups < 1, fmt.Sprintf("--corpus-groups %d: want 1 or more", *f.groups)},
		flagCheck{*f.inflight < 1, fmt.Sprintf("--inflight-groups %d: want 1 or more", *f.inflight)},
		flagCheck{*f.perCall < 1, fmt.Sprintf("--ray-groups-per-call %d: want 1 or more", *f.perCall)},
	); err != nil {
		return err
	}
	return errors.Join(checkOutDir("--out", *f.out), checkOutFile("--plot", *f.plot), checkOutFile("--json-out", *f.jsonOut))
}

// checkKafka refuses the flags of trajflow-kafka without --kafka, those
// of --kafka auto without it, and a malformed address or process id.
func (f peersFlags) checkKafka(fs *flag.FlagSet) error {
	auto := *f.kafka == peers.KafkaAuto
	if auto && *f.kafkaPid != 0 {
		return fmt.Errorf("%w: bench peers: --kafka-pid: --kafka %s counts the CPU of the broker it starts; give an address with --kafka-pid", errUsage, peers.KafkaAuto)
	}
	if err := onlyWith(fs, *f.kafka != "", "goes with --kafka (trajflow-kafka)", "kafka-pid", "kafka-warmup"); err != nil {
		return err
	}
	if err := onlyWith(fs, auto, "goes with --kafka "+peers.KafkaAuto, "kafka-script", "kafka-home"); err != nil {
		return err
	}
	if auto {
		return checkInFile("--kafka-script", *f.kafkaScript)
	}
	if *f.kafka != "" {
		if _, err := brokerList("--kafka", *f.kafka); err != nil {
			return err
		}
	}
	return firstBad(
		flagCheck{*f.kafkaPid < 0, fmt.Sprintf("--kafka-pid %d: want a process id", *f.kafkaPid)},
		flagCheck{*f.kafkaWarmup < 0, fmt.Sprintf("--kafka-warmup %v: want 0 (none) or more", *f.kafkaWarmup)},
	)
}

// peersSystems sets the systems of cfg from --systems and, when one of
// them runs in Python, the peers' interpreter. The default systems leave
// trajflow-kafka out without --kafka, and zeromq-libzmq out of a trajflow
// built without libzmq; named in --systems, they need them (peers.Run
// says so).
func peersSystems(ctx context.Context, fs *flag.FlagSet, systems string, cfg *peers.Config) error {
	var err error
	if cfg.Systems, err = listFlag("--systems", systems); err != nil {
		return err
	}
	if len(cfg.Systems) == 0 {
		cfg.Systems = peers.DefaultSystems(cfg.Kafka, cfg.Libzmq)
	}
	if cfg.PythonPath, err = filepath.Abs(cfg.PythonPath); err != nil {
		return err
	}
	if err := checkPython(fs, *cfg); err != nil {
		return err
	}
	if cfg.Python == "" && peers.NeedsPython(cfg.Systems) {
		out, err := exec.CommandContext(ctx, "bash", filepath.Join(cfg.PythonPath, "setup.sh")).Output()
		if err != nil {
			return fmt.Errorf("%s: %w", filepath.Join(cfg.PythonPath, "setup.sh"), err)
		}
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		cfg.Python = lines[len(lines)-1]
	}
	return nil
}

// checkPython refuses --python and --python-path when no system of cfg
// runs in the Python peers' environment, an interpreter that is not
// there and a package folder that is not one.
func checkPython(fs *flag.FlagSet, cfg peers.Config) error {
	if err := onlyWith(fs, peers.NeedsPython(cfg.Systems), "no system of --systems runs in Python", "python", "python-path"); err != nil {
		return err
	}
	if !peers.NeedsPython(cfg.Systems) {
		return nil
	}
	if cfg.Python != "" {
		if _, err := exec.LookPath(cfg.Python); err != nil {
			return fmt.Errorf("%w: --python %q: %w", errUsage, cfg.Python, err)
		}
	}
	return checkInDir("--python-path", cfg.PythonPath)
}

// peersReport prints the table of a saved result and draws its plot.
func peersReport(path, plot string, stdout io.Writer) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var res peers.Result
	if err := json.Unmarshal(b, &res); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if plot != "" {
		if err := res.WritePlot(plot); err != nil {
			return err
		}
	}
	return res.WriteTable(stdout)
}
