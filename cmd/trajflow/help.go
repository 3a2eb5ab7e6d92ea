package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/trajflow/trajflow/internal/buildinfo"
	"github.com/trajflow/trajflow/internal/offline"
)

// commandHelp is what `trajflow NAME --help` prints above the flags: the
// synopsis (what follows "trajflow"), a paragraph, examples and an
// optional extra section (the stages of run).
type commandHelp struct {
	synopsis string
	about    string
	examples []string
	extra    func() string
}

// helps is keyed by the name newFlags receives ("topics create").
var helps = map[string]commandHelp{
	"broker": {synopsis: "broker [--port N] [--data DIR]",
		about:    "Runs the embedded Kafka-protocol broker until interrupted. Without --data it keeps every topic in memory.",
		examples: []string{"trajflow broker --port 9092 --data /tmp/trajflow-broker &"}},
	"topics create": {synopsis: "topics create [--brokers ADDR] [--contract FILE] [--wait D]",
		about: "Creates every topic of a run (the contract's run id is their prefix). Waits up to --wait for a " +
			"broker at --brokers to answer, so it may be started right after `trajflow broker &`.",
		examples: []string{"trajflow topics create --brokers 127.0.0.1:9092 --contract testdata/contracts/demo.yaml"}},
	"census": {synopsis: "census DIR [--run ID] [--tasks N] [--partial]",
		about: "Prints the attempt funnel of a run (dispatched, admitted, trained, quarantined) and the launched vs " +
			"admitted distributions, from the Parquet snapshots under DIR. It refuses a snapshot without census " +
			"records and warns about missing partitions. Every snapshot file it reads that is missing (its .sha256 " +
			"sidecar left) or corrupt is named: it prints the counts of the other files, headed PARTIAL, and exits 1 " +
			"unless --partial. DIR may be trajflow up's --out (DIR/snapshots/run=<run>).",
		examples: []string{"trajflow demo --out out/demo && trajflow census out/demo"}},
	"replay": {synopsis: "replay DIR [--run ID] [--contract FILE] [--to-brokers ADDR]",
		about: "Rebuilds a run's batches offline from its Parquet snapshots and compares them byte for byte with the " +
			"batches the run trained; with --to-brokers it re-emits every snapshot topic into an empty cluster instead.",
		examples: []string{"trajflow replay out/demo", "trajflow replay out/demo --to-brokers 127.0.0.1:9092"}},
	"demo": {synopsis: "demo [--updates N] [--out DIR] [--seed S] [--contract FILE] [--brokers ADDR]",
		about: "Runs the RL loop end to end in one process: the embedded broker (or --brokers), every operator over " +
			"Kafka, the snapshotter and the hidden evaluation; writes DIR/summary.json, DIR/releases and the Parquet snapshots of every topic, DIR/run=<run>/.",
		examples: []string{"trajflow demo --updates 60 --out out/demo", "trajflow demo --contract testdata/contracts/demo.yaml --async --max-lag 2"}},
	"schemas": {synopsis: "schemas [--json]",
		about:    "Prints every topic of a run, every Arrow record schema, every JSON document kind, the quarantine record and every header.",
		examples: []string{"trajflow schemas", "trajflow schemas --json | jq '.topics[].topic'"}},
	"contract validate": {synopsis: "contract validate FILE | contract show",
		about: "Checks a learning contract, prints it resolved (every default written out) and its hash, which every record of the run carries. " +
			"contract show prints the built-in demo contract the same way: a file to edit and pass as --contract.",
		examples: []string{"trajflow contract validate testdata/contracts/demo.yaml", "trajflow contract show > run.yaml && trajflow contract validate run.yaml"}},
	"run": {synopsis: "run NAME [--brokers ADDR] [--contract FILE] [flags]",
		about: "Runs one operator of a run: it consumes its input topics, processes, produces with acks=all and commits. " +
			"With --rounds (dispatch, and every stage of a fleet started with the same --rounds) it exits 0 once the " +
			"rounds are done and drained. Configuration errors (an unknown stage, a bad flag, a contract a stage " +
			"refuses) exit 2 at once; infrastructure errors are retried.",
		examples: []string{"trajflow run pack --brokers 127.0.0.1:9092 --contract testdata/contracts/demo.yaml",
			"trajflow run train --brokers 127.0.0.1:9092 --releases /tmp/releases"},
		extra: func() string { return "stages:\n" + stageList() }},
	"stage": {synopsis: "stage NAME --in FILE --out FILE [--contract FILE]",
		about:    "Runs one registered stage offline over an Arrow IPC stream file: one record batch per input message.",
		examples: []string{"trajflow stage validate --in trajectories.arrow --out validated.arrow"},
		extra:    func() string { return "stages: " + strings.Join(offline.Stages, ", ") }},
	"dashboard": {synopsis: "dashboard DIR [--port N] | dashboard --brokers ADDR [--run ID] [--port N]",
		about:    "Serves a run's web dashboard and trajectory viewer, from a snapshot directory or live from the cluster.",
		examples: []string{"trajflow demo --out out/demo && trajflow dashboard out/demo --port 8080"}},
	"bench": {synopsis: "bench [--duration D] [--brokers ADDR] [--json]",
		about:    "Measures the throughput of validate→reward→advantage→pack beside a raw kafka-go producer/consumer.",
		examples: []string{"trajflow bench --duration 10s", "trajflow bench peers"}},
	"bench peers": {synopsis: "bench peers [flags]",
		about:    "Measures the same hop beside Ray, ZeroMQ and raw clients.",
		examples: []string{"trajflow bench peers"}},
	"bench peers-zmq": {synopsis: "bench peers-zmq --corpus FILE [--impl zmq4|libzmq] [--duration D] [--kill STAGE]",
		about: "One run of the Go ZeroMQ peer of bench peers (ZeroMQ PUSH/PULL, one process per hop; pure-Go zmq4, " +
			"or libzmq in a trajflow built with -tags libzmq): prints its figures as one JSON line. bench peers starts it; " +
			"--stage runs one of its stage processes.",
		examples: []string{"trajflow bench peers --export-corpus out/corpus.bin && trajflow bench peers-zmq --corpus out/corpus.bin --duration 5s"}},
	"serve env": {synopsis: "serve env [--port N] [--data DIR] [--key-file F]",
		about:    "Serves the built-in task families behind the environment protocol (docs/ENV_PROTOCOL.md).",
		examples: []string{"trajflow serve env --port 8642 --data /tmp/env1"}},
	"serve policy": {synopsis: "serve policy --protocol sglang|vllm|llamacpp --releases DIR [--port N]",
		about:    "Serves the built-in policy's releases (those of a run's --releases directory) behind an inference server's HTTP protocol.",
		examples: []string{"trajflow serve policy --protocol sglang --releases out/demo/releases --port 30000"}},
	"up": {synopsis: "up [--brokers ADDR] [--contract FILE] [--rounds N] [--out DIR] [--health-port P] [--restarts N]",
		about: "Starts every operator of a run (the loop, weightsync for a served policy, the snapshotter) as trajflow run " +
			"processes on an existing cluster, after waiting for it and creating the topics. With --rounds it ends " +
			"with the run: every operator exits 0 once the rounds are trained and its inputs drained, and up writes " +
			"OUT/summary.json, the demo's summary (hidden eval of the last release, accounting, batch hashes). An operator " +
			"killed by a signal or failing at run time is started again (--restarts); one refusing its configuration stops the fleet.",
		examples: []string{"trajflow up --brokers 127.0.0.1:9092 --rounds 60 --out out/fleet"}},
	"status": {synopsis: "status [--out DIR] [--brokers ADDR] [--contract FILE] [--rounds N]",
		about: "Says where a run stands: rounds decided, batches packed, the policy version trained and the last release, " +
			"the lag of every operator's consumer group, the quarantine records by reason and, with --out (the --out of " +
			"trajflow up), every operator's /readyz and, from its /metrics, its records in, out and in flight, consumer lag, " +
			"busy seconds, backpressure seconds and quarantined records.",
		examples: []string{"trajflow status --out out/fleet", "trajflow status --brokers 127.0.0.1:9092 --rounds 60"}},
	"version": {synopsis: "version",
		about:    "Prints the module version, VCS revision and Go version of this binary.",
		examples: []string{"trajflow version"}},
}

