package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"slices"

	benchloop "github.com/trajflow/trajflow/bench/loop"
)

// cmdBenchLoop is `trajflow bench loop`: the RL loop in sync and async
// mode on one seed and one simulated latency (bench/loop).
func cmdBenchLoop(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("bench loop", stderr)
	o := benchloop.Options{Latency: benchloop.DefaultLatency()}
	mode := fs.String("mode", "sync,async", "modes to run, in order: sync, async or both (comma-separated)")
	fs.IntVar(&o.Updates, "updates", 30, "update rounds per mode")
	fs.Int64Var(&o.Seed, "seed", 1, "contract seed of both modes")
	fs.Int64Var(&o.MaxLag, "max-lag", 1, "packing.max_lag of the async mode")
	fs.StringVar(&o.OffPolicy, "off-policy", "", "loss.off_policy of the async mode (none, tis, decoupled; default the demo's)")
	fs.Float64Var(&o.ISCap, "is-cap", 0, "loss.is_cap with --off-policy")
	fs.StringVar(&o.PartialRollouts, "partial-rollouts", "continue", "dispatch.partial_rollouts of the async mode: finish or continue")
	fs.StringVar(&o.StalePolicy, "stale-policy", "mask_stale", "packing.stale_policy of the async mode: drop or mask_stale")
	fs.IntVar(&o.Compare, "compare", 0, "the update at whose release the modes are timed (0: updates - 4, before the final drain)")
	fs.IntVar(&o.Workers, "workers", 16, "rollout operators in one consumer group (the topics get as many partitions)")
	fs.Float64Var(&o.Latency.ToolMedianMS, "tool-median-ms", o.Latency.ToolMedianMS, "latency.tool_median_ms")
	fs.Float64Var(&o.Latency.ToolSigma, "tool-sigma", o.Latency.ToolSigma, "latency.tool_sigma (log-normal)")
	fs.Float64Var(&o.Latency.TokenMedianMS, "token-median-ms", o.Latency.TokenMedianMS, "latency.token_median_ms")
	fs.Float64Var(&o.Latency.TokenSigma, "token-sigma", o.Latency.TokenSigma, "latency.token_sigma (log-normal)")
	evalSamples := fs.Int("eval-samples", 4, "attempts per hidden-eval task at the end")
	fs.StringVar(&o.Out, "out", filepath.Join("out", "bench-loop"), "output directory (each mode's demo output, bench-loop.json)")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	cpuProf := fs.String("cpuprofile", "", "write a CPU profile of the whole run (every mode given to --mode) to this file")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if err := noArgs("bench loop", pos); err != nil {
		return err
	}
	if o.Modes, err = listFlag("--mode", *mode); err != nil {
		return err
	}
	if err := benchLoopCheck(fs, o, *evalSamples, *cpuProf); err != nil {
		return err
	}
	o.EvalSamples = int32(*evalSamples)
	if err := benchloop.Check(o); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	stop, err := startCPUProfile(*cpuProf)
	if err != nil {
		return err
	}
	rep, err := benchloop.Run(ctx, o, stderr)
	stop()
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	rep.Print(stdout)
	return nil
}

// benchLoopCheck refuses bench loop's flags that mean nothing: counts
// that are not positive, an output directory that is not one, and the
// async mode's flags without the async mode.
func benchLoopCheck(fs *flag.FlagSet, o benchloop.Options, evalSamples int, cpuProf string) error {
	if err := onlyWith(fs, slices.Contains(o.Modes, benchloop.ModeAsync) || len(o.Modes) == 0, "a setting of the async mode, which --mode leaves out",
		"max-lag", "off-policy", "is-cap", "partial-rollouts", "stale-policy"); err != nil {
		return err
	}
	if err := onlyWith(fs, o.OffPolicy != "", "needs --off-policy (the loss.is_cap of the loss.off_policy it sets)", "is-cap"); err != nil {
		return err
	}
	if err := firstBad(
		flagCheck{o.Updates < 1, fmt.Sprintf("--updates %d: want 1 or more", o.Updates)},
		flagCheck{o.Workers < 1, fmt.Sprintf("--workers %d: want 1 or more", o.Workers)},
		flagCheck{o.Compare < 0 || o.Compare > o.Updates, fmt.Sprintf("--compare %d: want 0 (updates - %d) to --updates %d", o.Compare, benchloop.Drain, o.Updates)},
	); err != nil {
		return err
	}
	if err := checkInt32("--eval-samples", evalSamples, 1); err != nil {
		return err
	}
	if err := checkOutDir("--out", o.Out); err != nil {
		return err
	}
	return checkOutFile("--cpuprofile", cpuProf)
}
