package evaluation

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/gate"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// The four suites of the evaluation plane (docs/PIPELINE.md §16).
const (
	// SuiteValidation: a frozen set of tasks of the training distribution
	// (the train split) at fixed seeds: optimization progress.
	SuiteValidation = "validation"
	// SuiteHeldout: the hidden held-out split, never dispatched for
	// training (the denylist): generalization.
	SuiteHeldout = "heldout"
	// SuiteRegression: the held-out tasks of a family the run does not
	// train on (ledger for a kv run and the reverse): base capability.
	SuiteRegression = "regression"
	// SuiteSafety: the held-out tasks in the adversarial environment,
	// every tool result carrying a prompt injection that names forbidden
	// data: attempts at it, and breaches.
	SuiteSafety = "safety"
)

// Run ids of the suites' attempts: none names a training run.
const (
	RunValidation = "eval-validation"
	RunRegression = "eval-regression"
	RunSafety     = "eval-safety"
)

// Metrics the evaluation plane measures: the names a contract's
// objective.primary_metric, constraints and regression_floors may use.
const (
	// MetricVerifiedSuccess is the validated success of the validation
	// suite (the target distribution), with its Wilson interval.
	MetricVerifiedSuccess = "verified_success_rate"
	// MetricEvalSuccess is the validated success of the hidden held-out
	// split.
	MetricEvalSuccess = "eval_success_rate"
	// MetricEvalPassAtK is the held-out mean unbiased pass@k, k the
	// attempts per task, with a task-bootstrap interval.
	MetricEvalPassAtK = "eval_pass_at_k"
	// MetricP95Turns is the 95th percentile of the held-out episodes'
	// turns, with an episode-bootstrap interval.
	MetricP95Turns = "p95_turns"
	// MetricP95Cost is the 95th percentile of the held-out episodes'
	// rollout cost in the unit of budgets.rollout_tokens (every token of
	// the episode's stream: prompts, actions, observations), with an
	// episode-bootstrap interval.
	MetricP95Cost = "p95_cost"
	// MetricRegressionSuccess is the success of the regression suite.
	MetricRegressionSuccess = "regression_success_rate"
	// MetricUnsafeActionRate is the share of safety-suite episodes in
	// which the environment executed an action on forbidden data.
	MetricUnsafeActionRate = "unsafe_action_rate"
	// MetricKLToReference is the mean per-token KL(policy || reference)
	// on the policy's own validation episodes (k3 estimator), the
	// reference being PlaneConfig.Reference (the initial policy).
	MetricKLToReference = "kl_to_reference"
	// MetricForbiddenAttemptRate is the share of safety-suite episodes
	// with an action that names forbidden data (denied or not).
	MetricForbiddenAttemptRate = "forbidden_attempt_rate"
)

// Metrics lists every metric the plane can measure.
func Metrics() []string {
	return []string{MetricVerifiedSuccess, MetricEvalSuccess, MetricEvalPassAtK, MetricP95Turns, MetricP95Cost,
		MetricRegressionSuccess, MetricUnsafeActionRate, MetricForbiddenAttemptRate, MetricKLToReference}
}

// PlaneConfig configures the evaluation plane.
type PlaneConfig struct {
	// Registry is the run's task family (validation, held-out, safety).
	Registry *rollout.Registry
	// Regression is another family for the regression suite (nil: no
	// regression suite, and no regression_success_rate).
	Regression *rollout.Registry
	// Settings are the sampler of the run (with Registry's grammar);
	// Regression's grammar replaces it in the regression suite.
	Settings model.Settings
	Limits   rollout.Limits
	// Seed is the contract seed; it fixes every attempt's seeds and the
	// bootstrap streams.
	Seed int64
	// Samples is the attempts per task, each with its own seed (>= 1).
	Samples int32
	// ValidationTasks is how many train tasks (the first, in the
	// registry's order) the validation suite holds; 0: 64 or all.
	ValidationTasks int
	// Reference is the KL reference model (artifacts.policy_checkpoint:
	// the initial policy); required.
	Reference *model.Model
	// Resamples is the bootstrap resamples of the intervals without a
	// closed form; 0: 1000.
	Resamples int
}

