package loop_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// TestDemoDeterministic: in stop-and-synchronize mode the same seed gives
// the same batches, bit for bit, although every operator runs
// concurrently over Kafka; another seed gives other batches.
func TestDemoDeterministic(t *testing.T) {
	a := testkit.Demo(t, loop.Options{Updates: 6, Seed: 1})
	b := testkit.Demo(t, loop.Options{Updates: 6, Seed: 1})
	if !reflect.DeepEqual(a.BatchHashes, b.BatchHashes) || len(a.BatchHashes) == 0 {
		t.Fatalf("same seed, different batches:\n%v\n%v", a.BatchHashes, b.BatchHashes)
	}
	if a.EvalSuccessFinal != b.EvalSuccessFinal {
		t.Fatalf("same seed, eval %v vs %v", a.EvalSuccessFinal, b.EvalSuccessFinal)
	}
	c := testkit.Demo(t, loop.Options{Updates: 2, Seed: 2})
	if c.BatchHashes[0] == a.BatchHashes[0] {
		t.Fatal("another seed gave the same first batch")
	}
}

// TestCompressedTopicsSameBatches: compressing topics changes how records
// travel, not what they are: the same seed gives the same batches, bit for
// bit, with every data-plane hop and the census compressed (each codec
// once) as without, and nothing lost.
func TestCompressedTopicsSameBatches(t *testing.T) {
	plain := testkit.Demo(t, loop.Options{Updates: 2, Seed: 1})
	compressed := testkit.Demo(t, loop.Options{Updates: 2, Seed: 1, Edit: func(c *contract.Contract) {
		c.Topics.Compression = map[string]string{"tasks": "gzip", "trajectories": "zstd", "valid": "lz4",
			"rewarded": "snappy", "scored": "lz4", "batches": "snappy", "census": "zstd", "policy": "gzip"}
	}})
	if !reflect.DeepEqual(plain.BatchHashes, compressed.BatchHashes) {
		t.Fatalf("compressed topics gave other batches:\n%v\n%v", plain.BatchHashes, compressed.BatchHashes)
	}
}

// TestCostLedger: every update record carries its cost ledger, and the
// run's ledger (their sum) agrees with the census the gate counts toward
// the budgets: every episode the rollout completed was decided by pack,
// admitted (the rollout account) or filtered (the rejected one), so the
// two accounts together hold every rollout token, and the training
// account every optimizer token.
func TestCostLedger(t *testing.T) {
	out := t.TempDir()
	o := loop.Options{Updates: 3, Seed: 4, Out: out}
	s := testkit.Demo(t, o)
	files, err := pipeline.NewDirReleases(filepath.Join(out, "releases"))
	if err != nil {
		t.Fatal(err)
	}
	ct, err := loop.Contract(o)
	if err != nil {
		t.Fatal(err)
	}
	epochs := int64(ct.Loss.Optimizer.Epochs)
	var sum schemas.UpdateCost
	for v := int64(1); v <= int64(s.Updates); v++ {
		u, err := gpu.ReadUpdate(files, v)
		if err != nil || u.Cost == nil || u.Cost.Windows < 1 || u.Cost.Rollout.Episodes == 0 ||
			u.Cost.Training.OptimizerTokens != u.Metrics.Tokens*epochs || u.Cost.Training.AcceleratorHours <= 0 {
			t.Fatalf("update %d: cost %+v (metrics tokens %d) %v", v, u.Cost, u.Metrics.Tokens, err)
		}
		sum.Add(*u.Cost)
	}
	if sum != s.Cost {
		t.Fatalf("summary cost %+v, the update records sum to %+v", s.Cost, sum)
	}
	c, g := s.Cost, s.Gate
	if g == nil || s.Quarantined != 0 {
		t.Fatalf("gate %v, quarantined %d", g, s.Quarantined)
	}
	if c.Rollout.Episodes != s.TrajectoriesAdmitted || c.Rejected.Episodes != s.TrajectoriesFiltered ||
		c.Rollout.Episodes+c.Rejected.Episodes != s.AttemptsLaunched {
		t.Fatalf("ledger episodes %d + %d, summary admitted %d filtered %d of %d launched",
			c.Rollout.Episodes, c.Rejected.Episodes, s.TrajectoriesAdmitted, s.TrajectoriesFiltered, s.AttemptsLaunched)
	}
	if c.Rollout.RolloutTokens+c.Rejected.RolloutTokens != g.Usage.RolloutTokens || c.Training.OptimizerTokens != g.Usage.OptimizerTokens {
		t.Fatalf("ledger rollout %d + rejected %d tokens, training %d; the gate counted %d rollout and %d optimizer tokens",
			c.Rollout.RolloutTokens, c.Rejected.RolloutTokens, c.Training.OptimizerTokens, g.Usage.RolloutTokens, g.Usage.OptimizerTokens)
	}
}

