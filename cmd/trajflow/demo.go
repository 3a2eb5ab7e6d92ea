package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

func init() {
	register("demo", "the RL loop end to end: embedded broker, every operator over Kafka, hidden eval (--updates, --out, --seed, --brokers)", cmdDemo)
}

// loopStages are the operators of the RL loop, in pipeline order.
var loopStages = []string{"dispatch", "rollout", "validate", "reward", "advantage", "pack", "train"}

// demoOptions configure one demo run.
type demoOptions struct {
	Updates     int      // update rounds dispatched
	Out         string   // output directory (summary.json, releases/, demo.log)
	Seed        int64    // contract seed (also seeds the initial weights)
	Brokers     []string // external cluster; empty starts the embedded broker
	RunID       string   // run id (topic prefix); default the contract's
	Async       bool     // asynchronous mode with MaxLag
	MaxLag      int64
	EvalSamples int32 // attempts per hidden-eval task
	EvalEvery   int   // 0: the contract's dispatch.eval_every
	Quiet       bool  // no per-update lines
}

// demoUpdate is one line of the demo's output.
type demoUpdate struct {
	Update      int64    `json:"update"` // policy version produced
	BatchID     string   `json:"batch_id"`
	Success     float64  `json:"success"` // verified success of the update's rollouts
	Reward      float64  `json:"reward"`
	KL          float64  `json:"kl"` // approx KL(behavior || current) at the update's last optimizer step
	ClipFrac    float64  `json:"clip_frac"`
	Entropy     float64  `json:"entropy"`
	Lag         int64    `json:"lag"` // largest policy lag among the batch's tokens
	Tokens      int64    `json:"tokens"`
	TokensPerS  float64  `json:"tokens_per_s"`
	Packing     float64  `json:"packing_efficiency"`
	EvalSuccess *float64 `json:"eval_success,omitempty"`
}

// demoEval is one hidden-eval measurement.
type demoEval struct {
	Version int64   `json:"policy_version"`
	Success float64 `json:"success"`
}

// demoSummary is OUT/summary.json.
type demoSummary struct {
	RunID                string       `json:"run_id"`
	ContractHash         string       `json:"contract_hash"`
	Seed                 int64        `json:"seed"`
	Mode                 string       `json:"mode"`
	Rounds               int          `json:"rounds"`
	Updates              int          `json:"updates"` // policy updates trained
	EvalSuccessInitial   float64      `json:"eval_success_initial"`
	EvalSuccessFinal     float64      `json:"eval_success_final"`
	Evals                []demoEval   `json:"evals"`
	AttemptsLaunched     int          `json:"attempts_launched"`
	TrajectoriesAdmitted int          `json:"trajectories_admitted"`
	TrajectoriesFiltered int          `json:"trajectories_filtered"`
	Quarantined          int          `json:"quarantined"`
	DuplicatesAdmitted   int          `json:"duplicates_admitted"`
	Lost                 int          `json:"lost"`
	PackingEfficiency    float64      `json:"packing_efficiency"`
	MaxLagSeen           int64        `json:"max_lag_seen"`
	BatchHashes          []string     `json:"batch_hashes"`
	PerUpdate            []demoUpdate `json:"per_update"`
	WallSeconds          float64      `json:"wall_seconds"`
}

func cmdDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("demo", stderr)
	o := demoOptions{}
	fs.IntVar(&o.Updates, "updates", 60, "update rounds to dispatch (a round whose groups are all filtered trains nothing)")
	fs.StringVar(&o.Out, "out", filepath.Join("out", "demo"), "output directory (summary.json, releases/, demo.log)")
	fs.Int64Var(&o.Seed, "seed", 1, "contract seed (random streams and initial weights)")
	brokers := fs.String("brokers", "", "comma-separated brokers of an external cluster (default: start the embedded broker)")
	fs.StringVar(&o.RunID, "run", "", "run id, the topic prefix (default: the demo contract's)")
	fs.BoolVar(&o.Async, "async", false, "asynchronous mode: up to max-lag+1 rounds in flight, stale samples dropped")
	fs.Int64Var(&o.MaxLag, "max-lag", 1, "policy versions a sample may lag the trainer (with --async)")
	evalSamples := fs.Int("eval-samples", 4, "attempts per hidden-eval task (fixed seeds)")
	if _, err := parseFlags(fs, args); err != nil {
		return err
	}
	o.Brokers = splitList(*brokers)
	o.EvalSamples = int32(*evalSamples)
	if o.Updates < 1 || o.EvalSamples < 1 {
		return fmt.Errorf("%w: --updates and --eval-samples must be positive", errUsage)
	}
	s, err := runDemo(ctx, o, stdout)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "hidden-eval success %.3f -> %.3f in %d updates (%.1fs); launched %d, admitted %d, filtered %d, duplicates %d, lost %d; summary in %s\n",
		s.EvalSuccessInitial, s.EvalSuccessFinal, s.Updates, s.WallSeconds, s.AttemptsLaunched, s.TrajectoriesAdmitted,
		s.TrajectoriesFiltered, s.DuplicatesAdmitted, s.Lost, filepath.Join(o.Out, "summary.json"))
	return nil
}

// demoContract is the demo contract for o.
func demoContract(o demoOptions) (*contract.Contract, error) {
	c := contract.Default()
	c.Seed = o.Seed
	if o.RunID != "" {
		c.RunID = o.RunID
	}
	if o.Async {
		c.Dispatch.Mode = contract.DispatchAsync
		c.Packing.MaxLag = o.MaxLag
	}
	if err := c.Resolve(); err != nil {
		return nil, err
	}
	return c, nil
}

// evaluator measures the hidden-eval success of a policy on fixed
// attempts (the evaluation plane: in process, never on training topics):
// the same attempt ids and seeds for every version and every run of the
// same contract seed.
type evaluator struct {
	reg      *rollout.Registry
	val      *rollout.Validator
	settings model.Settings
	limits   rollout.Limits
	runID    string
	seed     int64
	samples  int32
}

func (e *evaluator) success(ctx context.Context, pol *model.Policy) (float64, error) {
	var atts []schemas.TaskAttempt
	for i, t := range e.reg.Eval() {
		atts = append(atts, rollout.Attempts("hidden-eval", t, int64(i), e.samples, e.seed, pol.Version(), "eval")...)
	}
	trajs, err := e.reg.RunEpisodes(ctx, pol, atts, e.settings, e.limits)
	if err != nil {
		return 0, err
	}
	ok := 0
	for i := range trajs {
		task, _ := e.reg.Lookup(trajs[i].TaskID)
		good, _, err := e.val.Validate(task, &trajs[i])
		if err != nil {
			return 0, err
		}
		if good {
			ok++
		}
	}
	return float64(ok) / float64(len(trajs)), nil
}