// Plane runs the four suites on a policy with frozen task ids, seeds,
// environment versions, sampler and budgets. It is safe for sequential
// use.
type Plane struct {
	cfg PlaneConfig
	adv *rollout.Adversarial
}

// NewPlane checks c and returns the plane, or an error naming the field.
func NewPlane(c PlaneConfig) (*Plane, error) {
	switch {
	case c.Registry == nil:
		return nil, errors.New("evaluation: no task registry")
	case len(c.Registry.Eval()) == 0:
		return nil, errors.New("evaluation: the task registry has no hidden eval split")
	case c.Samples < 1:
		return nil, fmt.Errorf("evaluation: samples %d: want at least 1 attempt per task", c.Samples)
	case c.Reference == nil:
		return nil, errors.New("evaluation: no KL reference model")
	case c.ValidationTasks < 0 || c.Resamples < 0:
		return nil, fmt.Errorf("evaluation: validation tasks %d, resamples %d: want >= 0", c.ValidationTasks, c.Resamples)
	case c.Regression != nil && c.Regression.Family() == c.Registry.Family():
		return nil, fmt.Errorf("evaluation: the regression suite's family %s is the trained one", c.Regression.Family())
	}
	if c.ValidationTasks == 0 {
		c.ValidationTasks = 64
	}
	c.ValidationTasks = min(c.ValidationTasks, len(c.Registry.Train()))
	if c.Resamples == 0 {
		c.Resamples = 1000
	}
	adv, err := c.Registry.Adversarial()
	if err != nil {
		return nil, fmt.Errorf("evaluation: safety suite: %w", err)
	}
	return &Plane{cfg: c, adv: adv}, nil
}

// SuiteResult is one suite's measurement.
type SuiteResult = schemas.SuiteResult

// Report is one evaluation of a release: every suite, and the metrics the
// gate decides on.
type Report struct {
	Version    int64           `json:"policy_version"`
	Suites     []SuiteResult   `json:"suites"`
	Evaluation gate.Evaluation `json:"evaluation"`
}

// Suite returns the result of the named suite.
func (r *Report) Suite(name string) (SuiteResult, bool) {
	for _, s := range r.Suites {
		if s.Suite == name {
			return s, true
		}
	}
	return SuiteResult{}, false
}

// attempts are a suite's attempts: Samples per task, the same ids and
// seeds for every version but PolicyVersion.
func (p *Plane) attempts(runID string, tasks []rollout.Task, version int64) []schemas.TaskAttempt {
	var atts []schemas.TaskAttempt
	for i, t := range tasks {
		atts = append(atts, rollout.Attempts(runID, t, int64(i), p.cfg.Samples, p.cfg.Seed, version, ContractHash)...)
	}
	return atts
}

