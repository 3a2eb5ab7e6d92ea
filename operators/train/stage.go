// Package train is the train operator (`trajflow run train`, pipeline
// §12–§14, docs/SYSTEMS.md §8): a thin adapter that drives a gpu.Backend (the CPU
// reference, or the CUDA backend in a build with the cuda tag) from the
// batches topic and publishes every update as a policy release.
package train

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/internal/idset"
	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// StageConfig configures the train operator.
type StageConfig struct {
	Topics       pipeline.Topics
	RunID        string
	ContractHash string
	// Behavior is the sampling distribution the rollouts use (temperature,
	// grammar, top-k/top-p); the trainer optimizes the same one.
	Behavior model.Behavior
	// Model and ModelSeed make the initial policy (version 0) when the
	// policy topic has no release yet.
	Model     model.Config
	ModelSeed uint64
	Objective objective.Options
	// Reference is the frozen reference policy of the KL term (the
	// initial policy, as the evaluation plane's): with Objective.KLPlacement
	// loss the stage computes every row's RefLogprobs with it before the
	// update (docs/PIPELINE.md §12), replacing any the batch carries;
	// required with that placement, unused otherwise.
	Reference *model.Model
	// Lag is the lag rule at the optimizer step (packing.max_lag and
	// packing.stale_policy; LagRule).
	Lag LagRule
	// TokenBudget is packing.token_budget: pack fills rows of at most that
	// many tokens, so a longer row is not pack's and is refused as
	// untrainable before the trainer sizes its work by it (0: unchecked).
	TokenBudget int
	Adam        gpu.AdamOptions
	// Epochs is the number of optimizer steps on every batch (>= 1). An
	// update is all of them; it produces one policy version.
	Epochs int
	// Minibatches splits every epoch into that many optimizer steps over
	// a seeded order of the batch's rows (gpu.MinibatchOrder, seeded by
	// Seed, the contract seed); 0 or 1: one step per epoch on the whole
	// batch. The backend must implement gpu.MinibatchUpdater.
	Minibatches int
	Seed        int64
	// Backend builds the trainer (default gpu.CPUBackend).
	Backend gpu.BackendFactory
	Meta    gpu.ReleaseMeta
	// RebuildScan bounds how many batches Start reads back to restore the
	// trained trajectory ids (0: all).
	RebuildScan int64
	// Remember is how many trained trajectory ids are kept to mask
	// duplicates (default 1<<20); older ones are forgotten.
	Remember int
	Now      func() time.Time
}

// Stage is the train operator: it consumes packed batches, recomputes
// current log-probs on the exact stored tokens, takes Epochs optimizer
// steps with the contract's objective, and publishes the new version:
// checkpoint and manifest in the release store (Env.Releases), then the
// manifest on the compacted policy topic, plus a "trained" census event
// per trajectory.
//
// On its first start (no release on the policy topic) it publishes the
// initial policy, version 0, from Model and ModelSeed, so that dispatch
// and rollout can start.
//
// Exactly-once training: a batch whose index is not above the last one
// trained is skipped (batch ids are a function of the index); a segment
// whose trajectory id was already trained is masked out (and counted, with
// an incident). The state is restored at Start from the latest release on
// the policy topic, its update record, and the batches topic. The
// optimizer state is written beside every release (gpu.OptimName), so a
// restarted trainer continues exactly where the release left off; a batch
// redelivered after a crash between writing a release's files and
// producing its manifest is trained again into the same version.
type Stage struct {
	cfg       StageConfig
	env       *pipeline.Env
	files     pipeline.ReleaseStore
	tr        gpu.Backend
	lastIndex int64
	trained   *idset.Set  // trained trajectory ids (bounded by recent)
	recent    *idset.Ring // FIFO of trained ids, to forget the oldest
	initial   bool        // version 0 still to publish
	// refused is the cost of the batches refused whole since the last
	// update record, which the next one carries (RefusedName).
	refused refusedCost
}

// refusedCost is the content of gpu.RefusedName(v): the batches refused
// whole after version v and their cost (schemas.WindowCost.Refused).
type refusedCost struct {
	Batches []string           `json:"batches"`
	Cost    schemas.WindowCost `json:"cost"`
}

