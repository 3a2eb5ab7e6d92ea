package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/bench/peers"
	"github.com/trajflow/trajflow/bench/peers/zmqpeer"
	"github.com/trajflow/trajflow/internal/testkit"
)

// runZmqPeer runs `trajflow bench peers-zmq` and reads its report.
func runZmqPeer(t *testing.T, args ...string) peers.PeerReport {
	t.Helper()
	out, err := exec.Command(trajflowBinary(t), append([]string{"bench", "peers-zmq"}, args...)...).Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("bench peers-zmq %s: %v\n%s", strings.Join(args, " "), err, stderr)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var r peers.PeerReport
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &r); err != nil {
		t.Fatalf("report %q: %v", out, err)
	}
	return r
}

// exportCorpus writes the peers' corpus of 96 groups into a temporary
// directory and returns its path.
func exportCorpus(t *testing.T) string {
	t.Helper()
	corpus := filepath.Join(t.TempDir(), "corpus.bin")
	if out, err := exec.Command(trajflowBinary(t), "bench", "peers", "--contract", "../../testdata/contracts/bench.yaml",
		"--corpus-groups", "96", "--export-corpus", corpus).CombinedOutput(); err != nil {
		t.Fatalf("export corpus: %v\n%s", err, out)
	}
	return corpus
}

// TestBenchPeersZmq: the Go ZeroMQ peer, on every ZeroMQ implementation
// compiled in, moves the corpus's bytes over every hop and accounts every
// group it sent; a SIGKILL of its pack process loses the groups pack held
// (and, on the pure-Go implementation, those sent to it while it was
// down), whole groups of eight attempts, and the accounting still adds up.
func TestBenchPeersZmq(t *testing.T) {
	t.Parallel()
	corpus := exportCorpus(t)
	for _, impl := range zmqpeer.Impls() {
		t.Run(impl, func(t *testing.T) {
			r := runZmqPeer(t, "--impl", impl, "--corpus", corpus, "--duration", "3s", "--warmup", "1s", "--inflight-groups", "64")
			if r.System != zmqpeer.SystemName(impl) || r.CorpusGroups != 96 || r.InFlightGroups != 64 {
				t.Fatalf("report of %q over %d groups, %d in flight", r.System, r.CorpusGroups, r.InFlightGroups)
			}
			if r.Groups <= 0 || r.Batches <= 0 || r.MBPerS <= 0 || r.CPUS <= 0 || r.PeakMB <= 0 || r.Latency.P50 <= 0 || r.ActionTokensPerS <= 0 {
				t.Fatalf("nothing measured: %+v", r)
			}
			if r.LostGroups != 0 || r.DecidedGroups != r.ProducedGroups || r.DuplicateGroups != 0 {
				t.Fatalf("without a kill: produced %d decided %d lost %d duplicated %d", r.ProducedGroups, r.DecidedGroups, r.LostGroups, r.DuplicateGroups)
			}
			ipc := runZmqPeer(t, "--impl", impl, "--transport", peers.ZmqIPC, "--corpus", corpus, "--duration", "2s", "--warmup", "1s", "--inflight-groups", "64")
			if ipc.Groups <= 0 || ipc.MBPerS <= 0 || ipc.LostGroups != 0 || ipc.DecidedGroups != ipc.ProducedGroups {
				t.Fatalf("over ipc: %+v", ipc)
			}

			k := runZmqPeer(t, "--impl", impl, "--corpus", corpus, "--duration", "4s", "--warmup", "1s", "--inflight-groups", "64",
				"--kill", "pack", "--loss-timeout", "2s", "--drain", "4s")
			if k.Kill == nil || k.Kill.Stage != "pack" || k.Kill.AtS < 1.5 {
				t.Fatalf("kill: %+v", k.Kill)
			}
			if k.LostGroups <= 0 || k.LostAttempts != 8*k.LostGroups || k.DecidedGroups+k.LostGroups != k.ProducedGroups {
				t.Fatalf("kill of pack: produced %d decided %d lost %d groups (%d attempts)", k.ProducedGroups, k.DecidedGroups, k.LostGroups, k.LostAttempts)
			}
		})
	}
}

