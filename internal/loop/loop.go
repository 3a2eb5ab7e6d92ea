// Package loop runs the RL loop of `trajflow demo` end to end: the
// embedded broker (or an existing cluster), every operator of the loop as
// its own Kafka consumer group, the Parquet snapshot of every topic, the
// hidden evaluation at the start, every few updates and at the end, and
// the accounting of every attempt read back from the topics. Run prints
// one line per update and returns (and writes) the run's summary.
package loop

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/internal/evaluation"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// Stages are the operators of the RL loop, in pipeline order.
var Stages = []string{"dispatch", "rollout", "validate", "reward", "advantage", "pack", "train"}

// Options configure one run of the loop.
type Options struct {
	Updates int      // update rounds dispatched (>= 1)
	Out     string   // output directory (summary.json, releases/, demo.log, snapshots)
	Seed    int64    // contract seed (also seeds the initial weights)
	Brokers []string // external cluster; empty starts the embedded broker
	RunID   string   // run id (topic prefix); default the contract's
	Async   bool     // asynchronous mode with MaxLag
	MaxLag  int64
	// OffPolicy and ISCap override the contract's loss.off_policy and
	// loss.is_cap when OffPolicy is set.
	OffPolicy   string
	ISCap       float64
	EvalSamples int32 // attempts per hidden-eval task (>= 1)
	EvalEvery   int   // 0: the contract's dispatch.eval_every
	Quiet       bool  // no per-update lines
	// NoGate runs without the evaluation plane and the gate: no
	// evaluation, no decision, dispatch never waits for one, and every
	// release is trained on (what a fleet without eval and gate operators
	// does). The batches are those of the gated run until its first
	// rollback or stop.
	NoGate bool
	// Env lists the `trajflow serve env` services the rollout stage runs
	// its episodes against (empty: the registry in process); EnvKeyFile
	// is their capability key file (operators.DialEnv).
	Env        []string
	EnvKeyFile string
	// Environment is the contract's artifacts.environment (default the
	// demo's kv environment); rollout.ArtifactLedger runs the ledger
	// family with its validator as the reward (see Contract).
	Environment string
	// ToolRetries and ToolTimeoutMS, when > 0, replace the contract's
	// sampler.tool_retries and sampler.tool_timeout_ms.
	ToolRetries   int
	ToolTimeoutMS int64
	// Latency, when set, is the contract's latency section (the simulated
	// latency of the built-in environment and policy).
	Latency *contract.Latency
	// RolloutWorkers is how many rollout operators share the tasks topic
	// (default 1); the topics get at least that many partitions.
	RolloutWorkers int
	// PartialRollouts and StalePolicy, when set, replace the contract's
	// dispatch.partial_rollouts and packing.stale_policy.
	PartialRollouts string
	StalePolicy     string
	// Policy is where rollout generates: the zero value is the built-in
	// policy in process; a server protocol with endpoints (ParsePolicy)
	// runs rollout on those replicas through a gateway, with weight sync
	// in the loop loading every release into them (they read it from
	// Out/releases).
	Policy contract.Policy
	// Tasks is the built-in task family: TasksKV (default) or TasksText
	// (a language model on a llama.cpp server; needs NoTrain).
	Tasks string
	// NoTrain leaves the train stage out (the built-in trainer cannot
	// train a server's language model): the loop publishes release 0
	// itself, dispatch closes a round once pack decided all its groups,
	// and the run ends when every round is decided.
	NoTrain bool
	// Trainer is who trains: TrainerBuiltin ("" too: the Go train stage
	// in the loop) or TrainerExternal (a trainer outside the loop, such as
	// `python -m trajflow.train`, consumes the batches topic and publishes
	// every release, release 0 included, on the policy topic; the loop
	// writes what it needs to OUT/trainer.json, waits for its releases as
	// for the built-in trainer's, and ends after Updates releases).
	Trainer string
	// StopTokenIDs, when set, are the sampler's stop ids (for TasksText
	// the loop asks the server's chat template when unset).
	StopTokenIDs []int32
	// PolicyTrace sees every call of rollout's policy server clients.
	PolicyTrace func(method, path string, req []byte, status int, resp []byte)
	// Edit, when set, changes the contract before it is resolved (a
	// test's smaller run).
	Edit func(c *contract.Contract)
	// Metrics, when set, collects the metrics of every operator of the
	// run (`trajflow demo --health ADDR` serves them); nil: each operator
	// keeps its own, unexposed.
	Metrics *pipeline.Metrics
	// Base, when set, is the contract the run starts from instead of the
	// demo contract (`trajflow demo --contract FILE`); the options above
	// that are set still replace its fields.
	Base *contract.Contract
}

