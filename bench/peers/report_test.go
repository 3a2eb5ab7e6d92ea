package peers

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/pipeline/contract"
)

// TestTableAndRatios: the table holds every row and the ratios compare
// trajflow with raw kafka-go of the same round and with each peer; the
// plot is written.
func TestTableAndRatios(t *testing.T) {
	res := &Result{Machine: "m", Duration: 15, InFlight: 192, Rows: []Row{
		{System: "trajflow (embedded broker)", Round: 1, Hops: 5, PolicyTokensPerS: 8e6, MBPerS: 800, CPUCores: 2, MBPerCPUS: 400, PeakMB: 1800, P50MS: 100, P99MS: 200, Launched: 80},
		{System: "raw kafka-go (embedded broker)", Round: 1, Hops: 1, MBPerS: 1200, CPUCores: 2, MBPerCPUS: 600, Lost: -1},
		{System: "raw franz-go (embedded broker)", Round: 1, Hops: 1, MBPerS: 1000, CPUCores: 2, MBPerCPUS: 500, Lost: -1},
		{System: "Ray (actors, object store, 8 groups/call)", Round: 1, Hops: 5, PolicyTokensPerS: 2e6, CPUCores: 1, PeakMB: 900, P50MS: 300, P99MS: 600},
		{System: "ZeroMQ + msgpack (processes)", Round: 1, Hops: 5, PolicyTokensPerS: 2e6, CPUCores: 0.5, PeakMB: 300},
		{System: ZeroMQGoName, Round: 1, Hops: 5, PolicyTokensPerS: 16e6, CPUCores: 2, PeakMB: 450},
		{System: ZeroMQLibzmqName, Round: 1, Hops: 5, PolicyTokensPerS: 10e6, CPUCores: 2, PeakMB: 600},
		{System: "ZeroMQ + msgpack (processes)", Kill: true, Hops: 5, Lost: 1248, Launched: 30000, Note: "pack SIGKILLed at 7.5s and restarted"},
	}}
	for i := range res.Rows {
		res.Rows[i].fillCPU()
	}
	var b strings.Builder
	if err := res.WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{
		"trajflow / raw kafka-go  MB per CPU-s 0.67, MB/s 0.67; trajflow / raw franz-go  MB per CPU-s 0.80",
		"trajflow / Ray  policy tokens per CPU-s 2.00, per wall second 4.00, peak RSS 2.00",
		"trajflow / ZeroMQ  policy tokens per CPU-s 1.00",
		"trajflow / ZeroMQ in Go  policy tokens per CPU-s 0.50, per wall second 0.50, peak RSS 4.00",
		"trajflow / ZeroMQ in Go on libzmq  policy tokens per CPU-s 0.80, per wall second 0.80, peak RSS 3.00",
		"| kill | ZeroMQ + msgpack (processes) | 5 |", "1248 / 30000",
		"kill run, ZeroMQ + msgpack (processes): pack SIGKILLed",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if strings.Count(out, "\n| ") != 9 {
		t.Errorf("want a header and 8 rows:\n%s", out)
	}
	if strings.Contains(out, "over ") {
		t.Errorf("one round: no line over rounds:\n%s", out)
	}
	png := filepath.Join(t.TempDir(), "peers.png")
	if err := res.WritePlot(png); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(png); err != nil || st.Size() < 1000 {
		t.Fatalf("plot: %v", err)
	}
	if err := (&Result{}).WritePlot(png); err == nil {
		t.Fatal("plot of no rows: no error")
	}
}

// TestConfigRefuses: unknown systems and stages, trajflow-kafka without a
// broker and zeromq-libzmq in a binary without libzmq are refused naming
// what is missing.
func TestConfigRefuses(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{Systems: []string{"flink"}}, `--systems: no system "flink"`},
		{Config{Systems: []string{"zeromq-rust"}}, `--systems: no system "zeromq-rust" (have trajflow, trajflow-kafka, ray, zeromq, zeromq-go, zeromq-libzmq, files)`},
		{Config{Systems: []string{SysTrajflowKafka}}, "trajflow-kafka needs --kafka"},
		{Config{Systems: []string{SysZeroMQLibzmq}}, "zeromq-libzmq needs a trajflow built with libzmq: go build -tags libzmq"},
		{Config{Systems: []string{SysRay}, Kill: "dispatch"}, `--kill: no stage "dispatch"`},
	} {
		err := c.cfg.defaults()
		if err == nil || !strings.Contains(err.Error(), c.want) || !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: err %v, want %q (ErrConfig)", c.cfg.Systems, err, c.want)
		}
	}
}