// printHelp writes the help of the command newFlags named name, then its
// flags.
func printHelp(fs *flag.FlagSet, name string) {
	w := fs.Output()
	h, ok := helps[name]
	if !ok {
		fmt.Fprintf(w, "usage: trajflow %s [flags]\n\nflags:\n", name)
		fs.PrintDefaults()
		return
	}
	fmt.Fprintf(w, "usage: trajflow %s\n\n%s\n", h.synopsis, h.about)
	if h.extra != nil {
		fmt.Fprintf(w, "\n%s\n", h.extra())
	}
	fmt.Fprintf(w, "\nexamples:\n  %s\n", strings.Join(h.examples, "\n  "))
	n := 0
	fs.VisitAll(func(*flag.Flag) { n++ })
	if n == 0 {
		fmt.Fprintln(w, "\nflags: none")
		return
	}
	fmt.Fprintln(w, "\nflags:")
	fs.PrintDefaults()
}

func init() {
	register("version", "print the version, VCS revision and Go version of this binary", cmdVersion)
}

func cmdVersion(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("version", stderr)
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return fmt.Errorf("%w: trajflow version takes no arguments (got %q)", errUsage, pos)
	}
	bi := buildinfo.Read()
	fmt.Fprintln(stdout, bi.String())
	fmt.Fprintf(stdout, "module:   %s\nversion:  %s\nrevision: %s\n", bi.Module, bi.Version, bi.RevisionOrUnknown())
	if bi.Time != "" {
		fmt.Fprintf(stdout, "commit time: %s\n", bi.Time)
	}
	fmt.Fprintf(stdout, "go:       %s\n", bi.Go)
	return nil
}