// Update is one line of the loop's output.
type Update struct {
	Update      int64    `json:"update"` // policy version produced
	BatchID     string   `json:"batch_id"`
	Success     float64  `json:"success"` // verified success of the update's rollouts
	Reward      float64  `json:"reward"`
	KL          float64  `json:"kl"` // approx KL(behavior || current) at the update's last optimizer step
	ClipFrac    float64  `json:"clip_frac"`
	Entropy     float64  `json:"entropy"` // mean per trained token at the update's first optimizer step
	Lag         int64    `json:"lag"`     // largest policy lag among the batch's tokens
	Tokens      int64    `json:"tokens"`
	TokensPerS  float64  `json:"tokens_per_s"`
	Packing     float64  `json:"packing_efficiency"`
	EvalSuccess *float64 `json:"eval_success,omitempty"`
	// KLRef is the mean per-token KL of the release to the reference
	// policy (evaluation.Plane.KL); Decision the gate's action on it.
	KLRef    float64 `json:"kl_ref"`
	Decision string  `json:"decision,omitempty"`
}

// Eval is one hidden-eval measurement.
type Eval struct {
	Version int64   `json:"policy_version"`
	Success float64 `json:"success"`
}

// Summary is OUT/summary.json.
type Summary struct {
	RunID        string `json:"run_id"`
	ContractHash string `json:"contract_hash"`
	Seed         int64  `json:"seed"`
	Mode         string `json:"mode"`
	// Rounds are the rounds dispatched: all those asked for, or those
	// launched before a stop (StoppedBy names the rule).
	Rounds               int     `json:"rounds"`
	StoppedBy            string  `json:"stopped_by,omitempty"`
	Updates              int     `json:"updates"` // policy updates trained
	EvalSuccessInitial   float64 `json:"eval_success_initial"`
	EvalSuccessFinal     float64 `json:"eval_success_final"`
	Evals                []Eval  `json:"evals"`
	AttemptsLaunched     int     `json:"attempts_launched"`
	TrajectoriesAdmitted int     `json:"trajectories_admitted"`
	TrajectoriesFiltered int     `json:"trajectories_filtered"`
	// TrajectoriesExcluded were admitted to a batch and not trained: the
	// trainer's lag rule took every token out (census filtered,
	// stale_at_update).
	TrajectoriesExcluded int `json:"trajectories_excluded"`
	// GeneratedTokens are the policy-sampled tokens of every recorded
	// trajectory; StaleTokens those the lag rule took out of training (at
	// pack or at the update); StaleShare = StaleTokens / GeneratedTokens.
	GeneratedTokens    int64   `json:"generated_tokens"`
	StaleTokens        int64   `json:"stale_tokens"`
	StaleShare         float64 `json:"stale_share"`
	Quarantined        int     `json:"quarantined"`
	DuplicatesAdmitted int     `json:"duplicates_admitted"`
	Lost               int     `json:"lost"`
	// AttemptsRetried counts the launched attempts that failed for the
	// infrastructure and were run again (accounted by their retry).
	AttemptsRetried   int      `json:"attempts_retried,omitempty"`
	PackingEfficiency float64  `json:"packing_efficiency"`
	MaxLagSeen        int64    `json:"max_lag_seen"`
	BatchHashes       []string `json:"batch_hashes"`
	PerUpdate         []Update `json:"per_update"`
	WallSeconds       float64  `json:"wall_seconds"`
	// ReleaseSeconds[v-1] is when version v was released, in seconds since
	// the operators started (ReleaseTokens the tokens trained by then);
	// TrainedTokens the tokens the updates trained and LagTokens the same
	// by lag at the update.
	ReleaseSeconds []float64          `json:"release_seconds"`
	ReleaseTokens  []int64            `json:"release_trained_tokens"` // cumulative trained tokens at each release
	TrainedTokens  int64              `json:"trained_tokens"`
	LagTokens      []schemas.LagCount `json:"lag_tokens"`
	// InfraRetries counts the tries that failed for a reason of the
	// infrastructure (a policy server or environment service down, slow,
	// or answering garbage) and were run again, by census reason; never
	// task failures.
	InfraRetries map[string]int `json:"infra_retries,omitempty"`
	// Cost is the run's cost ledger: the sum of its update records' (the
	// rollout, rejected and training accounts, docs/SYSTEMS.md §17).
	Cost schemas.UpdateCost `json:"cost"`
	// Env is the accounting of the environment services (with Options.Env).
	Env *EnvSummary `json:"env,omitempty"`
	// Gate holds the gate's decisions, the promoted release, the
	// evaluations with their confidence intervals, and the budgets spent
	// (absent when the policy is not the built-in one).
	Gate *GateSummary `json:"gate,omitempty"`
}