// TestRatioOneThroughKafka: the first update's batch went dispatch ->
// rollout -> validate -> reward -> advantage -> pack -> train over Kafka;
// the trainer's recomputed log-probs on its tokens equal the behavior
// log-probs, so the ratio is exactly 1 and the KL to the behavior policy
// exactly 0 (docs/PIPELINE.md §21, "Ratio is not one before first update").
func TestRatioOneThroughKafka(t *testing.T) {
	out := t.TempDir()
	testkit.Demo(t, loop.Options{Updates: 1, Seed: 3, Out: out})
	files, err := pipeline.NewDirReleases(filepath.Join(out, "releases"))
	if err != nil {
		t.Fatal(err)
	}
	u, err := gpu.ReadUpdate(files, 1)
	if err != nil {
		t.Fatal(err)
	}
	m := u.Metrics
	if m.Tokens == 0 || m.RatioMin != 1 || m.RatioMax != 1 || m.RatioMean != 1 || m.ApproxKLOld != 0 || m.FromVersion != 0 {
		t.Fatalf("first update: tokens %d ratio [%v %v] mean %v approx KL %v from version %d",
			m.Tokens, m.RatioMin, m.RatioMax, m.RatioMean, m.ApproxKLOld, m.FromVersion)
	}
	if len(m.Lag) != 1 || m.Lag[0].Lag != 0 || m.Lag[0].K3 != 0 || m.Lag[0].Tokens != m.Tokens {
		t.Fatalf("lag strata %+v", m.Lag)
	}
	// The second optimizer step of the update moved the policy.
	if u.Last.ApproxKLOld == 0 {
		t.Fatal("the update's last step saw no change from the behavior policy")
	}
}

// TestDemoAsync: asynchronous mode runs up to max_lag+1 rounds in flight
// and still accounts for every attempt; at every update, every trained
// token is within max_lag of the trainer's version (the update records'
// lag distributions), and what the rule excluded is counted.
func TestDemoAsync(t *testing.T) {
	out := t.TempDir()
	s := testkit.Demo(t, loop.Options{Updates: 6, Seed: 1, Async: true, MaxLag: 1, Out: out})
	if s.Mode != "async" || s.Updates == 0 || s.TrajectoriesAdmitted == 0 || s.GeneratedTokens == 0 {
		t.Fatalf("summary %+v", s)
	}
	files, err := pipeline.NewDirReleases(filepath.Join(out, "releases"))
	if err != nil {
		t.Fatal(err)
	}
	var trained, stale int64
	for v := int64(1); v <= int64(s.Updates); v++ {
		u, err := gpu.ReadUpdate(files, v)
		if err != nil {
			t.Fatal(err)
		}
		if u.MaxLag != 1 || len(u.Lag) == 0 {
			t.Fatalf("update %d: max_lag %d, lag distribution %v", v, u.MaxLag, u.Lag)
		}
		for _, l := range u.Lag {
			if l.Lag > u.MaxLag || l.Lag < 0 {
				t.Fatalf("update %d trained %d tokens at lag %d, max_lag %d", v, l.Tokens, l.Lag, u.MaxLag)
			}
			trained += l.Tokens
		}
		for _, l := range u.Metrics.Lag {
			if l.Lag > u.MaxLag {
				t.Fatalf("update %d: the trainer's lag strata %v exceed max_lag", v, u.Metrics.Lag)
			}
		}
		stale += u.StaleTokens
	}
	if trained != s.TrainedTokens {
		t.Fatalf("update records trained %d tokens, the summary %d", trained, s.TrainedTokens)
	}
	if stale > s.StaleTokens {
		t.Fatalf("update records excluded %d tokens, the census counts only %d stale tokens", stale, s.StaleTokens)
	}
	t.Logf("stale share %.4f (%d of %d tokens), %d trajectories excluded at the update", s.StaleShare, s.StaleTokens, s.GeneratedTokens, s.TrajectoriesExcluded)
}

