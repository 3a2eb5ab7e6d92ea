package loop

import (
	"context"
	"fmt"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/evaluation"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// ReportConfig says which finished run FleetReport accounts.
type ReportConfig struct {
	Contract    *contract.Contract // resolved
	Client      kafka.ClientConfig // the cluster: brokers, TLS and SASL
	Rounds      int
	EvalSamples int32 // attempts per hidden-eval task (>= 1)
}

// FleetReport is the summary the demo writes, of a run that separate
// operators ran to its end (`trajflow up`, or `trajflow run` processes
// with --rounds): the hidden-eval success of the initial policy and of
// the last release, the accounting of every launched attempt and the hash
// of every batch, all read back from the run's topics and releases. For
// the same contract and round count its counts, batch hashes and eval
// results equal the demo's. Per-update lines are not part of it.
func FleetReport(ctx context.Context, rc ReportConfig) (*Summary, error) {
	c := rc.Contract
	if rc.EvalSamples < 1 {
		return nil, fmt.Errorf("loop: eval samples %d must be positive", rc.EvalSamples)
	}
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return nil, err
	}
	deps, err := operators.BuiltinDeps(c)
	if err != nil {
		return nil, err
	}
	dialer, err := rc.Client.Dialer()
	if err != nil {
		return nil, err
	}
	transport, err := rc.Client.Transport()
	if err != nil {
		return nil, err
	}
	defer transport.CloseIdleConnections()
	start := time.Now()
	r := &runner{dialer: dialer, transport: transport, o: Options{Updates: rc.Rounds, EvalSamples: rc.EvalSamples, Quiet: true}, c: c, topics: topics,
		deps: deps, brokers: rc.Client.Brokers, start: start,
		sum: &Summary{RunID: c.RunID, ContractHash: c.Hash(), Seed: c.Seed, Mode: c.Dispatch.Mode, Rounds: rc.Rounds}}
	ev, err := evaluation.New(evaluation.Config{Registry: deps.Tasks, Settings: operators.RolloutSettings(c, deps.Tasks),
		Limits: operators.RolloutLimits(c), Seed: c.Seed, Samples: rc.EvalSamples})
	if err != nil {
		return nil, err
	}
	mc, mseed := operators.ModelConfig(c)
	m0, err := gpu.InitialModel(mc, mseed)
	if err != nil {
		return nil, err
	}
	s0, err := ev.Success(ctx, model.NewPolicy(m0, 0))
	if err != nil {
		return nil, err
	}
	r.sum.EvalSuccessInitial, r.sum.EvalSuccessFinal = s0, s0
	r.sum.Evals = []Eval{{0, s0}}
	cfg := r.readConfig()
	var last schemas.PolicyRelease
	err = pipeline.ScanTail(ctx, cfg, topics.Policy, 0, func(m pipeline.Message) error {
		if rel, err := schemas.DecodeRelease(m.Value); err == nil && rel.Ready && rel.PolicyVersion > last.PolicyVersion {
			last = rel
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	r.sum.Updates = int(last.PolicyVersion)
	if last.PolicyVersion > 0 {
		s, err := ev.Release(ctx, last)
		if err != nil {
			return nil, fmt.Errorf("loop: hidden eval of release %d: %w", last.PolicyVersion, err)
		}
		r.sum.EvalSuccessFinal = s
		r.sum.Evals = append(r.sum.Evals, Eval{last.PolicyVersion, s})
	}
	var tokens, capacity int64
	err = pipeline.ScanTail(ctx, cfg, topics.Windows, 0, func(m pipeline.Message) error {
		w, err := schemas.DecodeWindow(m.Value)
		if err != nil {
			return nil
		}
		tokens += w.Tokens
		capacity += int64(w.Rows) * int64(c.Packing.TokenBudget)
		r.sum.MaxLagSeen = max(r.sum.MaxLagSeen, w.MaxLag)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if capacity > 0 {
		r.sum.PackingEfficiency = float64(tokens) / float64(capacity)
	}
	if err := r.account(ctx); err != nil {
		return nil, err
	}
	r.sum.WallSeconds = time.Since(start).Seconds()
	return r.sum, nil
}

// SummaryLine is the one line the demo prints at its end.
// A run without evaluations (--no-gate, or tasks of a server's model)
// says so instead of printing success rates it never measured.
func SummaryLine(s *Summary, path string) string {
	eval := fmt.Sprintf("hidden-eval success %.3f -> %.3f", s.EvalSuccessInitial, s.EvalSuccessFinal)
	if len(s.Evals) == 0 {
		eval = "no hidden eval"
	}
	return fmt.Sprintf("%s in %d updates (%.1fs); launched %d, admitted %d, %d excluded as stale at their update, filtered %d, duplicates %d, lost %d; stale share %.4f; summary in %s",
		eval, s.Updates, s.WallSeconds, s.AttemptsLaunched, s.TrajectoriesAdmitted,
		s.TrajectoriesExcluded, s.TrajectoriesFiltered, s.DuplicatesAdmitted, s.Lost, s.StaleShare, path)
}