// tail reads partition 0 of topic from the start and sends every record
// until ctx ends.
func tail(ctx context.Context, brokers []string, topic string, out chan<- kafkago.Message) {
	for ctx.Err() == nil {
		r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: brokers, Topic: topic, Partition: 0, MinBytes: 1, MaxBytes: 64 << 20, MaxWait: kafka.FetchMaxWait})
		for {
			m, err := r.FetchMessage(ctx)
			if err != nil {
				break
			}
			select {
			case out <- m:
			case <-ctx.Done():
			}
		}
		r.Close()
		if ctx.Err() == nil {
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// runDemo runs the loop and returns its summary (also written to
// OUT/summary.json).
func runDemo(ctx context.Context, o demoOptions, stdout io.Writer) (*demoSummary, error) {
	start := time.Now()
	c, err := demoContract(o)
	if err != nil {
		return nil, err
	}
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		return nil, fmt.Errorf("demo: output directory: %w", err)
	}
	// A demo is a new run: releases and operator state of an earlier run
	// in the same directory must not leak into it (the operators' local
	// state remembers record ids, which are deterministic).
	releases := filepath.Join(o.Out, "releases")
	for _, d := range []string{releases, filepath.Join(o.Out, "state")} {
		if err := os.RemoveAll(d); err != nil {
			return nil, fmt.Errorf("demo: clear %s: %w", d, err)
		}
	}
	logf, err := os.Create(filepath.Join(o.Out, "demo.log"))
	if err != nil {
		return nil, fmt.Errorf("demo: log: %w", err)
	}
	defer logf.Close()
	log := slog.New(slog.NewTextHandler(logf, &slog.HandlerOptions{Level: slog.LevelInfo})).With("run", c.RunID)

	brokers := o.Brokers
	if len(brokers) == 0 {
		b, err := kafka.StartBroker(ctx, kafka.BrokerConfig{Logger: log})
		if err != nil {
			return nil, err
		}
		defer b.Close()
		brokers = []string{b.Addr()}
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = kafka.CreateTopics(cctx, kafka.ClientConfig{}, brokers, operators.TopicSpecs(c, topics))
	if err == nil && len(o.Brokers) > 0 {
		// Record ids are deterministic: a second run under the same run id
		// on the same cluster would be deduplicated against the first.
		used := false
		err = pipeline.ScanTail(cctx, &pipeline.Config{Brokers: brokers}, topics.Tasks, 1, func(pipeline.Message) error {
			used = true
			return nil
		})
		if err == nil && used {
			err = fmt.Errorf("%w: run %q already has records on %s; pick another --run", errUsage, c.RunID, topics.Tasks)
		}
	}
	cancel()
	if err != nil {
		return nil, err
	}

	deps, err := operatorDeps(c, topics)
	if err != nil {
		return nil, err
	}
	deps.ReleaseDir, deps.Rounds = releases, int64(o.Updates)
	files, err := pipeline.NewDirReleases(releases)
	if err != nil {
		return nil, err
	}
	deps.PartialGroupTimeout = 30 * time.Second // only matters if a member is lost to quarantine
	reg := deps.Tasks
	ev := &evaluator{
		reg: reg, val: rollout.NewValidator(reg), settings: operators.RolloutSettings(c, reg),
		limits: operators.RolloutLimits(c), runID: c.RunID, seed: c.Seed, samples: o.EvalSamples,
	}
	evalEvery := o.EvalEvery
	if evalEvery <= 0 {
		evalEvery = c.Dispatch.EvalEvery
	}
	sum := &demoSummary{RunID: c.RunID, ContractHash: c.Hash(), Seed: c.Seed, Mode: c.Dispatch.Mode, Rounds: o.Updates}

	// The initial policy, exactly as the trainer will publish it.
	mc, mseed := operators.ModelConfig(c)
	m0, err := gpu.InitialModel(mc, mseed)
	if err != nil {
		return nil, err
	}
	if sum.EvalSuccessInitial, err = ev.success(ctx, model.NewPolicy(m0, 0)); err != nil {
		return nil, err
	}
	sum.Evals = append(sum.Evals, demoEval{0, sum.EvalSuccessInitial})
	if !o.Quiet {
		fmt.Fprintf(stdout, "trajflow demo: run %s, seed %d, %s mode, %d rounds of %d groups x %d attempts; operators %v on %v\n",
			c.RunID, c.Seed, c.Dispatch.Mode, o.Updates, c.Dispatch.GroupsPerUpdate, c.Sampler.GroupSize, loopStages, brokers)
		fmt.Fprintf(stdout, "hidden eval (%d tasks x %d fixed attempts) at version 0: success %.3f\n", len(reg.Eval()), o.EvalSamples, sum.EvalSuccessInitial)
		fmt.Fprintln(stdout, "update  success  reward      kl    clip  entropy  lag  tokens/s  packing  eval")
	}

	// Every operator of the loop, each a Kafka consumer group of its own.
	opCtx, stopOps := context.WithCancel(context.Background())
	defer stopOps()
	var wg sync.WaitGroup
	errs := make(chan error, len(loopStages))
	defer func() {
		stopOps()
		wg.Wait()
	}()
	for _, name := range loopStages {
		op, err := operators.NewOperator(name, deps, pipeline.Config{
			Brokers: brokers, StateDir: filepath.Join(o.Out, "state", name),
			Logger: log.With("stage", name), Instance: "demo-" + name,
			CommitInterval: 100 * time.Millisecond, TickInterval: 50 * time.Millisecond, BatchTimeout: time.Millisecond,
		})
		if err != nil {
			return nil, err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := op.Run(opCtx); err != nil && !errors.Is(err, pipeline.ErrStopped) {
				errs <- fmt.Errorf("operator %s: %w", name, err)
			}
		}()
	}

	// The Parquet snapshot of every topic, for `trajflow replay` and
	// `trajflow census` (lineage, pipeline §1).
	snap, err := startRunSnapshot(c, topics, deps, brokers, o.Out, log)
	if err != nil {
		return nil, err
	}
	defer snap.stop()

	// Follow the loop: window records (pack's decisions) and releases.
	tctx, stopTail := context.WithCancel(ctx)
	defer stopTail()
	windows := make(chan kafkago.Message, 64)
	policy := make(chan kafkago.Message, 64)
	go tail(tctx, brokers, topics.Windows, windows)
	go tail(tctx, brokers, topics.Policy, policy)

	wantGroups := o.Updates * c.Dispatch.GroupsPerUpdate
	decided, batches := 0, 0
	byBatch := map[string]schemas.WindowRecord{}
	var packTokens, packCapacity int64
	lastVersion := int64(0)
	lastAt := time.Now()
	evaluated := map[int64]bool{0: true}
	var lastRel schemas.PolicyRelease
	type queuedUpdate struct {
		rel schemas.PolicyRelease
		u   gpu.UpdateRecord
	}
	var queued []queuedUpdate
	for decided < wantGroups || lastVersion < int64(batches) || len(queued) > 0 {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case err := <-errs:
			return nil, err
		case km := <-windows:
			w, err := schemas.DecodeWindow(km.Value)
			if err != nil {
				return nil, fmt.Errorf("demo: window record: %w", err)
			}
			decided += len(w.Groups)
			packTokens += w.Tokens
			packCapacity += int64(w.Rows) * int64(c.Packing.TokenBudget)
			sum.MaxLagSeen = max(sum.MaxLagSeen, w.MaxLag)
			if w.BatchID == "" {
				if !o.Quiet {
					fmt.Fprintf(stdout, "     -  %7.3f  %6.3f  (every group of the round filtered: no batch, no update)\n", w.SuccessRate, w.RewardMean)
				}
				continue
			}
			batches++
			byBatch[w.BatchID] = w
		case km := <-policy:
			rel, err := schemas.DecodeRelease(km.Value)
			if err != nil || !rel.Ready || rel.PolicyVersion <= lastVersion {
				continue
			}
			lastRel = rel
			lastVersion = rel.PolicyVersion
			u, err := gpu.ReadUpdate(files, rel.PolicyVersion)
			if err != nil {
				return nil, err
			}
			queued = append(queued, queuedUpdate{rel, u})
		}
		// Report releases in order once pack's record of their batch is in.
		for len(queued) > 0 {
			rel, u := queued[0].rel, queued[0].u
			w, ok := byBatch[u.BatchID]
			if !ok {
				break
			}
			queued = queued[1:]
			now := time.Now()
			line := demoUpdate{
				Update: rel.PolicyVersion, BatchID: u.BatchID, Success: w.SuccessRate, Reward: w.RewardMean,
				KL: u.Last.ApproxKLOld, ClipFrac: clipFrac(u.Last), Entropy: u.Metrics.Entropy, Lag: w.MaxLag,
				Tokens: w.Tokens, TokensPerS: float64(w.Tokens) / now.Sub(lastAt).Seconds(), Packing: w.Efficiency,
			}
			for _, l := range u.Metrics.Lag {
				line.Lag = max(line.Lag, l.Lag)
			}
			sum.MaxLagSeen = max(sum.MaxLagSeen, line.Lag)
			lastAt = now
			evalNote := ""
			if rel.PolicyVersion%int64(evalEvery) == 0 {
				s, err := evalRelease(ctx, ev, rel)
				if err != nil {
					return nil, err
				}
				evaluated[rel.PolicyVersion] = true
				sum.Evals = append(sum.Evals, demoEval{rel.PolicyVersion, s})
				line.EvalSuccess = &s
				evalNote = fmt.Sprintf("%.3f", s)
			}
			sum.PerUpdate = append(sum.PerUpdate, line)
			if !o.Quiet {
				fmt.Fprintf(stdout, "%6d  %7.3f  %6.3f  %6.4f  %6.3f  %7.3f  %3d  %8.0f  %7.3f  %s\n",
					line.Update, line.Success, line.Reward, line.KL, line.ClipFrac, line.Entropy, line.Lag,
					line.TokensPerS, line.Packing, evalNote)
			}
		}
	}
	sum.Updates = int(lastVersion)
	sum.EvalSuccessFinal = sum.EvalSuccessInitial
	if lastVersion > 0 {
		if !evaluated[lastVersion] {
			s, err := evalRelease(ctx, ev, lastRel)
			if err != nil {
				return nil, err
			}
			sum.Evals = append(sum.Evals, demoEval{lastVersion, s})
		}
		sum.EvalSuccessFinal = sum.Evals[len(sum.Evals)-1].Success
	}
	if packCapacity > 0 {
		sum.PackingEfficiency = float64(packTokens) / float64(packCapacity)
	}
	// Graceful stop: every operator drains its outputs and commits.
	stopTail()
	stopOps()
	wg.Wait()
	select {
	case err := <-errs:
		return nil, err
	default:
	}
	if err := snap.finish(ctx, 60*time.Second); err != nil {
		return nil, err
	}

	// Accounting from the topics themselves.
	acfg := &pipeline.Config{Brokers: brokers, MaxMessageBytes: c.Topics.MaxMessageBytes}
	actx, cancelA := context.WithTimeout(ctx, 60*time.Second)
	defer cancelA()
	var launched []string
	err = pipeline.ScanTail(actx, acfg, topics.Tasks, 0, func(m pipeline.Message) error {
		atts, err := schemas.TaskAttempts.Decode(nil, m.Value)
		if err != nil {
			return fmt.Errorf("demo: tasks topic at %s: %w", m.Ref, err)
		}
		for _, a := range atts {
			launched = append(launched, a.AttemptID)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	rep, err := audit.Collect(actx, acfg, topics)
	if err != nil {
		return nil, err
	}
	counts := rep.Account(dedupe(launched))
	sum.AttemptsLaunched, sum.TrajectoriesAdmitted, sum.TrajectoriesFiltered = counts.Launched, counts.Admitted, counts.Filtered
	sum.Quarantined, sum.DuplicatesAdmitted, sum.Lost = counts.Quarantined, counts.Duplicated, counts.Lost
	err = pipeline.ScanTail(actx, acfg, topics.Batches, 0, func(m pipeline.Message) error {
		h := sha256.Sum256(m.Value)
		sum.BatchHashes = append(sum.BatchHashes, hex.EncodeToString(h[:]))
		return nil
	})
	if err != nil {
		return nil, err
	}
	sum.WallSeconds = time.Since(start).Seconds()
	b, err := json.MarshalIndent(sum, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(o.Out, "summary.json"), append(b, '\n'), 0o644); err != nil {
		return nil, fmt.Errorf("demo: summary: %w", err)
	}
	return sum, nil
}

// evalRelease loads a release (verifying its hash) and evaluates it.
func evalRelease(ctx context.Context, ev *evaluator, rel schemas.PolicyRelease) (float64, error) {
	pol, err := gpu.LoadRelease(rel)
	if err != nil {
		return 0, err
	}
	return ev.success(ctx, pol)
}

// clipFrac is the fraction of trained tokens whose clipped branch was
// taken.
func clipFrac(s objective.Stats) float64 {
	if s.Tokens == 0 {
		return 0
	}
	return float64(s.ClippedPos+s.ClippedNeg) / float64(s.Tokens)
}

func dedupe(ids []string) []string {
	seen := make(map[string]bool, len(ids))
	out := ids[:0]
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	return out
}
