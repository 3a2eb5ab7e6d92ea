package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"

	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
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
	fs.StringVar(&o.RunID, "run", "", "run id (default: the contract's): the prefix of every topic and the namespace of every record id and random stream, so another id gives other (equally valid) results")
	fs.BoolVar(&o.Async, "async", false, "asynchronous mode: up to max-lag+1 rounds in flight, stale samples dropped")
	fs.Int64Var(&o.MaxLag, "max-lag", 1, "policy versions a sample may lag the trainer (with --async)")
	fs.StringVar(&o.OffPolicy, "off-policy", "", "override loss.off_policy: none, tis or decoupled")
	fs.Float64Var(&o.ISCap, "is-cap", 0, "loss.is_cap with --off-policy (tis needs one >= 1)")
	evalSamples := fs.Int("eval-samples", 4, "attempts per hidden-eval task (fixed seeds)")
	fs.BoolVar(&o.NoGate, "no-gate", false, "run without the evaluation plane and the gate (no evaluation, no promote, rollback or stop; what a fleet without eval and gate operators does)")
	env := addEnvFlags(fs)
	fs.StringVar(&o.Environment, "environment", "", "the contract's artifacts.environment (default the demo's kv; builtin:env/ledger-env@v1: the ledger family)")
	pf := addPolicyFlags(fs, &o)
	health := fs.String("health", "", "serve /healthz, /readyz and /metrics of every operator of the demo on ADDR (e.g. 127.0.0.1:9464) while it runs (default: none)")
	cpath := fs.String("contract", "", "learning contract the run starts from (default: the built-in demo contract); --seed, --run, --async and --max-lag, when given, replace its fields")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if err := noArgs("demo", pos); err != nil {
		return err
	}
	if err := demoOptions(fs, &o, demoFlags{brokers: *brokers, evalSamples: *evalSamples, env: env, policy: pf, contract: *cpath}); err != nil {
		return err
	}
	if *health != "" {
		o.Metrics = pipeline.NewMetrics(nil)
		hs, err := pipeline.NewHealthServer(*health, o.Metrics)
		if err != nil {
			return fmt.Errorf("%w: --health: %w", errUsage, err)
		}
		hctx, stop := context.WithCancel(ctx)
		served := make(chan struct{})
		go func() { defer close(served); _ = hs.Serve(hctx) }()
		defer func() { stop(); <-served }()
		fmt.Fprintf(stdout, "demo metrics on http://%s/metrics\n", hs.Addr())
	}
	s, err := loop.Run(ctx, o, stdout)
	if errors.Is(err, loop.ErrRunUsed) {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, loop.SummaryLine(s, filepath.Join(o.Out, loop.SummaryFile)))
	fmt.Fprintln(stdout, costLine(s.Cost))
	if g := s.Gate; g != nil {
		stop := "ran every round"
		if g.Stop != nil {
			stop = fmt.Sprintf("stopped by %s at release %d", g.Stop.StopRule, g.Stop.PolicyVersion)
		}
		fmt.Fprintf(stdout, "gate: promoted release %d (%d promotions, %d rollbacks), %s; spent %d rollout and %d optimizer tokens\n",
			g.Promoted, g.Promotions, g.Rollbacks, stop, g.Usage.RolloutTokens, g.Usage.OptimizerTokens)
	}
	return nil
}

// costLine is the printed form of a run's cost ledger.
func costLine(c schemas.UpdateCost) string {
	account := func(name string, e schemas.EpisodeCost) string {
		return fmt.Sprintf("%s %d episodes, %d tokens, %.3g h generation, %.3g h environment",
			name, e.Episodes, e.RolloutTokens, e.GenerationHours, e.EnvironmentHours)
	}
	return fmt.Sprintf("cost: %s; %s; %s; training %d optimizer tokens, %.3g accelerator h",
		account("rollout", c.Rollout), account("rejected", c.Rejected), account("failed", c.Failed),
		c.Training.OptimizerTokens, c.Training.AcceleratorHours)
}

// demoFlags are the demo's flags that are not fields of loop.Options.
type demoFlags struct {
	brokers     string
	evalSamples int
	env         envFlags
	policy      policyFlags
	contract    string
}

// demoOptions completes o from the flags of fs and checks it whole
// (loop.Check), before anything starts.
func demoOptions(fs *flag.FlagSet, o *loop.Options, f demoFlags) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if err := firstBad(
		flagCheck{o.Updates < 1, fmt.Sprintf("--updates %d: want 1 or more", o.Updates)},
		flagCheck{set["is-cap"] && o.OffPolicy == "", fmt.Sprintf("--is-cap %v needs --off-policy (the loss.is_cap of the loss.off_policy it sets)", o.ISCap)},
	); err != nil {
		return err
	}
	if err := checkInt32("--eval-samples", f.evalSamples, 1); err != nil {
		return err
	}
	if err := checkOutDir("--out", o.Out); err != nil {
		return err
	}
	if err := f.policy.apply(o); err != nil {
		return err
	}
	if f.contract != "" {
		if err := demoBase(o, f.contract, set); err != nil {
			return err
		}
	}
	if set["max-lag"] && !o.Async {
		return fmt.Errorf("%w: --max-lag %d has no effect without --async (a synchronous run trains every round on the policy that generated it)", errUsage, o.MaxLag)
	}
	var err error
	if o.Brokers, err = brokerList("--brokers", f.brokers); err != nil {
		return err
	}
	if o.Env, err = f.env.list(); err != nil {
		return err
	}
	o.EnvKeyFile = *f.env.keyFile
	o.EvalSamples = int32(f.evalSamples)
	if err := loop.Check(*o); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return nil
}

// demoBase makes the contract at path the base of the demo run: its seed
// and, when --async is not given, its dispatch mode and lag bound are
// kept; a policy section on servers is taken unless --policy is given.
func demoBase(o *loop.Options, path string, set map[string]bool) error {
	base, err := contract.Load(path)
	if err != nil {
		return fmt.Errorf("%w: --contract: %w", errUsage, err)
	}
	if err := base.Clone().Resolve(); err != nil {
		return fmt.Errorf("%w: --contract %s: %w", errUsage, path, err)
	}
	if !set["seed"] {
		o.Seed = base.Seed
	}
	if !set["async"] && base.Dispatch.Mode == contract.DispatchAsync {
		o.Async = true
		if !set["max-lag"] {
			o.MaxLag = base.Packing.MaxLag
		}
	}
	if !set["policy"] && base.Policy.Protocol != "" && base.Policy.Protocol != contract.PolicyBuiltin {
		o.Policy = base.Policy
	}
	o.Base = base
	return nil
}