// SummaryFile is the name of the summary in the output directory.
const SummaryFile = "summary.json"

// ErrRunUsed is returned when the run id already has records on the
// cluster: record ids are deterministic, so a second run under the same id
// would be deduplicated against the first.
var ErrRunUsed = errors.New("loop: run id already used on this cluster")

// Contract is the demo contract (contract.Default) for o.
func Contract(o Options) (*contract.Contract, error) {
	c := contract.Default()
	if o.Base != nil {
		c = o.Base.Clone()
	}
	c.Seed = o.Seed
	if o.RunID != "" {
		c.RunID = o.RunID
	}
	if o.Async {
		c.Dispatch.Mode = contract.DispatchAsync
		c.Packing.MaxLag = o.MaxLag
	}
	if o.OffPolicy != "" {
		c.Loss.OffPolicy, c.Loss.ISCap = o.OffPolicy, o.ISCap
	}
	if o.Latency != nil {
		c.Latency = *o.Latency
	}
	c.Topics.Partitions = max(c.Topics.Partitions, o.RolloutWorkers)
	if o.PartialRollouts != "" {
		c.Dispatch.PartialRollouts = o.PartialRollouts
	}
	if o.StalePolicy != "" {
		c.Packing.StalePolicy = o.StalePolicy
	}
	if err := environment(c, o); err != nil {
		return nil, err
	}
	applyPolicy(c, o)
	if o.Edit != nil {
		o.Edit(c)
	}
	// The overrides may leave keys of the base contract unused (its clip
	// bounds under an off_policy of tis): they take their defaults, as if
	// the base had left them out.
	c.DropUnused()
	if err := c.Resolve(); err != nil {
		return nil, err
	}
	return c, nil
}

// runner is one run of the loop.
type runner struct {
	o       Options
	stdout  io.Writer
	start   time.Time
	c       *contract.Contract
	topics  pipeline.Topics
	deps    operators.Deps
	files   *pipeline.DirReleases
	brokers []string
	// dialer and transport carry the TLS/SASL settings of a report's
	// cluster (FleetReport); the demo's plaintext brokers have no dialer
	// (kafka-go's default) and the run's own transport (ownTransport).
	dialer    *kafkago.Dialer
	transport *kafkago.Transport
	log       *slog.Logger
	g         *gating
	evalEvery int
	sum       *Summary
	closers   []func() error
	opsStart  time.Time // when the operators started
}

// Run runs the loop and returns its summary (also written to
// OUT/summary.json).
func Run(ctx context.Context, o Options, stdout io.Writer) (*Summary, error) {
	if o.Updates < 1 || o.EvalSamples < 1 {
		return nil, fmt.Errorf("loop: updates %d and eval samples %d must be positive", o.Updates, o.EvalSamples)
	}
	if o.RolloutWorkers > 1 && len(o.Env) > 0 {
		return nil, fmt.Errorf("loop: %d rollout workers with environment services: one rollout stage per client", o.RolloutWorkers)
	}
	if err := o.check(); err != nil {
		return nil, err
	}
	r := &runner{o: o, stdout: stdout, start: time.Now()}
	defer r.close()
	r.ownTransport()
	if err := r.prepare(ctx); err != nil {
		return nil, err
	}
	if err := r.evalInitial(ctx); err != nil {
		return nil, err
	}
	ops, err := r.startOperators()
	if err != nil {
		return nil, err
	}
	defer ops.stop()
	snap, err := r.startSnapshot()
	if err != nil {
		return nil, err
	}
	defer snap.stop()
	if err := r.follow(ctx, ops.errs); err != nil {
		return nil, err
	}
	// Graceful stop: every operator drains its outputs and commits.
	if err := ops.stop(); err != nil {
		return nil, err
	}
	if err := snap.finish(ctx, 60*time.Second); err != nil {
		return nil, err
	}
	if err := r.account(ctx); err != nil {
		return nil, err
	}
	r.printEnv()
	return r.sum, r.writeSummary()
}

