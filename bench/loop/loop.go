// Package loop is `trajflow bench loop`: the RL loop of `trajflow demo`
// (internal/loop) run in synchronous and asynchronous mode on the same
// seed and the same simulated latency (the contract's latency section),
// one after the other in one process, with the measures that say whether
// asynchrony pays: updates per second, trained tokens per second, the
// stale share, the lag distribution at the update, and hidden-eval
// success at the end.
package loop

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// Modes of a bench run.
const (
	ModeSync  = "sync"
	ModeAsync = "async"
)

// Options configure a bench run.
type Options struct {
	// Modes to run, in order (default sync then async).
	Modes   []string
	Updates int   // rounds dispatched per mode (>= 1)
	Seed    int64 // contract seed of both modes
	MaxLag  int64 // packing.max_lag of the async mode
	// OffPolicy and ISCap set the async mode's loss.off_policy and
	// loss.is_cap ("": the contract's); PartialRollouts and StalePolicy its
	// dispatch.partial_rollouts and packing.stale_policy.
	OffPolicy       string
	ISCap           float64
	PartialRollouts string
	StalePolicy     string
	// Latency is the simulated latency of both modes.
	Latency contract.Latency
	// Workers is the number of rollout operators (both modes).
	Workers     int
	EvalSamples int32
	Out         string // each mode writes its demo output under Out/MODE
	// Compare is the update at whose release both modes are timed (0:
	// Updates - Drain). The last rounds of a run drain — no next round
	// overlaps their stragglers — which sync pays at every round and
	// async once, at the end; the comparison is at steady state before
	// it. Seconds (to the last release) is reported too.
	Compare int
}

// BenchEnvironmentHours is the environment-hours budget of a bench run:
// far more than any bench spends, so no mode is stopped by it.
const BenchEnvironmentHours = 1e4

// Drain is the default number of final updates left out of the
// comparison (Options.Compare).
const Drain = 4

// DefaultLatency is the bench's latency model: heavy-tailed tool calls
// (median 40 ms, log-normal sigma 1: the slowest of a round's thousand
// calls takes about 25 times the median) and 2 ms per generated token
// (sigma 0.5).
func DefaultLatency() contract.Latency {
	return contract.Latency{ToolMedianMS: 40, ToolSigma: 1, TokenMedianMS: 2, TokenSigma: 0.5}
}

// Result is one mode's measures.
type Result struct {
	Mode   string `json:"mode"`
	MaxLag int64  `json:"max_lag"`
	// PartialRollouts and StalePolicy of the mode ("" for sync).
	PartialRollouts string `json:"partial_rollouts,omitempty"`
	StalePolicy     string `json:"stale_policy,omitempty"`
	// Updates trained; Seconds from the operators' start to the last
	// release (evaluation excluded).
	Updates int     `json:"updates"`
	Seconds float64 `json:"seconds"`
	// SecondsAt is the time of the release of version Compared (an
	// update both modes trained, before the final drain), the base of the
	// comparison.
	Compared  int     `json:"compared_updates"`
	SecondsAt float64 `json:"seconds_at_compared"`
	// Rates to the compared release.
	UpdatesPerSecond  float64            `json:"updates_per_second"`
	TrainedTokens     int64              `json:"trained_tokens"`
	TrainedTokensPerS float64            `json:"trained_tokens_per_second"`
	StaleShare        float64            `json:"stale_share"`
	StaleTokens       int64              `json:"stale_tokens"`
	Excluded          int                `json:"trajectories_excluded"`
	Lost              int                `json:"lost"`
	Duplicates        int                `json:"duplicates_admitted"`
	Lag               []schemas.LagCount `json:"lag_at_update"`
	EvalSuccess       float64            `json:"eval_success_final"`
	WallSeconds       float64            `json:"wall_seconds"`
}

// Report is a bench run.
type Report struct {
	Seed    int64            `json:"seed"`
	Latency contract.Latency `json:"latency"`
	Workers int              `json:"rollout_workers"`
	Results []Result         `json:"results"`
	// Speedup is the sync time over the async time at the same number of
	// updates (Compared; 0 unless both modes ran), SpeedupAll the same to
	// the last release (drain included); EvalGap async minus sync success.
	Speedup    float64 `json:"speedup"`
	SpeedupAll float64 `json:"speedup_all"`
	EvalGap    float64 `json:"eval_gap"`
}