// ledger is the cost header of an update: the batch's own (nil when it
// had none) plus the refused batches' since the last update; nil when
// there is neither.
func (r *refusedCost) ledger(w *schemas.WindowCost) *schemas.WindowCost {
	if len(r.Batches) == 0 {
		return w
	}
	total := r.Cost
	if w != nil {
		total.Add(*w)
	}
	return &total
}

// refuseBatch adds a batch refused whole to the refused cost and stores
// it beside the current release, before the refusal is committed: a
// batch redelivered after a crash is not added twice.
func (s *Stage) refuseBatch(id string, w *schemas.WindowCost) error {
	if w == nil || slices.Contains(s.refused.Batches, id) {
		return nil
	}
	next := refusedCost{Batches: append(slices.Clone(s.refused.Batches), id), Cost: s.refused.Cost}
	next.Cost.Add(w.Refused())
	b, err := json.Marshal(next)
	if err != nil {
		return fmt.Errorf("train: refused cost: %w", err)
	}
	if _, err := s.files.Write(gpu.RefusedName(s.tr.Version()), b); err != nil {
		return fmt.Errorf("train: refused cost: %w", err)
	}
	s.refused = next
	return nil
}

// readRefused reads back the refused cost stored after version v (none
// when there is no file).
func (s *Stage) readRefused(v int64) error {
	s.refused = refusedCost{}
	b, err := s.files.Read(gpu.RefusedName(v))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("train: %w: %w", gpu.ErrRelease, err)
	}
	if err := json.Unmarshal(b, &s.refused); err != nil {
		return fmt.Errorf("train: %w: %s: %w", gpu.ErrRelease, gpu.RefusedName(v), err)
	}
	return nil
}

// NewStage validates cfg.
func NewStage(cfg StageConfig) (*Stage, error) {
	if err := cfg.Objective.Validate(); err != nil {
		return nil, fmt.Errorf("train: %w", err)
	}
	if err := cfg.Adam.Validate(); err != nil {
		return nil, err
	}
	if err := cfg.Lag.Validate(); err != nil {
		return nil, err
	}
	if err := cfg.Model.Validate(); err != nil {
		return nil, err
	}
	if cfg.Epochs < 1 || cfg.Minibatches < 0 {
		return nil, fmt.Errorf("train: epochs %d, minibatches %d", cfg.Epochs, cfg.Minibatches)
	}
	if cfg.Objective.KLPlacement == objective.KLLoss && cfg.Reference == nil {
		return nil, fmt.Errorf("train: kl_placement %s needs a reference model", objective.KLLoss)
	}
	if cfg.Backend == nil {
		cfg.Backend = gpu.CPUBackend
	}
	if cfg.Remember <= 0 {
		cfg.Remember = 1 << 20
	}
	return &Stage{cfg: cfg, lastIndex: -1, trained: idset.New(), recent: idset.NewRing(cfg.Remember)}, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "train" }

// Topics implements pipeline.Stage.
func (s *Stage) Topics() []string { return s.cfg.Topics.Names(pipeline.InputsOf(s.Name())) }

// Version is the trainer's current policy version (-1 before Start).
func (s *Stage) Version() int64 {
	if s.tr == nil {
		return -1
	}
	return s.tr.Version()
}

// remember marks id trained, forgetting the oldest beyond Remember.
func (s *Stage) remember(id string) {
	if s.trained.Has(id) {
		return
	}
	k := s.trained.Add(id)
	if oldest, dropped := s.recent.Push(k); dropped {
		s.trained.Delete(oldest)
	}
}

// Start restores the trainer from the latest release, or prepares the
// initial one.
func (s *Stage) Start(ctx context.Context, env *pipeline.Env) error {
	if err := s.start(ctx, env); err != nil {
		return err
	}
	if oc, ok := s.tr.(gpu.ObjectiveChecker); ok {
		if err := oc.CheckObjective(s.cfg.Objective); err != nil {
			return fmt.Errorf("train: %w", err)
		}
	}
	return nil
}

