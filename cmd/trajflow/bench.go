package main

import (
	"context"
	"encoding/json"
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
	register("bench", "measure throughput of validate→reward→advantage→pack beside raw kafka-go", cmdBench)
}

func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("bench", stderr)
	contractPath := fs.String("contract", "testdata/contracts/bench.yaml", "learning contract (sized for throughput)")
	brokers := fs.String("brokers", "", "comma-separated brokers of a real cluster (empty: embedded broker)")
	clientConfig := fs.String("client-config", "", "YAML file with TLS/SASL client settings")
	duration := fs.Duration("duration", 10*time.Second, "measurement window")
	warmup := fs.Duration("warmup", 3*time.Second, "warm-up before the measurement")
	tokens := fs.Int64("tokens", 0, "end the measurement after this many generated tokens are decided (0: --duration only)")
	baseline := fs.Duration("baseline", 0, "raw kafka-go baseline duration (0: a third of --duration, at least 2s; negative: skip)")
	baselineRate := fs.Float64("baseline-rate", 0, "pace the baseline's producer to this many messages/s (0: unpaced); at the pipeline's per-hop message rate it measures the Kafka side's cost per byte at that rate")
	instances := fs.String("instances", "", "instances per stage in one consumer group, e.g. validate=2,reward=2")
	linger := fs.Duration("linger", 0, "operators' producer batch timeout (0: the runtime default)")
	inflight := fs.Int("inflight-groups", 192, "groups produced but not yet decided (closed loop)")
	meanTokens := fs.Float64("mean-tokens", 1000, "mean tokens per trajectory (log-normal)")
	maxTokens := fs.Int("max-tokens", 32768, "tail of the token-length distribution")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	jsonOut := fs.String("json-out", "", "also write the JSON report to this file")
	plotPath := fs.String("plot", "", "write throughput per stage and the latency distribution to this PNG")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	memProfile := fs.String("memprofile", "", "write a heap profile taken at the end of the measurement window to this file")
	memLimit := fs.Int64("memory-limit-mib", 0, "Go soft memory limit of the bench process in MiB (broker, operators, source and sink share one heap); 0: derived from the embedded broker's retention unless GOMEMLIMIT is set; -1: leave it as it is")
	logLevel := fs.String("log-level", "error", "operator log level (logs go to stderr)")
	if _, err := parseFlags(fs, args); err != nil {
		return err
	}
	if *memLimit < -1 {
		return fmt.Errorf("%w: --memory-limit-mib %d", errUsage, *memLimit)
	}
	if *memLimit > 0 {
		*memLimit <<= 20
	}
	c, err := contract.Load(*contractPath)
	if err != nil {
		return err
	}
	if err := c.Resolve(); err != nil {
		return fmt.Errorf("contract %s: %w", *contractPath, err)
	}
	inst, err := bench.ParseInstances(*instances)
	if err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	cfg := bench.Config{
		Contract: c, Warmup: *warmup, Duration: *duration, Tokens: *tokens, Baseline: *baseline, BaselineRate: *baselineRate,
		Instances: inst, InFlightGroups: *inflight, MemoryLimit: *memLimit, Logger: newLogger(stderr, *logLevel), BatchTimeout: *linger,
	}
	s := synth.Bench()
	s.MeanTokens, s.MaxTokens = *meanTokens, *maxTokens
	cfg.Synth = s
	if *brokers != "" || *clientConfig != "" {
		cf := clientFlags{brokers: brokers, config: clientConfig}
		cc, err := cf.load()
		if err != nil {
			return err
		}
		if len(cc.Brokers) == 0 {
			return fmt.Errorf("%w: --client-config without brokers", errUsage)
		}
		cfg.Brokers, cfg.Client = cc.Brokers, cc
	}
	var bar *progressBar
	if f, ok := stdout.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		bar = &progressBar{w: stdout}
		cfg.Progress = bar.update
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	var memErr error
	if *memProfile != "" {
		cfg.Measured = func() {
			f, err := os.Create(*memProfile)
			if err != nil {
				memErr = err
				return
			}
			defer f.Close()
			runtime.GC()
			memErr = pprof.WriteHeapProfile(f)
		}
	}
	rep, err := bench.Run(ctx, cfg)
	if err == nil && memErr != nil {
		err = fmt.Errorf("heap profile: %w", memErr)
	}
	if bar != nil {
		bar.clear()
	}
	if err != nil {
		return err
	}
	if *plotPath != "" {
		if err := bench.WritePlot(rep, *plotPath); err != nil {
			return err
		}
	}
	if *jsonOut != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(*jsonOut, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else if err := rep.WriteTable(stdout); err != nil {
		return err
	}
	if !rep.Correct {
		return fmt.Errorf("accounting failed: %v", rep.Accounting)
	}
	return nil
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