// Check reports what Run refuses in o before it runs any mode: modes
// other than sync and async or given twice, counts that are not
// positive, a compared update past the last, and the contract of each
// mode (loop.Check). It starts nothing.
func Check(o Options) error {
	if len(o.Modes) == 0 {
		o.Modes = []string{ModeSync, ModeAsync}
	}
	if o.Updates < 1 || o.Workers < 1 || o.EvalSamples < 1 {
		return fmt.Errorf("bench loop: updates %d, workers %d and eval samples %d must be positive", o.Updates, o.Workers, o.EvalSamples)
	}
	if o.Compare < 0 || o.Compare > o.Updates {
		return fmt.Errorf("bench loop: compare %d: want 0 (updates - %d) to the updates, %d", o.Compare, Drain, o.Updates)
	}
	for i, mode := range o.Modes {
		if mode != ModeSync && mode != ModeAsync {
			return fmt.Errorf("bench loop: mode %q (want %s or %s)", mode, ModeSync, ModeAsync)
		}
		if slices.Contains(o.Modes[:i], mode) {
			return fmt.Errorf("bench loop: mode %s given twice", mode)
		}
		if err := loop.Check(modeOptions(o, mode)); err != nil {
			return fmt.Errorf("bench loop: %s: %w", mode, err)
		}
	}
	return nil
}

// modeOptions are the loop options of one mode of o.
func modeOptions(o Options, mode string) loop.Options {
	lat := o.Latency
	lo := loop.Options{
		Updates: o.Updates, Out: filepath.Join(o.Out, mode), Seed: o.Seed, Async: mode == ModeAsync,
		MaxLag: o.MaxLag, EvalSamples: o.EvalSamples, EvalEvery: o.Updates + 1, Quiet: true,
		Latency: &lat, RolloutWorkers: o.Workers, RunID: "bench-loop-" + mode,
		// The simulated latency is charged to the environment-hours
		// budget (about 0.05 h a round at the default latency): the
		// demo's hour would stop both modes by budget_exhausted after
		// about 20 rounds. The bench times a fixed number of updates,
		// so it lifts that budget; every other rule stays.
		Edit: func(c *contract.Contract) {
			c.Budgets.EnvironmentHours = max(c.Budgets.EnvironmentHours, BenchEnvironmentHours)
		},
	}
	if mode == ModeAsync {
		lo.OffPolicy, lo.ISCap = o.OffPolicy, o.ISCap
		lo.PartialRollouts, lo.StalePolicy = o.PartialRollouts, o.StalePolicy
	}
	return lo
}

// Run runs the modes of o one after the other and returns the report.
// progress, when not nil, gets one line per mode.
func Run(ctx context.Context, o Options, progress io.Writer) (*Report, error) {
	if len(o.Modes) == 0 {
		o.Modes = []string{ModeSync, ModeAsync}
	}
	if err := Check(o); err != nil {
		return nil, err
	}
	rep := &Report{Seed: o.Seed, Latency: o.Latency, Workers: o.Workers}
	sums := map[string]*loop.Summary{}
	for _, mode := range o.Modes {
		lo := modeOptions(o, mode)
		s, err := loop.Run(ctx, lo, io.Discard)
		if err != nil {
			return nil, fmt.Errorf("bench loop: %s: %w", mode, err)
		}
		if g := s.Gate; g != nil && g.Stop != nil {
			return nil, fmt.Errorf("bench loop: %s: the gate stopped the run at release %d (%s): the modes would not compare the same updates", mode, g.Stop.PolicyVersion, g.Stop.Reason)
		}
		sums[mode] = s
		if progress != nil {
			fmt.Fprintf(progress, "bench loop: %s done: %d updates in %.1fs, hidden-eval %.3f\n", mode, s.Updates, last(s.ReleaseSeconds), s.EvalSuccessFinal)
		}
	}
	compared := 1 << 30
	for _, s := range sums {
		compared = min(compared, s.Updates)
	}
	if o.Compare > 0 {
		compared = min(compared, o.Compare)
	} else if compared > 2*Drain {
		compared -= Drain
	}
	for _, mode := range o.Modes {
		s := sums[mode]
		r := Result{
			Mode: mode, Updates: s.Updates, Seconds: last(s.ReleaseSeconds), Compared: compared,
			TrainedTokens: s.TrainedTokens, StaleShare: s.StaleShare, StaleTokens: s.StaleTokens,
			Excluded: s.TrajectoriesExcluded, Lost: s.Lost, Duplicates: s.DuplicatesAdmitted,
			Lag: s.LagTokens, EvalSuccess: s.EvalSuccessFinal, WallSeconds: s.WallSeconds,
		}
		if mode == ModeAsync {
			r.MaxLag, r.PartialRollouts, r.StalePolicy = o.MaxLag, o.PartialRollouts, o.StalePolicy
		}
		if compared > 0 && compared <= len(s.ReleaseSeconds) {
			r.SecondsAt = s.ReleaseSeconds[compared-1]
		}
		if r.Seconds > 0 {
			r.UpdatesPerSecond = float64(s.Updates) / r.Seconds
			r.TrainedTokensPerS = float64(s.TrainedTokens) / r.Seconds
		}
		if r.SecondsAt > 0 {
			// Rates at steady state: to the compared release.
			r.UpdatesPerSecond = float64(compared) / r.SecondsAt
			r.TrainedTokensPerS = float64(s.ReleaseTokens[compared-1]) / r.SecondsAt
		}
		rep.Results = append(rep.Results, r)
	}
	if sy, as := sums[ModeSync], sums[ModeAsync]; sy != nil && as != nil {
		var ts, ta, tsAll, taAll float64
		for _, r := range rep.Results {
			if r.Mode == ModeSync {
				ts, tsAll = r.SecondsAt, r.Seconds
			} else {
				ta, taAll = r.SecondsAt, r.Seconds
			}
		}
		if ta > 0 {
			rep.Speedup = ts / ta
		}
		if taAll > 0 && sy.Updates == as.Updates {
			rep.SpeedupAll = tsAll / taAll
		}
		rep.EvalGap = as.EvalSuccessFinal - sy.EvalSuccessFinal
	}
	if o.Out != "" {
		if err := os.MkdirAll(o.Out, 0o755); err != nil {
			return nil, err
		}
		b, _ := json.MarshalIndent(rep, "", "  ")
		if err := os.WriteFile(filepath.Join(o.Out, "bench-loop.json"), append(b, '\n'), 0o644); err != nil {
			return nil, fmt.Errorf("bench loop: %w", err)
		}
	}
	return rep, nil
}