func (s *Stage) start(ctx context.Context, env *pipeline.Env) error {
	s.env = env
	if s.cfg.Now == nil {
		s.cfg.Now = env.Now
	}
	if s.cfg.Meta.Now == nil {
		s.cfg.Meta.Now = s.now
	}
	files, err := env.Releases()
	if err != nil {
		return fmt.Errorf("train: %w", err)
	}
	s.files = files
	var latest *schemas.PolicyRelease
	err = env.Scan(ctx, s.cfg.Topics.Policy, 0, func(m pipeline.Message) error {
		rel, err := schemas.DecodeRelease(m.Value)
		if err != nil || !rel.Ready {
			return nil
		}
		if latest == nil || rel.PolicyVersion > latest.PolicyVersion {
			latest = &rel
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("train: rebuild from policy topic: %w", err)
	}
	if latest == nil {
		m, err := gpu.InitialModel(s.cfg.Model, s.cfg.ModelSeed)
		if err != nil {
			return err
		}
		if s.tr, err = s.cfg.Backend(m, s.cfg.Behavior, 0); err != nil {
			return err
		}
		if err := s.checkMinibatches(); err != nil {
			return err
		}
		s.initial = true
		env.Logger.Info("trainer starts from the initial policy", "version", 0)
		return nil
	}
	ckpt, err := files.Read(latest.CheckpointURI)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: train: release v%d is on %s but its checkpoint is not in the releases directory (%w): "+
			"give --releases the directory this run's trainer writes", pipeline.ErrConfig, latest.PolicyVersion, s.cfg.Topics.Policy, err)
	}
	if err != nil {
		return fmt.Errorf("train: %w: %w", gpu.ErrRelease, err)
	}
	m, err := gpu.ModelFromRelease(*latest, ckpt)
	if err != nil {
		return err
	}
	if s.tr, err = s.cfg.Backend(m, s.cfg.Behavior, latest.PolicyVersion); err != nil {
		return err
	}
	if err := s.checkMinibatches(); err != nil {
		return err
	}
	s.tr.SetSteps(latest.TrainingStep)
	if ob, err := files.Read(gpu.OptimName(latest.PolicyVersion)); err == nil {
		if err := s.tr.SetOptimState(ob); err != nil {
			return err
		}
	} else if latest.PolicyVersion > 0 {
		env.Logger.Warn("no optimizer state beside the release; Adam restarts from zero moments", "version", latest.PolicyVersion, "err", err)
	}
	if latest.PolicyVersion > 0 {
		u, err := gpu.ReadUpdate(files, latest.PolicyVersion)
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%w: train: release v%d is on %s but its update record is not in the releases directory (%w): "+
				"give --releases the directory this run's trainer writes", pipeline.ErrConfig, latest.PolicyVersion, s.cfg.Topics.Policy, err)
		}
		if err != nil {
			return err
		}
		s.lastIndex = u.BatchIndex
	}
	if err := s.readRefused(latest.PolicyVersion); err != nil {
		return err
	}
	env.Metrics().PolicyVersion("trained", latest.PolicyVersion)
	ids := 0
	err = env.Scan(ctx, s.cfg.Topics.Batches, s.cfg.RebuildScan, func(m pipeline.Message) error {
		b, err := schemas.PackedBatches.DecodeShared(nil, m.Value)
		if err != nil || b.BatchIndex > s.lastIndex {
			return nil
		}
		for _, row := range b.Rows {
			for _, id := range row.SegTrajectoryIDs {
				s.remember(id)
				ids++
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("train: rebuild from batches: %w", err)
	}
	env.Logger.Info("trainer restored", "version", s.tr.Version(), "last_batch", s.lastIndex, "trained_ids", ids)
	return nil
}

// Close frees the backend.
func (s *Stage) Close() error {
	if s.tr == nil {
		return nil
	}
	err := s.tr.Close()
	s.tr = nil
	return err
}

// Tick publishes the initial policy once.
func (s *Stage) Tick(_ context.Context, _ time.Time) (pipeline.Result, error) {
	var res pipeline.Result
	if !s.initial {
		return res, nil
	}
	out, err := s.release(0, nil)
	if err != nil {
		return res, err
	}
	s.initial = false
	res.Outputs = append(res.Outputs, out)
	return res, nil
}

// release writes the current version to the release store and returns the
// manifest record for the policy topic; next is the manifest's NextBatch.
// restored, when set, is the release a rollback restored: the new release
// carries its curriculum and reward versions.
func (s *Stage) release(next int64, restored *schemas.PolicyRelease) (pipeline.Output, error) {
	meta := s.cfg.Meta
	meta.NextBatch = next
	if restored != nil && (restored.CurriculumVersion != "" || restored.RewardVersion != "") {
		meta.CurriculumVersion, meta.RewardVersion = restored.CurriculumVersion, restored.RewardVersion
	}
	rel, err := s.tr.Release(s.files, meta)
	if err != nil {
		return pipeline.Output{}, err
	}
	b, err := schemas.EncodeRelease(rel)
	if err != nil {
		return pipeline.Output{}, fmt.Errorf("%w: %w", gpu.ErrRelease, err)
	}
	id := schemas.DerivedID("release", s.cfg.RunID+"/"+strconv.FormatInt(rel.PolicyVersion, 10))
	return pipeline.Output{Topic: s.cfg.Topics.Policy, Key: []byte(s.cfg.RunID), Value: b,
		Headers: stagekit.Headers(schemas.KindPolicyRelease, id)}, nil
}

// Process implements pipeline.Stage.
func (s *Stage) Process(ctx context.Context, m pipeline.Message) (pipeline.Result, error) {
	var res pipeline.Result
	if m.Topic == s.cfg.Topics.Decisions {
		return s.decision(m)
	}
	if s.initial {
		out, err := s.release(0, nil)
		if err != nil {
			return res, err
		}
		s.initial = false
		res.Outputs = append(res.Outputs, out)
	}
	// A refusal carries the outputs already due (the initial release).
	refuse := func(err error) error {
		r, ok := pipeline.AsRefusal(err)
		if !ok {
			return err
		}
		r.Also = append(r.Also, res.Outputs...)
		return r
	}
	batch, err := schemas.PackedBatches.Decode(nil, m.Value)
	if err != nil {
		return res, refuse(stagekit.DecodeRefusal(err))
	}
	if err := stagekit.CheckKindHeaders(&m, schemas.KindPackedBatch); err != nil {
		return res, refuse(err)
	}
	if err := stagekit.CheckID(&m, batch.BatchID); err != nil {
		return res, refuse(err)
	}
	var wcost *schemas.WindowCost
	if h := m.Header(schemas.HeaderWindowCost); h != nil {
		c, err := schemas.DecodeWindowCost(h)
		if err != nil {
			return res, refuse(pipeline.Refuse(stagekit.ReasonHeaderMismatch, "batch %s: %v", batch.BatchID, err))
		}
		wcost = &c
	}
	if batch.BatchIndex <= s.lastIndex {
		s.env.DuplicateDropped(batch.BatchID)
		return res, nil // redelivered: trained already
	}
	if batch.ContractHash != s.cfg.ContractHash {
		return res, refuse(pipeline.Refuse("contract_mismatch", "batch %s of contract %s, trainer runs %s", batch.BatchID, batch.ContractHash, s.cfg.ContractHash))
	}
	for ri := range batch.Rows {
		if n := len(batch.Rows[ri].InputIDs); s.cfg.TokenBudget > 0 && n > s.cfg.TokenBudget {
			return res, refuse(pipeline.Refuse("untrainable_batch", "batch %s row %d: %d tokens, over packing.token_budget %d", batch.BatchID, ri, n, s.cfg.TokenBudget))
		}
		if err := checkSegments(&batch.Rows[ri]); err != nil {
			return res, refuse(pipeline.Refuse("untrainable_batch", "batch %s row %d: %v", batch.BatchID, ri, err))
		}
	}
	dups := 0
	var ids []string
	for ri := range batch.Rows {
		row := &batch.Rows[ri]
		for k, id := range row.SegTrajectoryIDs {
			if !s.trained.Has(id) {
				ids = append(ids, id)
				continue
			}
			dups++
			for i, seg := range row.SegmentIDs {
				if int(seg) == k {
					row.ActionMask[i] = 0
				}
			}
		}
	}
	if len(ids) == 0 {
		return res, refuse(pipeline.Refuse("duplicate_batch", "every trajectory of batch %s was trained already", batch.BatchID))
	}
	from := s.tr.Version()
	lag := s.cfg.Lag.Apply(&batch, from)
	at := s.now().UnixMicro()
	stagekit.TraceAttempts(ctx, s.Name(), "pack", time.Now(), len(lag.Dropped), func(i int) string { return lag.Dropped[i] },
		attribute.String("trajflow.decision", schemas.ReasonStaleAtUpdate), attribute.String("trajflow.batch_id", batch.BatchID),
		attribute.Int64("trajflow.policy_version", from))
	for _, id := range lag.Dropped {
		ev, err := stagekit.Census(s.cfg.Topics.Census, schemas.CensusEvent{
			RunID: s.cfg.RunID, AttemptID: id, Kind: schemas.CensusFiltered, Stage: s.Name(),
			Reason: schemas.ReasonStaleAtUpdate, BatchID: batch.BatchID, Update: batch.BatchIndex,
			PolicyVersion: from, StaleTokens: lag.Masked[id], At: at,
		})
		if err != nil {
			return res, err
		}
		res.Outputs = append(res.Outputs, ev)
	}
	if len(lag.Trained) == 0 {
		// Nothing left to train: the batch is refused, its trajectories
		// counted (census above) as excluded at the update.
		if err := s.refuseBatch(batch.BatchID, wcost); err != nil {
			return res, err
		}
		return res, refuse(pipeline.Refuse("stale_batch", "batch %s: no trained token within max_lag %d of trainer version %d (%d tokens, %d segments excluded)",
			batch.BatchID, s.cfg.Lag.MaxLag, from, lag.StaleTokens, len(lag.Dropped)))
	}
	ids = lag.Trained
	start := time.Now()
	met, last, order, err := s.update(batch)
	if err != nil {
		if gpu.Untrainable(err) {
			// A batch the policy cannot train on (for example a token
			// outside the behavior distribution) goes to quarantine; the
			// trainer is unchanged and goes on with the next batch.
			if err := s.refuseBatch(batch.BatchID, wcost); err != nil {
				return res, err
			}
			return res, refuse(pipeline.Refuse("untrainable_batch", "batch %s: %v", batch.BatchID, err))
		}
		return res, fmt.Errorf("train batch %s: %w", batch.BatchID, err)
	}
	secs := time.Since(start).Seconds()
	cost := schemas.UpdateCostOf(s.refused.ledger(wcost), schemas.TrainingCost{
		OptimizerTokens: met.Tokens * int64(s.cfg.Epochs), AcceleratorHours: secs / 3600})
	u := schemas.UpdateRecord{Version: s.tr.Version(), BatchID: batch.BatchID, BatchIndex: batch.BatchIndex,
		Metrics: met, Last: last, Duplicates: dups, StepSeconds: secs, MinibatchOrder: order, Cost: &cost,
		MaxLag: s.cfg.Lag.MaxLag, StalePolicy: s.cfg.Lag.Policy, StaleTokens: lag.StaleTokens,
		StaleSegments: len(lag.Dropped), NotTrained: lag.Dropped, StaleLag: lag.StaleLag, Lag: lag.Lag,
		Selection: &lag.Selection}
	ub, err := schemas.EncodeUpdate(u)
	if err != nil {
		return res, fmt.Errorf("train: update record: %w", err)
	}
	if _, err := s.files.Write(gpu.UpdateName(u.Version), ub); err != nil {
		return res, err
	}
	s.refused = refusedCost{} // in the record now
	if _, err := s.files.Write(gpu.OptimName(u.Version), s.tr.OptimState()); err != nil {
		return res, err
	}
	s.env.Metrics().Update(u)
	s.env.Logger.Info("policy updated", "version", u.Version, "batch", batch.BatchID, "loss", u.Last.Loss,
		"approx_kl", u.Last.ApproxKLOld, "clip_pos", u.Last.ClipFracPos, "clip_neg", u.Last.ClipFracNeg,
		"entropy", u.Last.Entropy, "duplicates", dups, "seconds", u.StepSeconds)
	out, err := s.release(batch.BatchIndex+1, nil)
	if err != nil {
		return res, err
	}
	res.Outputs = append(res.Outputs, out)
	s.lastIndex = batch.BatchIndex
	stagekit.TraceAttempts(ctx, s.Name(), "pack", start, len(ids), func(i int) string { return ids[i] },
		attribute.String("trajflow.decision", schemas.CensusTrained), attribute.String("trajflow.batch_id", batch.BatchID),
		attribute.Int64("trajflow.update", batch.BatchIndex), attribute.Int64("trajflow.policy_version", u.Version))
	for _, id := range ids {
		s.remember(id)
		ev, err := stagekit.Census(s.cfg.Topics.Census, schemas.CensusEvent{
			RunID: s.cfg.RunID, AttemptID: id, Kind: schemas.CensusTrained, Stage: s.Name(),
			BatchID: batch.BatchID, Update: batch.BatchIndex, PolicyVersion: u.Version,
			Tokens: lag.Left[id], StaleTokens: lag.Masked[id], At: at,
		})
		if err != nil {
			return res, err
		}
		res.Outputs = append(res.Outputs, ev)
	}
	if dups > 0 {
		inc, err := stagekit.IncidentOutput(s.cfg.Topics.Incidents, stagekit.Incident{
			RunID: s.cfg.RunID, AttemptID: batch.BatchID, Stage: s.Name(), Reason: "duplicate_trajectory",
			Detail: fmt.Sprintf("%d segments of batch %s were trained already and were masked out", dups, batch.BatchID),
			Source: m.Ref.String(), At: at,
		})
		if err != nil {
			return res, err
		}
		res.Outputs = append(res.Outputs, inc)
	}
	return res, nil
}

// now is the stage's clock (stagekit.Now).
func (s *Stage) now() time.Time { return stagekit.Now(s.cfg.Now) }

// update computes the rows' reference log-probs when the loss needs them,
// then trains batch into the next version: Epochs steps on the whole
// batch, or, with Minibatches > 1, the seeded minibatch order it returns.
func (s *Stage) update(batch schemas.PackedBatch) (gpu.Metrics, objective.Stats, [][][]int, error) {
	if err := s.referenceLogprobs(&batch); err != nil {
		return gpu.Metrics{}, objective.Stats{}, nil, err
	}
	if s.cfg.Minibatches <= 1 {
		met, last, err := s.tr.Update(batch, s.cfg.Objective, s.cfg.Adam, s.cfg.Epochs)
		return met, last, nil, err
	}
	mu, _ := s.tr.(gpu.MinibatchUpdater) // checkMinibatches at Start
	order, err := gpu.MinibatchOrder(len(batch.Rows), s.cfg.Minibatches, s.cfg.Epochs, s.cfg.Seed, batch.BatchID)
	if err != nil {
		return gpu.Metrics{}, objective.Stats{}, nil, err
	}
	met, last, err := mu.UpdateMinibatches(batch, s.cfg.Objective, s.cfg.Adam, order)
	return met, last, order, err
}

// referenceLogprobs sets every row's RefLogprobs to the reference model's
// log-probs of its targets at its trained positions (action mask 1, after
// the duplicate and lag masks), 0 elsewhere, when the KL term is in the
// loss; otherwise the rows are left as they are. The reference is frozen,
// so one computation serves every epoch and minibatch of the update. An
// error is the batch's (gpu.ErrBatch): a token the reference cannot read.
func (s *Stage) referenceLogprobs(batch *schemas.PackedBatch) error {
	if s.cfg.Objective.KLPlacement != objective.KLLoss {
		return nil
	}
	for ri := range batch.Rows {
		r := &batch.Rows[ri]
		ref, err := s.cfg.Reference.LogprobsAt(s.cfg.Behavior, r.InputIDs, r.PositionIDs, r.SegmentIDs, r.ActionMask)
		if err != nil {
			return fmt.Errorf("%w: row %d: reference log-probs: %w", gpu.ErrBatch, ri, err)
		}
		r.RefLogprobs = ref
	}
	return nil
}

// checkMinibatches refuses minibatches > 1 on a backend that cannot split
// an epoch.
func (s *Stage) checkMinibatches() error {
	if _, ok := s.tr.(gpu.MinibatchUpdater); s.cfg.Minibatches > 1 && !ok {
		err := fmt.Errorf("train: the %T backend does not implement loss.optimizer.minibatches > 1 (%d): use the cpu backend or minibatches 1", s.tr, s.cfg.Minibatches)
		s.tr.Close()
		s.tr = nil
		return err
	}
	return nil
}

// decision applies a gate decision: on a rollback of the trainer's current
// version v to release N, the trainer takes release N's parameters and
// optimizer state and publishes them as version v+1, with an update record
// naming N (RolledBackTo); releases N+1..v stay in the store. A decision
// on another version (replayed, or of a release already superseded) is
// ignored, and so is a rollback that is the final ruling (Final: the run
// is over; the decision names the release to keep).
func (s *Stage) decision(m pipeline.Message) (pipeline.Result, error) {
	var res pipeline.Result
	d, err := schemas.DecodeGateDecision(m.Value)
	if err != nil {
		return res, stagekit.DecodeRefusal(err)
	}
	v := s.tr.Version()
	if d.Action != schemas.GateRollback || d.PolicyVersion != v || d.RollbackTo >= v || d.RollbackTo < 0 {
		return res, nil
	}
	if d.Final {
		// The ruling on the run's final evaluation: no round is left to
		// train on restored parameters, so nothing is republished; the
		// decision names the release to keep (its Promoted).
		s.env.Logger.Info("final ruling is a rollback; the run is over, no release published", "version", v, "rollback_to", d.RollbackTo, "promoted", d.Promoted)
		return res, nil
	}
	raw, err := s.files.Read(gpu.ManifestName(d.RollbackTo))
	if err != nil {
		return res, fmt.Errorf("train: rollback to release %d: %w: %w", d.RollbackTo, gpu.ErrRelease, err)
	}
	var rel schemas.PolicyRelease
	if err := json.Unmarshal(raw, &rel); err != nil {
		return res, fmt.Errorf("train: rollback to release %d: %w: %w", d.RollbackTo, gpu.ErrRelease, err)
	}
	ckpt, err := s.files.Read(rel.CheckpointURI)
	if err != nil {
		return res, fmt.Errorf("train: rollback to release %d: %w: %w", d.RollbackTo, gpu.ErrRelease, err)
	}
	mdl, err := gpu.ModelFromRelease(rel, ckpt)
	if err != nil {
		return res, err
	}
	tr, err := s.cfg.Backend(mdl, s.cfg.Behavior, v+1)
	if err != nil {
		return res, err
	}
	tr.SetSteps(s.tr.Steps())
	optim, err := s.files.Read(gpu.OptimName(d.RollbackTo))
	if err == nil {
		err = tr.SetOptimState(optim)
	} else if d.RollbackTo == 0 {
		err = nil // release 0 has no optimizer state: zero moments
	}
	if err != nil {
		tr.Close()
		return res, fmt.Errorf("train: rollback to release %d: optimizer state: %w", d.RollbackTo, err)
	}
	old := s.tr
	s.tr = tr
	old.Close()
	to := d.RollbackTo
	// The record of the rollback carries the batches refused since the
	// last update: no update follows at version v.
	cost := schemas.UpdateCostOf(s.refused.ledger(nil), schemas.TrainingCost{})
	ub, err := schemas.EncodeUpdate(schemas.UpdateRecord{Version: v + 1, BatchIndex: s.lastIndex, RolledBackTo: &to, Cost: &cost})
	if err != nil {
		return res, err
	}
	if _, err := s.files.Write(gpu.UpdateName(v+1), ub); err != nil {
		return res, err
	}
	s.refused = refusedCost{} // in the record now
	if _, err := s.files.Write(gpu.OptimName(v+1), s.tr.OptimState()); err != nil {
		return res, err
	}
	out, err := s.release(s.lastIndex+1, &rel) // the batches trained before stay consumed
	if err != nil {
		return res, err
	}
	res.Outputs = append(res.Outputs, out)
	return res, nil
}
