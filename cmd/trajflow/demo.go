package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"

	"github.com/trajflow/trajflow/internal/loop"
)

func init() {
	register("demo", "the RL loop end to end: embedded broker, every operator over Kafka, hidden eval (--updates, --out, --seed, --brokers)", cmdDemo)
}

func cmdDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("demo", stderr)
	o := loop.Options{}
	fs.IntVar(&o.Updates, "updates", 60, "update rounds to dispatch (a round whose groups are all filtered trains nothing)")
	fs.StringVar(&o.Out, "out", filepath.Join("out", "demo"), "output directory (summary.json, releases/, demo.log)")
	fs.Int64Var(&o.Seed, "seed", 1, "contract seed (random streams and initial weights)")
	brokers := fs.String("brokers", "", "comma-separated brokers of an external cluster (default: start the embedded broker)")
	fs.StringVar(&o.RunID, "run", "", "run id, the topic prefix (default: the demo contract's)")
	fs.BoolVar(&o.Async, "async", false, "asynchronous mode: up to max-lag+1 rounds in flight, stale samples dropped")
	fs.Int64Var(&o.MaxLag, "max-lag", 1, "policy versions a sample may lag the trainer (with --async)")
	fs.StringVar(&o.OffPolicy, "off-policy", "", "override loss.off_policy: none, tis or decoupled")
	fs.Float64Var(&o.ISCap, "is-cap", 0, "loss.is_cap with --off-policy (tis needs one >= 1)")
	evalSamples := fs.Int("eval-samples", 4, "attempts per hidden-eval task (fixed seeds)")
	env := addEnvFlags(fs)
	fs.StringVar(&o.Environment, "environment", "", "the contract's artifacts.environment (default the demo's kv; builtin:env/ledger-env@v1: the ledger family)")
	pf := addPolicyFlags(fs, &o)
	if _, err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := pf.apply(&o); err != nil {
		return err
	}
	o.Brokers = splitList(*brokers)
	var err error
	if o.Env, err = env.list(); err != nil {
		return err
	}
	o.EnvKeyFile = *env.keyFile
	o.EvalSamples = int32(*evalSamples)
	if o.Updates < 1 || o.EvalSamples < 1 {
		return fmt.Errorf("%w: --updates and --eval-samples must be positive", errUsage)
	}
	s, err := loop.Run(ctx, o, stdout)
	if errors.Is(err, loop.ErrRunUsed) {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "hidden-eval success %.3f -> %.3f in %d updates (%.1fs); launched %d, admitted %d, excluded at update %d, filtered %d, duplicates %d, lost %d; stale share %.4f; summary in %s\n",
		s.EvalSuccessInitial, s.EvalSuccessFinal, s.Updates, s.WallSeconds, s.AttemptsLaunched, s.TrajectoriesAdmitted,
		s.TrajectoriesExcluded, s.TrajectoriesFiltered, s.DuplicatesAdmitted, s.Lost, s.StaleShare, filepath.Join(o.Out, loop.SummaryFile))
	return nil
}
