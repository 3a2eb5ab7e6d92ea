package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// readmeBlock returns the lines of the first ```sh block after marker in
// README.md.
func readmeBlock(t *testing.T, marker string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i := strings.Index(s, marker)
	if i < 0 {
		t.Fatalf("README.md has no %q", marker)
	}
	s = s[i:]
	start := strings.Index(s, "```sh\n")
	if start < 0 {
		t.Fatalf("no sh block after %q", marker)
	}
	s = s[start+len("```sh\n"):]
	end := strings.Index(s, "```")
	if end < 0 {
		t.Fatal("unterminated sh block")
	}
	return strings.Split(strings.TrimRight(s[:end], "\n"), "\n")
}

// TestReadmeFleet runs the README's fleet block in bash -e, in a new
// directory, as written but for two things: its first line (the build,
// checked to be the one below) is replaced by the binary this test
// builds the same way, first on PATH; and port 9092 by a free port (other
// brokers may hold 9092 on a shared machine). It must exit 0, every
// operator must exit 0 by itself, and the summary must equal the demo's
// for the same seed and rounds: counts, batch hashes, hidden-eval
// success; census and replay of the fleet's snapshot must agree.
func TestReadmeFleet(t *testing.T) {
	t.Parallel() // beside TestAsyncLagBoundUnderChaos, after the sequential tests
	lines := readmeBlock(t, "<!-- fleet: the README test")
	const build = `go build -o bin/trajflow ./cmd/trajflow && export PATH="$PWD/bin:$PATH"`
	if lines[0] != build {
		t.Fatalf("the fleet block starts with %q, want %q", lines[0], build)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	ln.Close()
	script := strings.ReplaceAll(strings.Join(lines[1:], "\n"), "9092", port)
	rounds := 0
	for _, f := range strings.Fields(script) {
		if n, err := strconv.Atoi(f); err == nil && strings.Contains(script, "--rounds "+f) {
			rounds = n
		}
	}
	if rounds == 0 {
		t.Fatal("the fleet block gives no --rounds")
	}
	bin := trajflowBinary(t)
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-e", "-c", script)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(bin)+string(os.PathListSeparator)+os.Getenv("PATH"))
	start := time.Now()
	out, err := cmd.CombinedOutput()
	t.Logf("the fleet block ran %s:\n%s", time.Since(start).Round(time.Second), out)
	if err != nil {
		t.Fatalf("the README fleet block failed: %v", err)
	}
	text := string(out)
	for _, want := range []string{"  dispatch   exited 0", "  train      exited 0", "  snapshot   exited 0",
		"rounds:     " + strconv.Itoa(rounds) + " of " + strconv.Itoa(rounds) + " decided", ", done", "quarantine: 0 records",
		"attempt funnel", "batches identical"} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	if n := strings.Count(text, " exited 0\n"); n != len(fleetStages(loadDemo(t))) {
		t.Errorf("%d operators exited 0, want %d", n, len(fleetStages(loadDemo(t))))
	}
	b, err := os.ReadFile(filepath.Join(dir, "out", "fleet", loop.SummaryFile))
	if err != nil {
		t.Fatal(err)
	}
	var got loop.Summary
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	want := testkit.Demo(t, loop.Options{Updates: rounds, Seed: 1, EvalSamples: 4})
	type counts struct {
		Launched, Admitted, Filtered, Quarantined, Duplicates, Lost, Updates int
		EvalInitial, EvalFinal, Packing                                      float64
		Hashes                                                               []string
	}
	of := func(s *loop.Summary) counts {
		return counts{s.AttemptsLaunched, s.TrajectoriesAdmitted, s.TrajectoriesFiltered, s.Quarantined, s.DuplicatesAdmitted,
			s.Lost, s.Updates, s.EvalSuccessInitial, s.EvalSuccessFinal, s.PackingEfficiency, s.BatchHashes}
	}
	if g, w := of(&got), of(want); !reflect.DeepEqual(g, w) {
		t.Fatalf("the fleet's summary differs from the demo's:\nfleet %+v\ndemo  %+v", g, w)
	}
}

func loadDemo(t *testing.T) *contract.Contract {
	t.Helper()
	c, err := loadContract("")
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// up refuses a run id that already has records on the cluster (its ids
// would collide with the earlier run's, and its end would be miscounted),
// before it starts any operator.
func TestUpRefusesAUsedRun(t *testing.T) {
	addr := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var o, e bytes.Buffer
	if code := run(ctx, []string{"topics", "create", "--brokers", addr}, &o, &e); code != 0 {
		t.Fatalf("topics create: %d %s", code, e.String())
	}
	// Its own transport, closed: kafka-go's DefaultTransport would keep
	// dialing addr after the broker is gone, and a parallel test's
	// ZeroMQ peer that gets the port answers with bytes kafka-go's
	// response decoder panics on (a negative size).
	tr := &kafkago.Transport{}
	w := &kafkago.Writer{Addr: kafkago.TCP(addr), Topic: "demo.tasks", RequiredAcks: kafkago.RequireAll, BatchTimeout: time.Millisecond, Transport: tr}
	err := w.WriteMessages(ctx, kafkago.Message{Key: []byte("k"), Value: []byte("earlier run")})
	w.Close()
	tr.CloseIdleConnections()
	if err != nil {
		t.Fatal(err)
	}
	e.Reset()
	out := t.TempDir()
	code := run(ctx, []string{"up", "--brokers", addr, "--rounds", "1", "--out", out}, &o, &e)
	if code != 2 || !strings.Contains(e.String(), `run "demo" already has records on demo.tasks`) {
		t.Fatalf("up on a used run: exit %d: %s", code, e.String())
	}
	if _, err := os.Stat(filepath.Join(out, FleetFile)); err == nil {
		t.Fatal("up started a fleet on a used run")
	}
}