// ownTransport gives the run one kafka-go transport, shared by the
// runner's writers and readers and closed after everything else: not
// kafka-go's DefaultTransport, whose connection pools outlive their
// writers and keep dialing the brokers' addresses after the run. In a
// process that runs more (tests, a notebook) those dials reach whatever
// listens there next, and a reply that is not Kafka's (a ZeroMQ greeting
// read as a negative size) panics in kafka-go's own goroutine.
func (r *runner) ownTransport() {
	tr := &kafkago.Transport{Dial: kafka.ProbingDial, MetadataTTL: kafka.MetadataTTL}
	r.transport = tr
	r.closers = append(r.closers, func() error { tr.CloseIdleConnections(); return nil })
}

// close runs the cleanups of prepare in reverse order.
func (r *runner) close() {
	for i := len(r.closers) - 1; i >= 0; i-- {
		_ = r.closers[i]()
	}
}

// prepare resolves the contract, clears the output directory of an
// earlier run, opens the log, starts the broker (unless o.Brokers), creates
// the run's topics and builds the stages' dependencies and the evaluator.
func (r *runner) prepare(ctx context.Context) error {
	if r.o.Tasks == TasksText && r.o.StopTokenIDs == nil {
		stops, err := textStops(ctx, r.o)
		if err != nil {
			return err
		}
		r.o.StopTokenIDs = stops
	}
	c, err := Contract(r.o)
	if err != nil {
		return err
	}
	r.c = c
	if err := r.prepareOut(); err != nil {
		return err
	}
	if r.deps, err = operators.BuiltinDeps(c); err != nil {
		return err
	}
	if err := r.dialEnv(ctx); err != nil {
		return err
	}
	r.topics = r.deps.Topics
	if err := r.connect(ctx); err != nil {
		return err
	}
	r.deps.ReleaseDir, r.deps.Rounds = filepath.Join(r.o.Out, "releases"), int64(r.o.Updates)
	r.deps.PartialGroupTimeout = 30 * time.Second // only matters if a member is lost to quarantine
	r.deps.NoTrain, r.deps.PolicyTrace = r.o.NoTrain, r.o.PolicyTrace
	if r.files, err = pipeline.NewDirReleases(r.deps.ReleaseDir); err != nil {
		return err
	}
	if err := r.servedVocab(ctx); err != nil {
		return err
	}
	if err := r.publishInitial(ctx); err != nil {
		return err
	}
	if err := r.writeTrainerInfo(); err != nil {
		return err
	}
	r.sum = &Summary{RunID: c.RunID, ContractHash: c.Hash(), Seed: c.Seed, Mode: c.Dispatch.Mode, Rounds: r.o.Updates}
	if r.o.Tasks != TasksText && !r.o.NoGate { // the evaluation plane runs the built-in policy in process
		if err := r.prepareGate(r.deps.Tasks); err != nil {
			return err
		}
	}
	r.evalEvery = r.o.EvalEvery
	if r.evalEvery <= 0 {
		r.evalEvery = c.Dispatch.EvalEvery
	}
	return nil
}

