package main

import (
	"context"
	"encoding/json"
	"io"
	"path/filepath"

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
	if _, err := parseFlags(fs, args); err != nil {
		return err
	}
	o.Modes = splitList(*mode)
	o.EvalSamples = int32(*evalSamples)
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