func TestOptionsRefused(t *testing.T) {
	for _, o := range []loop.Options{{Updates: 0, EvalSamples: 1}, {Updates: 1, EvalSamples: 0}} {
		if _, err := loop.Run(context.Background(), o, io.Discard); err == nil {
			t.Errorf("options %+v accepted", o)
		}
	}
}

// TestEvalTaskNeverTrains injects a trajectory of a hidden-eval task onto
// the trajectories topic beside a normal group: it never reaches a batch,
// and validate raises an incident.
func TestEvalTaskNeverTrains(t *testing.T) {
	c, err := loop.Contract(loop.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	b, err := kafka.StartBroker(context.Background(), kafka.BrokerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	deps, err := operators.BuiltinDeps(c)
	if err != nil {
		t.Fatal(err)
	}
	topics := deps.Topics
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := kafka.CreateTopics(ctx, kafka.ClientConfig{}, []string{b.Addr()}, operators.TopicSpecs(c, topics)); err != nil {
		t.Fatal(err)
	}
	reg := deps.Tasks
	m, err := model.New(model.DefaultConfig(), 1)
	if err != nil {
		t.Fatal(err)
	}
	pol := model.NewPolicy(m, 0)
	episodes := func(task rollout.Task, group int64) []schemas.Trajectory {
		atts := rollout.Attempts(c.RunID, task, group, 16, c.Seed, 0, c.Hash())
		trajs, err := reg.RunEpisodes(ctx, pol, atts, operators.RolloutSettings(c, reg), operators.RolloutLimits(c))
		if err != nil {
			t.Fatal(err)
		}
		return trajs
	}
	evalTask := reg.Eval()[0]
	leaked := episodes(evalTask, 0)
	for i := range leaked {
		leaked[i].Split = schemas.SplitTrain // disguised: only the denylist knows
	}
	var launched []string
	tr := &kafkago.Transport{} // not DefaultTransport, whose pools outlive the writer
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{Addr: kafkago.TCP(b.Addr()), Topic: topics.Trajectories, Balancer: &kafkago.Murmur2Balancer{}, RequiredAcks: kafkago.RequireAll, Transport: tr}
	defer w.Close()
	var msgs []kafkago.Message
	for g := int64(0); g < 16; g++ {
		trajs := episodes(reg.Train()[g], 100+g)
		for _, tr := range trajs {
			launched = append(launched, tr.RecordID)
		}
		v, err := schemas.Trajectories.Encode(nil, trajs)
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, kafkago.Message{Key: []byte(trajs[0].GroupID), Value: v})
	}
	v, err := schemas.Trajectories.Encode(nil, leaked)
	if err != nil {
		t.Fatal(err)
	}
	msgs = append(msgs, kafkago.Message{Key: []byte(leaked[0].GroupID), Value: v})
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	opCtx, stop := context.WithCancel(context.Background())
	done := make(chan error, 4)
	for _, name := range []string{"validate", "reward", "advantage", "pack"} {
		op, err := operators.NewOperator(name, deps, pipeline.Config{Brokers: []string{b.Addr()}, StateDir: t.TempDir(),
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), CommitInterval: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		go func() { done <- op.Run(opCtx) }()
	}
	defer func() {
		stop()
		for range 4 {
			<-done
		}
	}()
	cfg := &pipeline.Config{Brokers: []string{b.Addr()}}
	var counts audit.Counts
	var rep *audit.Report
	for deadline := time.Now().Add(40 * time.Second); ; {
		if rep, err = audit.Collect(ctx, cfg, topics); err != nil {
			t.Fatal(err)
		}
		all := append(append([]string(nil), launched...), leaked[0].RecordID)
		if counts = rep.Account(all); counts.Lost == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if counts.Lost != 0 || counts.Duplicated != 0 {
		t.Fatalf("accounting %v", counts)
	}
	for _, tr := range leaked {
		if rep.Admitted[tr.RecordID] != 0 {
			t.Fatalf("hidden-eval trajectory %s reached a batch", tr.RecordID)
		}
		if rep.Quarantined[tr.RecordID] != "eval_task_id" {
			t.Fatalf("hidden-eval trajectory %s: quarantine reason %q", tr.RecordID, rep.Quarantined[tr.RecordID])
		}
	}
	incidents := 0
	err = pipeline.ScanTail(ctx, cfg, topics.Incidents, 0, func(m pipeline.Message) error {
		inc, err := schemas.DecodeIncident(m.Value)
		if err == nil && inc.TaskID == evalTask.ID && inc.Reason == "eval_task_id" {
			incidents++
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if incidents != len(leaked) {
		t.Fatalf("%d incidents for %d leaked trajectories", incidents, len(leaked))
	}
}

// TestContractEnvironment: --environment sets the contract's environment
// artifact with the family's validator as the reward; the text family
// (which needs a policy server's tokenizer) and unknown artifacts are
// refused, naming the artifact.
func TestContractEnvironment(t *testing.T) {
	c, err := loop.Contract(loop.Options{Seed: 1, Environment: rollout.ArtifactLedger, ToolRetries: 8, ToolTimeoutMS: 2000})
	if err != nil {
		t.Fatal(err)
	}
	if c.Artifacts.Environment != rollout.ArtifactLedger || c.Rewards[0].Name != rollout.EvalLedgerSuccess ||
		c.Artifacts.Validator != "builtin:validator/ledger_success@1" || c.Sampler.ToolRetries != 8 || c.Sampler.ToolTimeoutMS != 2000 {
		t.Fatalf("contract %+v %+v %+v", c.Artifacts, c.Rewards, c.Sampler)
	}
	d, err := loop.Contract(loop.Options{Seed: 1})
	if err != nil || d.Artifacts.Environment != rollout.ArtifactKV || d.Hash() == c.Hash() {
		t.Fatalf("default contract %v %v", d.Artifacts.Environment, err)
	}
	for _, env := range []string{rollout.ArtifactText, "builtin:env/chess@v1"} {
		if _, err := loop.Contract(loop.Options{Seed: 1, Environment: env}); err == nil || !strings.Contains(err.Error(), env) {
			t.Fatalf("%s: %v", env, err)
		}
	}
}

// TestBudgetStop: with a rollout_tokens budget of about two rounds, the
// gate stops the run at the first release whose rounds reached it, and
// dispatch launches no round after; every attempt is accounted.
func TestBudgetStop(t *testing.T) {
	const budget = 10_000
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	s, err := loop.Run(ctx, loop.Options{Updates: 10, Seed: 1, EvalSamples: 1, Out: t.TempDir(), Quiet: true,
		Edit: func(c *contract.Contract) { c.Budgets.RolloutTokens = budget }}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	g := s.Gate
	if s.StoppedBy != "budget_exhausted" || g.Stop == nil || g.Halted == nil || g.Usage.RolloutTokens < budget {
		t.Fatalf("stopped by %q, stop %+v, usage %+v", s.StoppedBy, g.Stop, g.Usage)
	}
	v := g.Stop.PolicyVersion
	if s.Rounds >= 10 || int64(s.Rounds) != v || g.Halted.RoundsDispatched != v {
		t.Fatalf("stop at release %d, %d rounds dispatched (halted record: %d)", v, s.Rounds, g.Halted.RoundsDispatched)
	}
	// The ruling on the release before the stop saw the budget not yet
	// spent: the stop came within one round of it.
	checked := false
	for _, d := range g.Decisions {
		if d.PolicyVersion != v-1 {
			continue
		}
		for _, c := range d.Checks {
			if c.Name == "rollout_tokens" {
				checked = true
				if !c.OK || c.Value >= budget || c.Bound != budget {
					t.Fatalf("release %d already over budget: %+v", v-1, c)
				}
			}
		}
	}
	if !checked && v > 1 {
		t.Fatalf("the ruling on release %d holds no budget check", v-1)
	}
	if s.Lost != 0 || s.DuplicatesAdmitted != 0 || s.AttemptsLaunched != s.Rounds*16*16 ||
		s.AttemptsLaunched != s.TrajectoriesAdmitted+s.TrajectoriesFiltered+s.Quarantined {
		t.Fatalf("accounting: launched %d for %d rounds, admitted %d, filtered %d, quarantined %d, lost %d, duplicates %d",
			s.AttemptsLaunched, s.Rounds, s.TrajectoriesAdmitted, s.TrajectoriesFiltered, s.Quarantined, s.Lost, s.DuplicatesAdmitted)
	}
	t.Logf("stopped at release %d after %d rounds: %d rollout tokens of %d; %s", v, s.Rounds, g.Usage.RolloutTokens, budget, g.Stop.Reason)
}

// TestMinibatchesRecorded: loss.optimizer.minibatches 2 trains every
// epoch in two seeded minibatches, and the update record holds the order.
func TestMinibatchesRecorded(t *testing.T) {
	out := t.TempDir()
	testkit.Demo(t, loop.Options{Updates: 2, Seed: 1, Out: out, Edit: func(c *contract.Contract) { c.Loss.Optimizer.Minibatches = 2 }})
	files, err := pipeline.NewDirReleases(filepath.Join(out, "releases"))
	if err != nil {
		t.Fatal(err)
	}
	u, err := gpu.ReadUpdate(files, 1)
	if err != nil {
		t.Fatal(err)
	}
	c, err := loop.Contract(loop.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	epochs := c.Loss.Optimizer.Epochs
	if epochs < 2 || len(u.MinibatchOrder) != epochs || len(u.MinibatchOrder[0]) != 2 || len(u.MinibatchOrder[0][0]) == 0 {
		t.Fatalf("minibatch order %v for %d epochs", u.MinibatchOrder, epochs)
	}
	want, err := gpu.MinibatchOrder(len(u.MinibatchOrder[0][0])+len(u.MinibatchOrder[0][1]), 2, epochs, 1, u.BatchID)
	if err != nil || !reflect.DeepEqual(want, u.MinibatchOrder) {
		t.Fatalf("recorded order %v, the seeded one %v (%v)", u.MinibatchOrder, want, err)
	}
}

// TestBrokenRewardRollsBackAndStops: a deliberately broken reward (the
// validator's success negated: the policy is paid to fail) drives the
// held-out success under its regression floor (0.95 of the initial); the
// gate rolls back to the promoted release, the initial one, and after two
// evaluations without a gain stops the run by rule. Every attempt is
// accounted. The trainer publishes the promoted release's parameters as
// the next version, and the failed releases stay in the store.
func TestBrokenRewardRollsBackAndStops(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	out := t.TempDir()
	o := loop.Options{Updates: 30, Seed: 1, EvalSamples: 4, EvalEvery: 1, Out: out, Quiet: true,
		Edit: func(c *contract.Contract) {
			c.Rewards[0].Transform = contract.TransformNegate
			for i := range c.StopRules {
				if c.StopRules[i].Kind == contract.StopNoValidationGain {
					c.StopRules[i].N = 2
				}
			}
		}}
	s, err := loop.Run(ctx, o, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	g := s.Gate
	var actions []string
	for _, d := range g.Decisions {
		if d.Evaluated {
			actions = append(actions, fmt.Sprintf("%d:%s", d.PolicyVersion, d.Action))
		}
	}
	t.Logf("evaluated decisions %v; stop %+v", actions, g.Stop)
	if g.Rollbacks < 1 || g.Stop == nil || g.Stop.StopRule != "no_validation_gain_for_2_evals" || g.Promoted != 0 {
		t.Fatalf("rollbacks %d, promoted %d, stop %+v", g.Rollbacks, g.Promoted, g.Stop)
	}
	back := false
	for _, d := range g.Decisions {
		if d.Action == "rollback" && d.RollbackTo == 0 {
			for _, c := range d.Checks {
				back = back || (c.Kind == "regression_floor" && !c.OK)
			}
		}
	}
	if !back {
		t.Fatal("no rollback on a broken regression floor")
	}
	// The release after the rollback holds release 0's parameters; the
	// rolled-back release is kept.
	files, err := pipeline.NewDirReleases(filepath.Join(out, "releases"))
	if err != nil {
		t.Fatal(err)
	}
	manifest := func(v int64) schemas.PolicyRelease {
		t.Helper()
		b, err := files.Read(gpu.ManifestName(v))
		if err != nil {
			t.Fatal(err)
		}
		var rel schemas.PolicyRelease
		if err := json.Unmarshal(b, &rel); err != nil {
			t.Fatal(err)
		}
		return rel
	}
	var first *schemas.GateDecision
	for i, d := range g.Decisions {
		if d.Action == "rollback" {
			first = &g.Decisions[i]
			break
		}
	}
	u, err := gpu.ReadUpdate(files, first.PolicyVersion+1)
	if err != nil {
		t.Fatal(err)
	}
	restored, failed, base := manifest(first.PolicyVersion+1), manifest(first.PolicyVersion), manifest(0)
	if u.RolledBackTo == nil || *u.RolledBackTo != 0 || u.BatchID != "" || restored.CheckpointHash != base.CheckpointHash || failed.CheckpointHash == base.CheckpointHash {
		t.Fatalf("release %d after the rollback of %d: update %+v, checkpoint %s (release 0: %s, failed: %s)",
			first.PolicyVersion+1, first.PolicyVersion, u, restored.CheckpointHash, base.CheckpointHash, failed.CheckpointHash)
	}
	// The rollback moved the run back with the release's curriculum and
	// reward versions: those the contract defines (the broken reward's).
	ct, err := loop.Contract(o)
	if err != nil {
		t.Fatal(err)
	}
	if restored.CurriculumVersion != base.CurriculumVersion || restored.RewardVersion != base.RewardVersion ||
		base.CurriculumVersion != ct.CurriculumVersion() || base.RewardVersion != ct.RewardVersion() || ct.RewardVersion() == contract.Default().RewardVersion() {
		t.Fatalf("versions: restored %s/%s, release 0 %s/%s, contract %s/%s", restored.CurriculumVersion, restored.RewardVersion,
			base.CurriculumVersion, base.RewardVersion, ct.CurriculumVersion(), ct.RewardVersion())
	}
	if s.StoppedBy != g.Stop.StopRule || s.Rounds >= 30 || s.Lost != 0 || s.DuplicatesAdmitted != 0 ||
		s.AttemptsLaunched != s.Rounds*16*16 || s.AttemptsLaunched != s.TrajectoriesAdmitted+s.TrajectoriesFiltered+s.Quarantined {
		t.Fatalf("stopped by %q after %d rounds: launched %d, admitted %d, filtered %d, quarantined %d, lost %d, duplicates %d",
			s.StoppedBy, s.Rounds, s.AttemptsLaunched, s.TrajectoriesAdmitted, s.TrajectoriesFiltered, s.Quarantined, s.Lost, s.DuplicatesAdmitted)
	}
}

// TestKLStop: with objective.kl_limit 0.1, the KL to the reference
// measured on every release passes the limit for 3 consecutive updates
// and the gate stops the run by kl_above_limit_for_3_updates; no round is
// launched after the stop.
func TestKLStop(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	s, err := loop.Run(ctx, loop.Options{Updates: 20, Seed: 1, EvalSamples: 1, Out: t.TempDir(), Quiet: true,
		Edit: func(c *contract.Contract) { c.Objective.KLLimit = 0.1 }}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	g := s.Gate
	if g.Stop == nil || g.Stop.StopRule != "kl_above_limit_for_3_updates" || s.StoppedBy != g.Stop.StopRule {
		t.Fatalf("stop %+v", g.Stop)
	}
	v := g.Stop.PolicyVersion
	above := 0
	for _, u := range s.PerUpdate {
		if u.Update > v-3 && u.Update <= v && u.KLRef > 0.1 {
			above++
		}
	}
	if above != 3 || int64(s.Rounds) != v || s.Lost != 0 || s.DuplicatesAdmitted != 0 || s.AttemptsLaunched != s.Rounds*16*16 {
		t.Fatalf("stop at %d: %d of the last 3 updates above the limit, %d rounds, launched %d, lost %d, duplicates %d",
			v, above, s.Rounds, s.AttemptsLaunched, s.Lost, s.DuplicatesAdmitted)
	}
	t.Logf("stopped at release %d after %d rounds: %s", v, s.Rounds, g.Stop.Reason)
}

// TestSafetyIncidentStops: trajectories of a hidden-eval task disguised as
// training ones reach the trajectories topic; validate refuses them and
// raises an eval_task_id incident, an open safety incident, and the gate
// stops the run by safety_violation at the first evaluation. The run's own
// attempts are all accounted.
func TestSafetyIncidentStops(t *testing.T) {
	c, err := loop.Contract(loop.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	b, err := kafka.StartBroker(context.Background(), kafka.BrokerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	deps, err := operators.BuiltinDeps(c)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if err := kafka.CreateTopics(ctx, kafka.ClientConfig{}, []string{b.Addr()}, operators.TopicSpecs(c, deps.Topics)); err != nil {
		t.Fatal(err)
	}
	reg := deps.Tasks
	m, err := model.New(model.DefaultConfig(), 1)
	if err != nil {
		t.Fatal(err)
	}
	atts := rollout.Attempts(c.RunID, reg.Eval()[0], 999, 16, c.Seed, 0, c.Hash())
	leaked, err := reg.RunEpisodes(ctx, model.NewPolicy(m, 0), atts, operators.RolloutSettings(c, reg), operators.RolloutLimits(c))
	if err != nil {
		t.Fatal(err)
	}
	for i := range leaked {
		leaked[i].Split = schemas.SplitTrain // disguised: only the denylist knows
	}
	v, err := schemas.Trajectories.Encode(nil, leaked)
	if err != nil {
		t.Fatal(err)
	}
	tr := &kafkago.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{Addr: kafkago.TCP(b.Addr()), Topic: deps.Topics.Trajectories, RequiredAcks: kafkago.RequireAll, Transport: tr}
	defer w.Close()
	if err := w.WriteMessages(ctx, kafkago.Message{Key: []byte(leaked[0].GroupID), Value: v}); err != nil {
		t.Fatal(err)
	}
	s, err := loop.Run(ctx, loop.Options{Updates: 8, Seed: 1, EvalSamples: 1, Out: t.TempDir(), Quiet: true, Brokers: []string{b.Addr()}}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	g := s.Gate
	if g.Stop == nil || g.Stop.StopRule != "safety_violation" || g.Stop.PolicyVersion != 5 || !strings.Contains(g.Stop.Reason, "open safety incidents") {
		t.Fatalf("stop %+v", g.Stop)
	}
	if s.Rounds != 5 || s.Lost != 0 || s.DuplicatesAdmitted != 0 || s.AttemptsLaunched != 5*16*16 {
		t.Fatalf("%d rounds, launched %d, lost %d, duplicates %d", s.Rounds, s.AttemptsLaunched, s.Lost, s.DuplicatesAdmitted)
	}
}

// TestNoGate: without the gate nothing is evaluated and every release is
// trained on. Run regress-1 with the token-mean objective
// (testkit.RegressMean) rolls back at its first evaluation (release 5, a
// regression floor below the initial policy's success): the gated run's
// batches equal the ungated run's up to the first rollback and differ
// from the next one, trained on the restored parameters.
func TestNoGate(t *testing.T) {
	run := func(noGate bool) *loop.Summary {
		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer cancel()
		s, err := loop.Run(ctx, loop.Options{Updates: 7, Seed: 1, RunID: "regress-1", EvalSamples: 1, NoGate: noGate,
			Quiet: true, Out: t.TempDir(), Edit: testkit.RegressMean}, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if s.Lost != 0 || s.DuplicatesAdmitted != 0 {
			t.Fatalf("no gate %v: lost %d, duplicates %d", noGate, s.Lost, s.DuplicatesAdmitted)
		}
		return s
	}
	free, gated := run(true), run(false)
	if free.Gate != nil || len(free.Evals) != 0 || len(free.BatchHashes) != 7 {
		t.Fatalf("no gate: gate %+v, %d evaluations, %d batches; want no gate, no evaluation, 7 batches", free.Gate, len(free.Evals), len(free.BatchHashes))
	}
	if gated.Gate == nil {
		t.Fatal("gated run of regress-1: no gate summary")
	}
	first := int64(-1)
	for _, d := range gated.Gate.Decisions {
		if d.Action == schemas.GateRollback {
			first = d.PolicyVersion
			break
		}
	}
	if first < 1 || first >= int64(len(free.BatchHashes)) {
		t.Fatalf("gated run of regress-1: first rollback at release %d, want one of 1..%d", first, len(free.BatchHashes)-1)
	}
	if !reflect.DeepEqual(gated.BatchHashes[:first], free.BatchHashes[:first]) || gated.BatchHashes[first] == free.BatchHashes[first] {
		t.Fatalf("batches\n%v (gated)\n%v (no gate)\nwant the first %d equal and the next one different", gated.BatchHashes, free.BatchHashes, first)
	}
}

// TestRunLeavesNoDialer: once Run has returned, none of its goroutines
// (the loop's, the operators') runs, and nothing of the run dials its
// brokers again (testkit.NoDials says why that matters). The broker
// is closed after a run that wrote a gate decision and a listener takes
// its address for 8 s, longer than kafka-go's default metadata refresh
// (6 s).
func TestRunLeavesNoDialer(t *testing.T) {
	b, err := kafka.StartBroker(context.Background(), kafka.BrokerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	s, err := loop.Run(ctx, loop.Options{Updates: 1, EvalEvery: 1, Seed: 1, EvalSamples: 1, Out: t.TempDir(), Quiet: true, Brokers: []string{b.Addr()}}, io.Discard)
	b.Close()
	if err != nil {
		t.Fatal(err)
	}
	if s.Gate == nil || len(s.Gate.Decisions) == 0 {
		t.Fatal("no gate decision: the run wrote none with the writer this test watches")
	}
	for _, fn := range []string{"github.com/trajflow/trajflow/internal/loop.", "github.com/trajflow/trajflow/pipeline."} {
		testkit.NoGoroutines(t, fn)
	}
	testkit.NoDials(t, b.Addr(), 8*time.Second)
}

// TestContractOffPolicyDropsClipBounds: under an off_policy of tis the
// trust region's clip bounds apply to nothing, so the run's contract
// (from the demo contract, whose clip_high is 0.28) holds their defaults
// and reads back from its own YAML with the same hash.
func TestContractOffPolicyDropsClipBounds(t *testing.T) {
	base, err := contract.Load(filepath.Join("..", "..", "testdata", "contracts", "demo.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	c, err := loop.Contract(loop.Options{Seed: 1, Base: base, OffPolicy: objective.OffPolicyTIS, ISCap: 2})
	if err != nil {
		t.Fatal(err)
	}
	if c.Loss.ClipLow != 0.2 || c.Loss.ClipHigh != 0.2 || c.Loss.OffPolicy != objective.OffPolicyTIS {
		t.Fatalf("clip %v %v off_policy %s, want the defaults 0.2 0.2 under tis", c.Loss.ClipLow, c.Loss.ClipHigh, c.Loss.OffPolicy)
	}
	y, err := c.YAML()
	if err != nil {
		t.Fatal(err)
	}
	back, err := contract.Parse(y)
	if err != nil {
		t.Fatal(err)
	}
	if err := back.Resolve(); err != nil || back.Hash() != c.Hash() {
		t.Fatalf("read back: %v, hash %s want %s\n%s", err, back.Hash(), c.Hash(), y)
	}
	d, err := loop.Contract(loop.Options{Seed: 1, Base: base})
	if err != nil || d.Loss.ClipHigh != 0.28 {
		t.Fatalf("without an override clip_high %v (%v), want the demo's 0.28", d.Loss.ClipHigh, err)
	}
}