// prepareOut creates the output directory, removes the releases and
// operator state of an earlier run in it (a demo is a new run: the
// operators' local state remembers record ids, which are deterministic)
// and opens the operators' log.
func (r *runner) prepareOut() error {
	if err := os.MkdirAll(r.o.Out, 0o755); err != nil {
		return fmt.Errorf("demo: output directory: %w", err)
	}
	for _, d := range []string{filepath.Join(r.o.Out, "releases"), filepath.Join(r.o.Out, "state")} {
		if err := os.RemoveAll(d); err != nil {
			return fmt.Errorf("demo: clear %s: %w", d, err)
		}
	}
	logf, err := os.Create(filepath.Join(r.o.Out, "demo.log"))
	if err != nil {
		return fmt.Errorf("demo: log: %w", err)
	}
	r.closers = append(r.closers, logf.Close)
	r.log = slog.New(slog.NewTextHandler(logf, &slog.HandlerOptions{Level: slog.LevelInfo})).With("run", r.c.RunID)
	return nil
}

// connect starts the embedded broker unless brokers were given, creates
// the run's topics, and on an external cluster refuses a run id that
// already has records.
func (r *runner) connect(ctx context.Context) error {
	r.brokers = r.o.Brokers
	if len(r.brokers) == 0 {
		b, err := kafka.StartBroker(ctx, kafka.BrokerConfig{Logger: r.log})
		if err != nil {
			return err
		}
		r.closers = append(r.closers, b.Close)
		r.brokers = []string{b.Addr()}
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := kafka.CreateTopics(cctx, kafka.ClientConfig{}, r.brokers, operators.TopicSpecs(r.c, r.topics)); err != nil {
		return err
	}
	if len(r.o.Brokers) == 0 {
		return nil
	}
	used := false
	err := pipeline.ScanTail(cctx, &pipeline.Config{Brokers: r.brokers}, r.topics.Tasks, 1, func(pipeline.Message) error {
		used = true
		return nil
	})
	if err == nil && used {
		err = fmt.Errorf("%w: run %q already has records on %s; pick another --run", ErrRunUsed, r.c.RunID, r.topics.Tasks)
	}
	return err
}

// evalInitial evaluates the initial policy, exactly as the trainer will
// publish it, and prints the header.
func (r *runner) evalInitial(ctx context.Context) error {
	if r.g == nil {
		if !r.o.Quiet {
			c := r.c
			fmt.Fprintf(r.stdout, "trajflow demo: run %s, seed %d, %s tasks, %d rounds of %d groups x %d attempts; operators %v on %v; %s\n",
				c.RunID, c.Seed, r.o.Tasks, r.o.Updates, c.Dispatch.GroupsPerUpdate, c.Sampler.GroupSize, r.stages(), r.brokers, r.policyNote())
			if r.o.NoGate {
				fmt.Fprintln(r.stdout, "evaluation and gate: off (--no-gate): every release is trained on")
			} else {
				fmt.Fprintln(r.stdout, "hidden eval: not run (it runs the built-in policy in process; these tasks need the server's model)")
			}
		}
		return nil
	}
	mc, mseed := operators.ModelConfig(r.c)
	m0, err := gpu.InitialModel(mc, mseed)
	if err != nil {
		return err
	}
	rep, err := r.judgeInitial(ctx, m0)
	if err != nil {
		return err
	}
	s := rep.Evaluation.Metrics[evaluation.MetricEvalSuccess].Value
	r.sum.EvalSuccessInitial = s
	r.sum.Evals = append(r.sum.Evals, Eval{0, s})
	if r.o.Quiet {
		return nil
	}
	c := r.c
	fmt.Fprintf(r.stdout, "trajflow demo: run %s, seed %d, %s mode, %d rounds of %d groups x %d attempts; operators %v on %v; %s\n",
		c.RunID, c.Seed, c.Dispatch.Mode, r.o.Updates, c.Dispatch.GroupsPerUpdate, c.Sampler.GroupSize, r.stages(), r.brokers, r.policyNote())
	fmt.Fprintf(r.stdout, "evaluation at version 0 (%d attempts per task, fixed seeds):%s\n", r.o.EvalSamples, suitesLine(rep))
	fmt.Fprintln(r.stdout, "update  success  reward      kl    clip  entropy  lag  tokens/s  packing  kl_ref  eval")
	return nil
}

// writeSummary writes OUT/summary.json.
func (r *runner) writeSummary() error {
	r.sum.WallSeconds = time.Since(r.start).Seconds()
	b, err := json.MarshalIndent(r.sum, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(r.o.Out, SummaryFile), append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("demo: summary: %w", err)
	}
	return nil
}