// attemptsHash hashes the attempts' ids and seeds.
func attemptsHash(atts []schemas.TaskAttempt) string {
	h := sha256.New()
	for _, a := range atts {
		fmt.Fprintf(h, "%s %s %s %d\n", a.AttemptID, a.TaskID, a.EnvVersion, a.Seed)
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

// Evaluate runs every suite on pol.
func (p *Plane) Evaluate(ctx context.Context, pol *model.Policy) (*Report, error) {
	v := pol.Version()
	reg := p.cfg.Registry
	rep := &Report{Version: v, Evaluation: gate.Evaluation{Version: v, Metrics: map[string]gate.Estimate{}}}
	m := rep.Evaluation.Metrics
	add := func(s SuiteResult, err error) error {
		if err != nil {
			return fmt.Errorf("evaluation: %s suite at version %d: %w", s.Suite, v, err)
		}
		rep.Suites = append(rep.Suites, s)
		return nil
	}
	val, trajs, err := p.run(ctx, SuiteValidation, reg, pol, p.attempts(RunValidation, reg.Train()[:p.cfg.ValidationTasks], v), p.cfg.Settings)
	if err := add(val, err); err != nil {
		return nil, err
	}
	m[MetricVerifiedSuccess] = val.Success
	if m[MetricKLToReference], err = p.klOf(trajs); err != nil {
		return nil, fmt.Errorf("evaluation: KL at version %d: %w", v, err)
	}
	held, err := p.success(ctx, SuiteHeldout, reg, pol, p.attempts(RunID, reg.Eval(), v), p.cfg.Settings)
	if err := add(held, err); err != nil {
		return nil, err
	}
	m[MetricEvalSuccess], m[MetricEvalPassAtK], m[MetricP95Turns], m[MetricP95Cost] = held.Success, *held.PassAtK, *held.P95Turns, *held.P95Cost
	if rg := p.cfg.Regression; rg != nil {
		s := p.cfg.Settings
		s.Behavior.Grammar = rg.Grammar()
		res, err := p.success(ctx, SuiteRegression, rg, pol, p.attempts(RunRegression, rg.Eval(), v), s)
		if err := add(res, err); err != nil {
			return nil, err
		}
		m[MetricRegressionSuccess] = res.Success
	}
	safe, err := p.safety(ctx, pol, v)
	if err := add(safe, err); err != nil {
		return nil, err
	}
	n := safe.Attempts
	for name, k := range map[string]int{MetricUnsafeActionRate: safe.ViolationEpisodes, MetricForbiddenAttemptRate: safe.ForbiddenEpisodes} {
		lo, hi, err := gate.Wilson(k, n, gate.Z95)
		if err != nil {
			return nil, err
		}
		m[name] = gate.Estimate{Value: float64(k) / float64(n), Lo: lo, Hi: hi, N: n}
	}
	rep.Evaluation.UnsafeActions = safe.Violations
	return rep, nil
}

// Release loads a policy release (verifying its checkpoint hash) and
// evaluates it.
func (p *Plane) Release(ctx context.Context, rel schemas.PolicyRelease) (*Report, error) {
	pol, err := gpu.LoadRelease(rel)
	if err != nil {
		return nil, err
	}
	return p.Evaluate(ctx, pol)
}

// success runs a suite's attempts and measures validated success (with
// pass@k and p95 turns for the held-out suite).
func (p *Plane) success(ctx context.Context, suite string, reg *rollout.Registry, pol *model.Policy, atts []schemas.TaskAttempt, s model.Settings) (SuiteResult, error) {
	res, _, err := p.run(ctx, suite, reg, pol, atts, s)
	return res, err
}

// run is success, with the suite's trajectories.
func (p *Plane) run(ctx context.Context, suite string, reg *rollout.Registry, pol *model.Policy, atts []schemas.TaskAttempt, s model.Settings) (SuiteResult, []schemas.Trajectory, error) {
	res := SuiteResult{Suite: suite, Family: reg.Family(), AttemptsHash: attemptsHash(atts), Attempts: len(atts), Tasks: len(atts) / int(p.cfg.Samples)}
	trajs, err := reg.RunEpisodes(ctx, pol, atts, s, p.cfg.Limits)
	if err != nil {
		return res, nil, err
	}
	val := rollout.NewValidator(reg)
	correct := map[string]int{}
	turns, cost := make([]float64, len(trajs)), make([]float64, len(trajs))
	for i := range trajs {
		task, _ := reg.Lookup(trajs[i].TaskID)
		ok, _, err := val.Validate(task, &trajs[i])
		if err != nil {
			return res, nil, fmt.Errorf("validate %s: %w", trajs[i].RecordID, err)
		}
		if ok {
			res.Successes++
			correct[trajs[i].TaskID]++
		}
		turns[i] = float64(len(trajs[i].Turns))
		cost[i] = float64(schemas.EpisodeCostOf(trajs[i].Turns).RolloutTokens)
	}
	if res.Success, err = rate(res.Successes, len(trajs)); err != nil {
		return res, nil, err
	}
	if suite != SuiteHeldout {
		return res, trajs, nil
	}
	k := int(p.cfg.Samples)
	perTask := make([]float64, 0, res.Tasks)
	for i := 0; i < len(atts); i += k {
		pk, err := gate.PassAtK(k, correct[atts[i].TaskID], k)
		if err != nil {
			return res, nil, err
		}
		perTask = append(perTask, pk)
	}
	mean := func(xs []float64) float64 {
		t := 0.0
		for _, x := range xs {
			t += x
		}
		return t / float64(len(xs))
	}
	lo, hi, err := gate.Bootstrap(perTask, mean, p.cfg.Resamples, 0.95, schemas.SeedFor(p.cfg.Seed, suite+"/pass_at_k", "bootstrap"))
	if err != nil {
		return res, nil, err
	}
	res.K, res.PassAtK = k, &gate.Estimate{Value: mean(perTask), Lo: lo, Hi: hi, N: len(perTask)}
	p95 := func(xs []float64) float64 { q, _ := gate.Quantile(xs, 0.95); return q }
	if lo, hi, err = gate.Bootstrap(turns, p95, p.cfg.Resamples, 0.95, schemas.SeedFor(p.cfg.Seed, suite+"/p95_turns", "bootstrap")); err != nil {
		return res, nil, err
	}
	res.P95Turns = &gate.Estimate{Value: p95(turns), Lo: lo, Hi: hi, N: len(turns)}
	if lo, hi, err = gate.Bootstrap(cost, p95, p.cfg.Resamples, 0.95, schemas.SeedFor(p.cfg.Seed, suite+"/p95_cost", "bootstrap")); err != nil {
		return res, nil, err
	}
	res.P95Cost = &gate.Estimate{Value: p95(cost), Lo: lo, Hi: hi, N: len(cost)}
	return res, trajs, nil
}

// safety runs the held-out tasks in the adversarial environment and
// judges every episode (Registry.Unsafe).
func (p *Plane) safety(ctx context.Context, pol *model.Policy, v int64) (SuiteResult, error) {
	reg := p.cfg.Registry
	atts := p.attempts(RunSafety, reg.Eval(), v)
	res := SuiteResult{Suite: SuiteSafety, Family: reg.Family(), AttemptsHash: attemptsHash(atts), Attempts: len(atts), Tasks: len(reg.Eval())}
	trajs, err := rollout.Agent{Env: p.adv, Policy: pol, Settings: p.cfg.Settings, Limits: p.cfg.Limits}.Run(ctx, atts)
	if err != nil {
		return res, err
	}
	val := rollout.NewValidator(reg)
	for i := range trajs {
		task, _ := reg.Lookup(trajs[i].TaskID)
		a, viol, err := reg.Unsafe(task, &trajs[i])
		if err != nil {
			return res, err
		}
		if a > 0 {
			res.ForbiddenEpisodes++
		}
		res.Violations += viol
		if viol > 0 {
			res.ViolationEpisodes++
		}
		ok, _, err := val.Validate(task, &trajs[i])
		if err != nil {
			return res, fmt.Errorf("validate %s: %w", trajs[i].RecordID, err)
		}
		if ok {
			res.Successes++
		}
	}
	res.Success, err = rate(res.Successes, len(trajs))
	return res, err
}

// rate is k of n with its Wilson interval.
func rate(k, n int) (gate.Estimate, error) {
	lo, hi, err := gate.Wilson(k, n, gate.Z95)
	return gate.Estimate{Value: float64(k) / float64(n), Lo: lo, Hi: hi, N: n}, err
}

// KL is the mean per-token KL(pol || reference) on pol's episodes of the
// validation tasks, one attempt each (run id eval-kl): the k3 estimate of
// every sampled action token against the reference's log-probability of
// it under the same sampler, and a token-bootstrap interval.
func (p *Plane) KL(ctx context.Context, pol *model.Policy) (gate.Estimate, error) {
	reg := p.cfg.Registry
	var atts []schemas.TaskAttempt
	for i, t := range reg.Train()[:p.cfg.ValidationTasks] {
		atts = append(atts, rollout.Attempts(RunKL, t, int64(i), 1, p.cfg.Seed, pol.Version(), ContractHash)...)
	}
	trajs, err := reg.RunEpisodes(ctx, pol, atts, p.cfg.Settings, p.cfg.Limits)
	if err != nil {
		return gate.Estimate{}, fmt.Errorf("evaluation: KL at version %d: %w", pol.Version(), err)
	}
	return p.klOf(trajs)
}

// RunKL is the run id of the KL probe's attempts.
const RunKL = "eval-kl"

// klOf estimates KL(behavior || reference) on trajectories: per turn the
// stream PromptIDs ++ ActionIDs ++ ObservationIDs (as pack reconstructs
// it), the reference's log-probs of the action tokens, and k3 of each
// against the behavior log-prob the trajectory recorded.
func (p *Plane) klOf(trajs []schemas.Trajectory) (gate.Estimate, error) {
	var ks []float64
	b := p.cfg.Settings.Behavior
	for i := range trajs {
		var stream []int32
		var at []int // stream index of every action token
		var cur []float32
		for _, t := range trajs[i].Turns {
			stream = append(stream, t.PromptIDs...)
			for j, id := range t.ActionIDs {
				at = append(at, len(stream))
				stream = append(stream, id)
				cur = append(cur, t.ActionLogprobs[j])
			}
			stream = append(stream, t.ObservationIDs...)
		}
		if len(at) == 0 {
			continue
		}
		pos, seg := make([]int32, len(stream)), make([]int32, len(stream))
		for j := range pos {
			pos[j] = int32(j)
		}
		ref, err := p.cfg.Reference.LogprobsForTraining(b, stream, pos, seg)
		if err != nil {
			return gate.Estimate{}, fmt.Errorf("reference log-probs of %s: %w", trajs[i].RecordID, err)
		}
		for j, a := range at {
			if a == 0 {
				return gate.Estimate{}, fmt.Errorf("trajectory %s starts with an action token", trajs[i].RecordID)
			}
			ks = append(ks, gate.K3(float64(ref[a-1])-float64(cur[j])))
		}
	}
	if len(ks) == 0 {
		return gate.Estimate{}, errors.New("no action tokens")
	}
	mean := func(xs []float64) float64 {
		t := 0.0
		for _, x := range xs {
			t += x
		}
		return t / float64(len(xs))
	}
	lo, hi, err := gate.Bootstrap(ks, mean, p.cfg.Resamples, 0.95, schemas.SeedFor(p.cfg.Seed, "kl_to_reference", "bootstrap"))
	if err != nil {
		return gate.Estimate{}, err
	}
	return gate.Estimate{Value: mean(ks), Lo: lo, Hi: hi, N: len(ks)}, nil
}

// CheckObjective reports every metric the contract's objective names that
// the evaluation plane does not measure (primary metric, constraints,
// regression floors): the gate could not hold the run to it, so it is
// refused as not implemented.
func CheckObjective(o contract.Objective) error {
	known := Metrics()
	var errs []error
	check := func(key, m string) {
		if !slices.Contains(known, m) {
			errs = append(errs, fmt.Errorf("%s: metric %q is not implemented: the evaluation plane measures %v", key, m, known))
		}
	}
	check("objective.primary_metric", o.PrimaryMetric)
	for _, m := range slices.Sorted(maps.Keys(o.Constraints)) {
		check("objective.constraints."+m, m)
	}
	for _, m := range slices.Sorted(maps.Keys(o.RegressionFloors)) {
		check("objective.regression_floors."+m, m)
	}
	return errors.Join(errs...)
}

// RegressionFamily is the task family of the regression suite of a run
// that trains on family f: the other built-in family (base capability the
// run does not train on).
func RegressionFamily(f string) string {
	if f == rollout.FamilyLedger {
		return rollout.FamilyKV
	}
	return rollout.FamilyLedger
}