// TestBenchPeersGoZmqRows: bench peers runs the Go ZeroMQ peer on every
// implementation compiled in and writes a round row and a kill row for
// each, under its own name.
func TestBenchPeersGoZmqRows(t *testing.T) {
	t.Parallel()
	systems := []string{peers.SysZeroMQGo}
	names := []string{peers.ZeroMQGoName}
	if zmqpeer.LibzmqBuilt {
		systems = append(systems, peers.SysZeroMQLibzmq)
		names = append(names, peers.ZeroMQLibzmqName)
	}
	out := t.TempDir()
	js := filepath.Join(out, "peers.json")
	cmd := exec.Command(trajflowBinary(t), "bench", "peers", "--contract", "../../testdata/contracts/bench.yaml",
		"--systems", strings.Join(systems, ","), "--rounds", "1", "--duration", "2s", "--warmup", "1s",
		"--corpus-groups", "96", "--inflight-groups", "64", "--out", out, "--json-out", js)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("bench peers: %v\n%s", err, b)
	}
	var res peers.Result
	testkit.ReadJSON(t, js, &res)
	for _, name := range names {
		var round, kill bool
		for _, r := range res.Rows {
			if r.System != name {
				continue
			}
			if r.Launched <= 0 || !r.Kill && r.MBPerS <= 0 || r.Kill && !strings.Contains(r.Note, "pack SIGKILLed") {
				t.Errorf("%s: nothing measured: %+v", name, r)
			}
			round, kill = round || !r.Kill, kill || r.Kill
		}
		if !round || !kill {
			t.Errorf("%s: round row %v, kill row %v; rows %+v", name, round, kill, res.Rows)
		}
	}
}

// TestBenchPeersZmqImpl: an unknown --impl or --transport is a usage
// error naming what there is; libzmq in a trajflow built without it is refused with
// the build command.
func TestBenchPeersZmqImpl(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"bench", "peers-zmq", "--impl", "nanomsg", "--corpus", "x"}, &stdout, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), `--impl "nanomsg": want zmq4 or libzmq`) {
		t.Fatalf("exit %d, stderr %q", code, stderr.String())
	}
	stderr.Reset()
	code = run(context.Background(), []string{"bench", "peers-zmq", "--transport", "udp", "--corpus", "x"}, &stdout, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), `--transport "udp": want tcp or ipc`) {
		t.Fatalf("--transport udp: exit %d, stderr %q", code, stderr.String())
	}
	stderr.Reset()
	code = run(context.Background(), []string{"bench", "peers", "--contract", "../../testdata/contracts/bench.yaml", "--systems", "zeromq-go",
		"--zmq-transport", "udp", "--out", t.TempDir()}, &stdout, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), `--zmq-transport "udp": want tcp or ipc`) {
		t.Fatalf("bench peers --zmq-transport udp: exit %d, stderr %q", code, stderr.String())
	}
	if zmqpeer.LibzmqBuilt {
		return
	}
	stderr.Reset()
	code = run(context.Background(), []string{"bench", "peers-zmq", "--impl", "libzmq", "--corpus", "x"}, &stdout, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), "go build -tags libzmq") {
		t.Fatalf("libzmq without it: exit %d, stderr %q", code, stderr.String())
	}
}

// TestBenchPeersKafkaAutoRefusesPid: --kafka auto counts the CPU of the
// broker it starts, so a --kafka-pid beside it is a command-line error
// (exit 2, naming both flags), refused before any broker starts.
func TestBenchPeersKafkaAutoRefusesPid(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"bench", "peers", "--contract", "../../testdata/contracts/bench.yaml",
		"--systems", "trajflow-kafka", "--kafka", "auto", "--kafka-pid", "42", "--kafka-script", "/nonexistent/kafka.sh",
		"--out", t.TempDir()}, &stdout, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), "--kafka-pid") || !strings.Contains(stderr.String(), "--kafka auto") {
		t.Fatalf("exit %d, stderr %q", code, stderr.String())
	}
}