// TestDefaultSystems: without --systems a run takes every system its
// configuration can run: trajflow-kafka only with a broker, zeromq-libzmq
// only in a binary with libzmq.
func TestDefaultSystems(t *testing.T) {
	base := []string{SysTrajflow, SysRay, SysZeroMQ, SysZeroMQGo, SysFiles}
	for _, c := range []struct {
		kafka  string
		libzmq bool
		want   []string
	}{
		{"", false, base},
		{"127.0.0.1:19092", false, []string{SysTrajflow, SysTrajflowKafka, SysRay, SysZeroMQ, SysZeroMQGo, SysFiles}},
		{"", true, []string{SysTrajflow, SysRay, SysZeroMQ, SysZeroMQGo, SysZeroMQLibzmq, SysFiles}},
	} {
		cfg := Config{Kafka: c.kafka, Libzmq: c.libzmq, KafkaScript: "s", KafkaHome: "h", Binary: "b", ContractPath: "c",
			Contract: &contract.Contract{}, OutDir: "o"}
		if err := cfg.defaults(); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(cfg.Systems, c.want) {
			t.Errorf("kafka %q libzmq %v: systems %v, want %v", c.kafka, c.libzmq, cfg.Systems, c.want)
		}
	}
}

// TestNeedsPython: only the Python peers (Ray, ZeroMQ, files) need the
// venv.
func TestNeedsPython(t *testing.T) {
	for _, c := range []struct {
		systems []string
		want    bool
	}{
		{[]string{SysTrajflow, SysZeroMQGo}, false},
		{[]string{SysTrajflow, SysZeroMQ}, true},
		{[]string{SysRay}, true},
		{[]string{SysZeroMQGo, SysFiles}, true},
		{nil, false},
	} {
		if got := NeedsPython(c.systems); got != c.want {
			t.Errorf("NeedsPython(%v) = %v, want %v", c.systems, got, c.want)
		}
	}
}

// TestRatiosOverRounds: with several rounds, each comparison gets one
// more line, its per-CPU-second ratio's median and range over the rounds
// (hand-computed below); a comparison present in one round only gets none.
func TestRatiosOverRounds(t *testing.T) {
	row := func(sys string, round int, mbPerCPU, tokPerS, cores float64) Row {
		r := Row{System: sys, Round: round, MBPerCPUS: mbPerCPU, MBPerS: mbPerCPU * cores, PolicyTokensPerS: tokPerS, CPUCores: cores}
		r.fillCPU()
		return r
	}
	res := &Result{Rows: []Row{
		// trajflow / raw kafka-go: 200/400 = 0.50, 240/400 = 0.60, 220/400 = 0.55
		row("trajflow (embedded broker)", 1, 200, 4e6, 2),
		row("raw kafka-go (embedded broker)", 1, 400, 0, 2),
		row("trajflow (embedded broker)", 2, 240, 3e6, 1),
		row("raw kafka-go (embedded broker)", 2, 400, 0, 2),
		row("trajflow (embedded broker)", 3, 220, 2e6, 1),
		row("raw kafka-go (embedded broker)", 3, 400, 0, 2),
		// trajflow / Ray per CPU-s: (4e6/2)/(1e6/1) = 2.00, (3e6/1)/(4e6/2) = 1.50; no Ray in round 3
		row("Ray (actors, object store, 8 groups/call)", 1, 0, 1e6, 1),
		row("Ray (actors, object store, 8 groups/call)", 2, 0, 4e6, 2),
		// files in round 1 only
		row(FilesName, 1, 0, 1e6, 1),
	}}
	got := res.Ratios()
	want := []string{
		"over 3 rounds: trajflow / raw kafka-go (embedded broker)  MB per CPU-s median 0.55 (0.50–0.60)",
		"over 2 rounds: trajflow / Ray  policy tokens per CPU-s median 1.75 (1.50–2.00)",
	}
	var over []string
	for _, l := range got {
		if strings.HasPrefix(l, "over ") {
			over = append(over, l)
		}
	}
	if !slices.Equal(over, want) {
		t.Errorf("lines over rounds:\n got %q\nwant %q", over, want)
	}
	if len(got) != 3+2+1+len(want) {
		t.Errorf("want 6 per-round lines and %d over rounds, got %d:\n%s", len(want), len(got), strings.Join(got, "\n"))
	}
}