func last(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	return xs[len(xs)-1]
}

// Print writes the report as a table.
func (r *Report) Print(w io.Writer) {
	l := r.Latency
	fmt.Fprintf(w, "trajflow bench loop: seed %d, %d rollout workers, latency tool %g ms (sigma %g), token %g ms (sigma %g)\n",
		r.Seed, r.Workers, l.ToolMedianMS, l.ToolSigma, l.TokenMedianMS, l.TokenSigma)
	fmt.Fprintf(w, "%-6s %7s %7s %9s %10s %9s %12s %8s %6s %5s %5s  %-22s %s\n", "mode", "max_lag", "updates", "seconds",
		"s@compare", "updates/s", "trained tok/s", "stale", "excl", "lost", "dups", "lag at update (tokens)", "hidden-eval")
	for _, x := range r.Results {
		if x.Mode == ModeAsync && (x.PartialRollouts != "" || x.StalePolicy != "") {
			defer fmt.Fprintf(w, "async: partial_rollouts %s, stale_policy %s\n", x.PartialRollouts, x.StalePolicy)
		}
		var lag []string
		for _, c := range x.Lag {
			lag = append(lag, fmt.Sprintf("%d:%d", c.Lag, c.Tokens))
		}
		fmt.Fprintf(w, "%-6s %7d %7d %9.1f %10.1f %9.3f %12.0f %8.4f %6d %5d %5d  %-22s %.3f\n", x.Mode, x.MaxLag, x.Updates, x.Seconds,
			x.SecondsAt, x.UpdatesPerSecond, x.TrainedTokensPerS, x.StaleShare, x.Excluded, x.Lost, x.Duplicates, strings.Join(lag, " "), x.EvalSuccess)
	}
	if r.Speedup > 0 {
		all := fmt.Sprintf("all %d, final drain included: speed-up %.2fx", r.Results[0].Updates, r.SpeedupAll)
		if r.SpeedupAll == 0 { // the modes made different numbers of updates (rounds with no batch)
			var counts []string
			for _, x := range r.Results {
				counts = append(counts, fmt.Sprintf("%s %d", x.Mode, x.Updates))
			}
			all = "the runs to their end not compared (updates: " + strings.Join(counts, ", ") + ")"
		}
		fmt.Fprintf(w, "async completes %d updates in %.2fx the time of sync (speed-up %.2fx); %s; hidden-eval async - sync = %+.3f\n",
			r.Results[0].Compared, 1/r.Speedup, r.Speedup, all, r.EvalGap)
	}
}