// TestBenchPeersRefusesSystems: an unknown system, and zeromq-libzmq in a
// trajflow built without libzmq, are configuration errors (exit 2) that
// name the system, refused before a corpus is exported.
func TestBenchPeersRefusesSystems(t *testing.T) {
	cases := []struct{ systems, want string }{{"flink", `no system "flink"`}}
	if !zmqpeer.LibzmqBuilt {
		cases = append(cases, struct{ systems, want string }{"zeromq-libzmq", "zeromq-libzmq needs a trajflow built with libzmq"})
	}
	for _, c := range cases {
		var stdout, stderr bytes.Buffer
		out := t.TempDir()
		code := run(context.Background(), []string{"bench", "peers", "--contract", "../../testdata/contracts/bench.yaml",
			"--systems", c.systems, "--out", out}, &stdout, &stderr)
		if code != 2 || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("--systems %s: exit %d, stderr %q", c.systems, code, stderr.String())
		}
		if _, err := os.Stat(filepath.Join(out, "corpus.bin")); !os.IsNotExist(err) {
			t.Errorf("--systems %s: a corpus was exported before the refusal (stat: %v)", c.systems, err)
		}
	}
}

// TestBenchPeersNamedKafkaNeedsAddress: the default systems leave
// trajflow-kafka out when no --kafka is given, but one named in --systems
// is not dropped in silence: the command refuses to run without --kafka.
func TestBenchPeersNamedKafkaNeedsAddress(t *testing.T) {
	var stdout, stderr bytes.Buffer
	out := t.TempDir()
	code := run(context.Background(), []string{"bench", "peers", "--contract", "../../testdata/contracts/bench.yaml",
		"--systems", "zeromq-go,trajflow-kafka", "--out", out}, &stdout, &stderr)
	if code == 0 || !strings.Contains(stderr.String(), "trajflow-kafka needs --kafka") {
		t.Fatalf("exit %d, stderr %q", code, stderr.String())
	}
	if _, err := os.Stat(filepath.Join(out, "corpus.bin")); !os.IsNotExist(err) {
		t.Fatalf("a corpus was exported before the refusal (stat: %v)", err)
	}
}

