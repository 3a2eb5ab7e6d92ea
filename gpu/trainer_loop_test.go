package gpu

import (
	"context"
	"fmt"
	"testing"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// loopConfig is the in-process synchronous loop of docs/PIPELINE.md §19 with the
// real stage functions: rollout -> reward (trusted validator) -> advantage
// (GRPO) -> pack window -> trainer step.
type loopConfig struct {
	Registry      rollout.RegistryConfig
	Model         model.Config
	ModelSeed     uint64
	ContractSeed  int64
	Settings      model.Settings // Grammar is set from the registry
	Limits        rollout.Limits
	GroupSize     int32
	TasksPerStep  int
	Updates       int
	EvalEvery     int
	EvalSamples   int32 // attempts per eval task
	Adam          AdamOptions
	Objective     objective.Options
	Advantage     advantage.Options
	Pack          pack.Options
	Epochs        int     // optimizer steps per packed batch (PPO epochs; 0 means 1)
	StopAtSuccess float64 // stop early once eval success reaches this (0 = never)
}

// demoLoopConfig is the tuned configuration of the demo.
func demoLoopConfig() loopConfig {
	reg := rollout.DefaultRegistryConfig()
	return loopConfig{
		Registry:     reg,
		Model:        model.Config{Vocab: rollout.VocabSize, Window: 12, Embed: 16, Hidden: 64},
		ModelSeed:    1,
		ContractSeed: 1,
		Settings:     model.Settings{Behavior: model.Behavior{Temperature: 1}, MaxTokens: 3, Stop: []int32{rollout.TokEnd}}, // = rollout.DefaultSettings
		Limits:       rollout.DefaultLimits(),
		GroupSize:    16,
		TasksPerStep: 16,
		Updates:      80,
		Epochs:       2,
		EvalEvery:    5,
		EvalSamples:  2,
		Adam:         DefaultAdam(),
		Objective:    DefaultObjective(),
		Advantage: advantage.Options{Estimator: advantage.GRPO, NormalizeStd: true, StdMode: advantage.StdPopulation,
			Epsilon: 1e-6, Gamma: 1, ZeroVariance: advantage.ZeroVarDrop, MinGroupSize: 1},
		Pack: pack.Options{TokenBudget: 256, BatchTokens: 1 << 30, Overflow: pack.OverflowReject,
			MaxLag: 0, StalePolicy: pack.StaleDrop},
	}
}

type loopPoint struct {
	Update      int
	EvalSuccess float64
	Train       float64 // success of the rollouts of this update
	Metrics     Metrics
}

type harness struct {
	cfg   loopConfig
	reg   *rollout.Registry
	rwd   *reward.Registry
	comps []reward.Component
	tr    *Trainer
	runID string
}

func newHarness(t testing.TB, cfg loopConfig) *harness {
	t.Helper()
	reg, err := rollout.NewRegistry(cfg.Registry)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Settings.Grammar = reg.Grammar()
	m, err := model.New(cfg.Model, cfg.ModelSeed)
	if err != nil {
		t.Fatal(err)
	}
	tr, err := NewTrainer(m, cfg.Settings.Behavior, 0)
	if err != nil {
		t.Fatal(err)
	}
	rwd, err := reward.NewRegistry(rollout.NewValidator(reg))
	if err != nil {
		t.Fatal(err)
	}
	return &harness{
		cfg: cfg, reg: reg, rwd: rwd, tr: tr, runID: fmt.Sprintf("run-%d", cfg.ModelSeed),
		comps: []reward.Component{{Name: rollout.EvalSuccess, Version: rollout.ValidatorVersion, Weight: 1}},
	}
}

// collect runs G attempts of each task at the trainer's current version and
// returns the scored groups and the fraction of successes.
func (h *harness) collect(ctx context.Context, tasks []rollout.Task, groupBase int64, g int32) ([][]schemas.Scored, float64, error) {
	pol := h.tr.Policy()
	var atts []schemas.TaskAttempt
	for i, task := range tasks {
		atts = append(atts, rollout.Attempts(h.runID, task, groupBase+int64(i), g, h.cfg.ContractSeed, pol.Version(), "contract")...)
	}
	trajs, err := h.reg.RunEpisodes(ctx, pol, atts, h.cfg.Settings, h.cfg.Limits)
	if err != nil {
		return nil, 0, err
	}
	var groups [][]schemas.Scored
	succ := 0
	for i := range tasks {
		members := make([]schemas.Rewarded, 0, g)
		for k := int32(0); k < g; k++ {
			r, err := reward.Score(ctx, &trajs[i*int(g)+int(k)], h.comps, h.rwd)
			if err != nil {
				return nil, 0, err
			}
			if r.RewardTotal > 0 {
				succ++
			}
			members = append(members, r)
		}
		sc, err := advantage.ScoreGroup(h.cfg.Advantage, members)
		if err != nil {
			return nil, 0, err
		}
		groups = append(groups, sc)
	}
	return groups, float64(succ) / float64(len(trajs)), nil
}

// evalSuccess is the success rate on the hidden eval split (eval records
// never reach pack).
func (h *harness) evalSuccess(ctx context.Context, update int) (float64, error) {
	_, s, err := h.collect(ctx, h.reg.Eval(), int64(1_000_000+update*10_000), h.cfg.EvalSamples)
	return s, err
}

// step collects one batch of train groups, packs it and updates.
func (h *harness) step(ctx context.Context, update int) (loopPoint, error) {
	train := h.reg.Train()
	tasks := make([]rollout.Task, h.cfg.TasksPerStep)
	for i := range tasks {
		tasks[i] = train[(update*h.cfg.TasksPerStep+i)%len(train)]
	}
	groups, trainSucc, err := h.collect(ctx, tasks, int64(update*h.cfg.TasksPerStep), h.cfg.GroupSize)
	if err != nil {
		return loopPoint{}, err
	}
	w, err := pack.NewWindow(h.cfg.Pack, h.tr.Version())
	if err != nil {
		return loopPoint{}, err
	}
	for _, g := range groups {
		for _, s := range g {
			if _, err := w.Add(s); err != nil {
				return loopPoint{}, err
			}
		}
	}
	pt := loopPoint{Update: update, Train: trainSucc}
	batch, _ := w.Close(int64(update), h.runID, "contract", h.tr.Version())
	if len(batch.Rows) == 0 { // every group had zero variance
		return pt, nil
	}
	for e := 0; e < max(1, h.cfg.Epochs); e++ {
		met, err := h.tr.Step(batch, h.cfg.Objective, h.cfg.Adam)
		if err != nil {
			return loopPoint{}, err
		}
		if e == 0 {
			pt.Metrics = met
		}
	}
	return pt, nil
}

// run runs the loop and returns the initial eval success and the curve.
func (h *harness) run(ctx context.Context, t testing.TB) (float64, []loopPoint) {
	init, err := h.evalSuccess(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	var curve []loopPoint
	for u := 0; u < h.cfg.Updates; u++ {
		pt, err := h.step(ctx, u)
		if err != nil {
			t.Fatalf("update %d: %v", u, err)
		}
		pt.EvalSuccess = -1
		if (u+1)%h.cfg.EvalEvery == 0 || u == h.cfg.Updates-1 {
			if pt.EvalSuccess, err = h.evalSuccess(ctx, u+1); err != nil {
				t.Fatal(err)
			}
		}
		curve = append(curve, pt)
		if h.cfg.StopAtSuccess > 0 && pt.EvalSuccess >= h.cfg.StopAtSuccess {
			break
		}
	}
	return init, curve
}