// TestBenchPeersFlagsRefused: counts and windows that are not positive, a
// malformed --systems, the flags of --kafka or --kafka auto without it,
// flags that --from-json and --export-corpus would ignore, a missing
// interpreter, package folder or output directory exit 2 at once naming
// the flag; no corpus is exported, no system runs.
func TestBenchPeersFlagsRefused(t *testing.T) {
	_, missing := testFile(t)
	for _, c := range []refusalCase{
		{[]string{"--rounds", "0"}, []string{"--rounds 0"}},
		{[]string{"--duration", "0s"}, []string{"--duration 0s"}},
		{[]string{"--warmup", "-1s"}, []string{"--warmup -1s"}},
		{[]string{"--baseline", "0s"}, []string{"--baseline 0s"}},
		{[]string{"--corpus-groups", "0"}, []string{"--corpus-groups 0"}},
		{[]string{"--inflight-groups", "0"}, []string{"--inflight-groups 0"}},
		{[]string{"--ray-groups-per-call", "0"}, []string{"--ray-groups-per-call 0"}},
		{[]string{"--systems", "zeromq-go,,files"}, []string{"--systems", "item 2 is empty"}},
		{[]string{"--kafka-warmup", "1s"}, []string{"--kafka-warmup 1s", "--kafka"}},
		{[]string{"--kafka-pid", "5"}, []string{"--kafka-pid 5", "--kafka"}},
		{[]string{"--kafka", "127.0.0.1:1", "--kafka-pid", "-3"}, []string{"--kafka-pid -3"}},
		{[]string{"--kafka-script", missing}, []string{"--kafka-script", "--kafka auto"}},
		{[]string{"--systems", "trajflow-kafka", "--kafka", "nohost"}, []string{`--kafka "nohost"`}},
		{[]string{"--systems", "trajflow-kafka", "--kafka", "auto", "--kafka-script", missing}, []string{"--kafka-script", "no such file"}},
		{[]string{"--systems", "ray", "--python", missing}, []string{"--python"}},
		{[]string{"--systems", "ray", "--python", "python3", "--python-path", missing}, []string{"--python-path", "no such file"}},
		{[]string{"--python-path", t.TempDir()}, []string{"--python-path", "Python"}},
		{[]string{"--json-out", missing}, []string{"--json-out", "no such file"}},
		{[]string{"--contract", missing}, []string{"--contract"}},
		{[]string{"extra"}, []string{"no arguments", "extra"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			out := t.TempDir()
			wantRefused(t, append([]string{"bench", "peers", "--contract", "../../testdata/contracts/bench.yaml",
				"--systems", "zeromq-go", "--out", out}, c.args...), c.want...)
			if _, err := os.Stat(filepath.Join(out, "corpus.bin")); !os.IsNotExist(err) {
				t.Errorf("a corpus was exported before the refusal (stat: %v)", err)
			}
		})
	}
	// --from-json and --export-corpus run no system.
	corpus := filepath.Join(t.TempDir(), "c.bin")
	for _, c := range []refusalCase{
		{[]string{"--from-json", missing}, []string{"--from-json", "no such file"}},
		{[]string{"--from-json", missing, "--rounds", "3"}, []string{"--from-json", "--rounds"}},
		{[]string{"--export-corpus", missing}, []string{"--export-corpus", "no such file"}},
		{[]string{"--export-corpus", corpus, "--corpus-groups", "0"}, []string{"--corpus-groups 0"}},
		{[]string{"--export-corpus", corpus, "--systems", "files"}, []string{"--export-corpus", "--systems"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"bench", "peers"}, c.args...), c.want...)
		})
	}
	if _, err := os.Stat(corpus); !os.IsNotExist(err) {
		t.Errorf("a refused --export-corpus wrote %s (stat: %v)", corpus, err)
	}
}

// TestBenchPeersZmqFlagsRefused: the driver's windows and counts that
// are not positive, a stage or kill target that is none, --kill-at
// without --kill or past the window, the stage process's flags on the
// driver and the driver's on a stage process, and a corpus that is not
// there exit 2 at once naming the flag.
func TestBenchPeersZmqFlagsRefused(t *testing.T) {
	corpus, missing := testFile(t)
	stage := []string{"--stage", "pack", "--pull", "tcp://127.0.0.1:1", "--push", "tcp://127.0.0.1:2"}
	for _, c := range []refusalCase{
		{[]string{"--duration", "0s"}, []string{"--duration 0s"}},
		{[]string{"--warmup", "-1s"}, []string{"--warmup -1s"}},
		{[]string{"--inflight-groups", "0"}, []string{"--inflight-groups 0"}},
		{[]string{"--loss-timeout", "0s"}, []string{"--loss-timeout 0s"}},
		{[]string{"--drain", "-1s"}, []string{"--drain -1s"}},
		{[]string{"--kill", "nope"}, []string{`--kill "nope"`}},
		{[]string{"--kill-at", "2s"}, []string{"--kill-at 2s", "needs --kill"}},
		{[]string{"--kill", "pack", "--kill-at", "20s"}, []string{"--kill-at 20s"}},
		{[]string{"--pull", "tcp://127.0.0.1:1"}, []string{"--pull", "--stage"}},
		{[]string{"--stage", "nope", "--pull", "tcp://127.0.0.1:1", "--push", "tcp://127.0.0.1:2"}, []string{`--stage "nope"`}},
		{append(stage, "--duration", "3s"), []string{"--stage", "--duration"}},
		{[]string{"--corpus", missing}, []string{"--corpus", "no such file"}},
		{[]string{"extra"}, []string{"no arguments", "extra"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"bench", "peers-zmq", "--corpus", corpus}, c.args...), c.want...)
		})
	}
}
