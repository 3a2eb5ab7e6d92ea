package gpu

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
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
	Adam      AdamOptions
	// Epochs is the number of optimizer steps on every batch (>= 1). An
	// update is all of them; it produces one policy version.
	Epochs int
	// ReleaseDir is where checkpoints, manifests and update records are
	// written (shared by every process that loads policies).
	ReleaseDir string
	Meta       ReleaseMeta
	// RebuildScan bounds how many batches Start reads back to restore the
	// trained trajectory ids (0: all).
	RebuildScan int64
	Now         func() time.Time
}

// UpdateRecord is written beside every release v >= 1 as
// UpdateName(v): which batch produced it and the update's metrics. It is
// the trainer's own record of progress (the last batch index trained is
// restored from it) and what `trajflow demo` prints.
type UpdateRecord struct {
	Version    int64  `json:"version"`
	BatchID    string `json:"batch_id"`
	BatchIndex int64  `json:"batch_index"`
	// Metrics are those of the first optimizer step of the update, taken
	// at the policy the batch was packed for: the ratio and KL to the
	// behavior policy, stratified by lag (pipeline §18 gate E). Before the
	// first update of an on-policy run the ratio is exactly 1.
	Metrics Metrics `json:"metrics"`
	// Last are the objective statistics of the update's last step.
	Last objective.Stats `json:"last"`
	// Duplicates counts segments of the batch masked out because their
	// trajectory was already trained.
	Duplicates  int     `json:"duplicates"`
	StepSeconds float64 `json:"step_seconds"`
}

// UpdateName is the file name of the update record of version v.
func UpdateName(v int64) string { return fmt.Sprintf("policy-v%08d.update.json", v) }

// ReadUpdate reads the update record of version v from dir.
func ReadUpdate(dir string, v int64) (UpdateRecord, error) {
	var u UpdateRecord
	b, err := os.ReadFile(filepath.Join(dir, UpdateName(v)))
	if err != nil {
		return u, fmt.Errorf("%w: %w", ErrRelease, err)
	}
	if err := json.Unmarshal(b, &u); err != nil {
		return u, fmt.Errorf("%w: update record %d: %w", ErrRelease, v, err)
	}
	return u, nil
}

// OptimName is the file name of the optimizer state after version v.
func OptimName(v int64) string { return fmt.Sprintf("policy-v%08d.optim", v) }

const optimMagic = "trajflow-adam/v1"

// optimBytes encodes the Adam state: magic, steps, n, m1[n], m2[n]
// (little-endian float64), then the SHA-256 of everything before it.
func (t *Trainer) optimBytes() []byte {
	n := len(t.m1)
	b := make([]byte, 0, len(optimMagic)+16+16*n+sha256.Size)
	b = append(b, optimMagic...)
	b = binary.LittleEndian.AppendUint64(b, uint64(t.steps))
	b = binary.LittleEndian.AppendUint64(b, uint64(n))
	for _, v := range t.m1 {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
	}
	for _, v := range t.m2 {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
	}
	h := sha256.Sum256(b)
	return append(b, h[:]...)
}

// setOptim restores the Adam state written by optimBytes.
func (t *Trainer) setOptim(b []byte) error {
	n := len(t.m1)
	want := len(optimMagic) + 16 + 16*n + sha256.Size
	if len(b) != want || string(b[:len(optimMagic)]) != optimMagic {
		return fmt.Errorf("%w: optimizer state of %d bytes, want %d", ErrRelease, len(b), want)
	}
	body := b[:len(b)-sha256.Size]
	if h := sha256.Sum256(body); string(h[:]) != string(b[len(body):]) {
		return fmt.Errorf("%w: optimizer state checksum mismatch", ErrRelease)
	}
	p := body[len(optimMagic):]
	steps := int64(binary.LittleEndian.Uint64(p))
	if int(binary.LittleEndian.Uint64(p[8:])) != n {
		return fmt.Errorf("%w: optimizer state for another model size", ErrRelease)
	}
	p = p[16:]
	for i := range t.m1 {
		t.m1[i] = math.Float64frombits(binary.LittleEndian.Uint64(p[8*i:]))
		t.m2[i] = math.Float64frombits(binary.LittleEndian.Uint64(p[8*(n+i):]))
	}
	t.steps = steps
	return nil
}

// Stage is the train operator (pipeline §12–§14, systems §8): it consumes
// packed batches, recomputes current log-probs on the exact stored tokens,
// takes Epochs optimizer steps with the contract's objective, and
// publishes the new version: checkpoint and manifest under ReleaseDir
// (Release), then the manifest on the compacted policy topic, plus a
// "trained" census event per trajectory.
//
// On its first start (no release on the policy topic) it publishes the
// initial policy, version 0, from Model and ModelSeed, so that dispatch
// and rollout can start.
//
// Exactly-once training: a batch whose index is not above the last one
// trained, or whose id was trained, is skipped; a segment whose trajectory
// id was already trained is masked out (and counted). The state is
// restored at Start from the latest release on the policy topic, its
// update record, and the batches topic. The optimizer state (Adam's
// moments and step count) is written beside every release (OptimName), so
// a restarted trainer continues exactly where the release left off.
type Stage struct {
	cfg       StageConfig
	tr        *Trainer
	lastIndex int64
	batches   map[string]bool
	trained   map[string]bool
	initial   bool // version 0 still to publish
}

// NewStage validates cfg.
func NewStage(cfg StageConfig) (*Stage, error) {
	if err := cfg.Objective.Validate(); err != nil {
		return nil, fmt.Errorf("gpu: train stage: %w", err)
	}
	if err := cfg.Adam.Validate(); err != nil {
		return nil, err
	}
	if err := cfg.Model.Validate(); err != nil {
		return nil, err
	}
	if cfg.Epochs < 1 {
		return nil, fmt.Errorf("gpu: train stage: epochs %d", cfg.Epochs)
	}
	if cfg.ReleaseDir == "" {
		return nil, fmt.Errorf("gpu: train stage: no release directory")
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Meta.Now == nil {
		cfg.Meta.Now = cfg.Now
	}
	return &Stage{cfg: cfg, lastIndex: -1, batches: map[string]bool{}, trained: map[string]bool{}}, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "train" }

// Topics implements pipeline.Stage.
func (s *Stage) Topics() []string { return []string{s.cfg.Topics.Batches} }

// InitialModel is the policy of version 0 for cfg and seed.
func InitialModel(cfg model.Config, seed uint64) (*model.Model, error) { return model.New(cfg, seed) }

// Start restores the trainer from the latest release, or prepares the
// initial one.
func (s *Stage) Start(ctx context.Context, env *pipeline.Env) error {
	if err := os.MkdirAll(s.cfg.ReleaseDir, 0o755); err != nil {
		return fmt.Errorf("gpu: release directory: %w", err)
	}
	var latest *schemas.PolicyRelease
	err := pipeline.ScanTail(ctx, env.Config, s.cfg.Topics.Policy, 0, func(m pipeline.Message) error {
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
		return fmt.Errorf("gpu: rebuild from policy topic: %w", err)
	}
	if latest == nil {
		m, err := InitialModel(s.cfg.Model, s.cfg.ModelSeed)
		if err != nil {
			return err
		}
		if s.tr, err = NewTrainer(m, s.cfg.Behavior, 0); err != nil {
			return err
		}
		s.initial = true
		env.Logger.Info("trainer starts from the initial policy", "version", 0)
		return nil
	}
	m, err := loadModel(*latest)
	if err != nil {
		return err
	}
	if h := m.Config.Hash(); h != latest.ModelConfigHash {
		return fmt.Errorf("%w: version %d: model config hash %s, manifest says %s", ErrRelease, latest.PolicyVersion, h, latest.ModelConfigHash)
	}
	if s.tr, err = NewTrainer(m, s.cfg.Behavior, latest.PolicyVersion); err != nil {
		return err
	}
	s.tr.steps = latest.TrainingStep
	if ob, err := os.ReadFile(filepath.Join(s.cfg.ReleaseDir, OptimName(latest.PolicyVersion))); err == nil {
		if err := s.tr.setOptim(ob); err != nil {
			return err
		}
	} else if latest.PolicyVersion > 0 {
		env.Logger.Warn("no optimizer state beside the release; Adam restarts from zero moments", "version", latest.PolicyVersion, "err", err)
	}
	if latest.PolicyVersion > 0 {
		u, err := ReadUpdate(s.cfg.ReleaseDir, latest.PolicyVersion)
		if err != nil {
			return err
		}
		s.lastIndex = u.BatchIndex
	}
	err = pipeline.ScanTail(ctx, env.Config, s.cfg.Topics.Batches, s.cfg.RebuildScan, func(m pipeline.Message) error {
		b, err := schemas.PackedBatches.Decode(nil, m.Value)
		if err != nil || b.BatchIndex > s.lastIndex {
			return nil
		}
		s.batches[b.BatchID] = true
		for _, row := range b.Rows {
			for _, id := range row.SegTrajectoryIDs {
				s.trained[id] = true
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("gpu: rebuild from batches: %w", err)
	}
	env.Logger.Info("trainer restored", "version", s.tr.Version(), "last_batch", s.lastIndex, "trained_ids", len(s.trained))
	return nil
}

// loadModel reads the verified checkpoint of rel.
func loadModel(rel schemas.PolicyRelease) (*model.Model, error) {
	b, err := os.ReadFile(filepath.FromSlash(trimFile(rel.CheckpointURI)))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrRelease, err)
	}
	return model.LoadVerified(b, rel.CheckpointHash)
}

func trimFile(uri string) string {
	const p = "file://"
	if len(uri) >= len(p) && uri[:len(p)] == p {
		return uri[len(p):]
	}
	return uri
}

// Version is the trainer's current policy version.
func (s *Stage) Version() int64 {
	if s.tr == nil {
		return -1
	}
	return s.tr.Version()
}

// Tick publishes the initial policy once.
func (s *Stage) Tick(_ context.Context, _ time.Time) (pipeline.Result, error) {
	var res pipeline.Result
	if !s.initial {
		return res, nil
	}
	out, err := s.release()
	if err != nil {
		return res, err
	}
	s.initial = false
	res.Outputs = append(res.Outputs, out)
	return res, nil
}

// release writes the current version under ReleaseDir and returns the
// manifest record for the policy topic.
func (s *Stage) release() (pipeline.Output, error) {
	rel, err := s.tr.Release(s.cfg.ReleaseDir, s.cfg.Meta)
	if err != nil {
		return pipeline.Output{}, err
	}
	b, err := schemas.EncodeRelease(rel)
	if err != nil {
		return pipeline.Output{}, fmt.Errorf("%w: %w", ErrRelease, err)
	}
	id := schemas.DerivedID("release", s.cfg.RunID+"/"+strconv.FormatInt(rel.PolicyVersion, 10))
	return pipeline.Output{Topic: s.cfg.Topics.Policy, Key: []byte(s.cfg.RunID), Value: b,
		Headers: stagekit.Headers(schemas.KindPolicyRelease, id)}, nil
}

// Update runs epochs optimizer steps on batch and makes them one policy
// version (FromVersion + 1). It returns the metrics of the first step and
// the objective statistics of the last. It is atomic: on error the
// parameters, optimizer state, step count and version are as before.
func (t *Trainer) Update(batch schemas.PackedBatch, opts objective.Options, adam AdamOptions, epochs int) (Metrics, objective.Stats, error) {
	from, steps := t.version, t.steps
	params := slices.Clone(t.m.Params)
	m1, m2 := slices.Clone(t.m1), slices.Clone(t.m2)
	var first Metrics
	var last objective.Stats
	for e := 0; e < max(1, epochs); e++ {
		met, err := t.Step(batch, opts, adam)
		if err != nil {
			copy(t.m.Params, params)
			copy(t.m1, m1)
			copy(t.m2, m2)
			t.version, t.steps = from, steps
			return Metrics{}, objective.Stats{}, fmt.Errorf("epoch %d: %w", e, err)
		}
		if e == 0 {
			first = met
		}
		last = met.Stats
	}
	t.version = from + 1
	first.Version = t.version
	return first, last, nil
}

// untrainable reports whether err says the batch itself cannot be trained
// (malformed rows, tokens outside the model or its behavior distribution),
// as opposed to a failure of the trainer.
func untrainable(err error) bool {
	for _, e := range []error{ErrBatch, objective.ErrInput, objective.ErrTarget, objective.ErrShape, model.ErrToken, model.ErrShape} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// Process implements pipeline.Stage.
func (s *Stage) Process(_ context.Context, m pipeline.Message) (pipeline.Result, error) {
	var res pipeline.Result
	if s.initial {
		out, err := s.release()
		if err != nil {
			return res, err
		}
		s.initial = false
		res.Outputs = append(res.Outputs, out)
	}
	// A refusal carries the outputs already due (the initial release).
	refuse := func(r *pipeline.Refusal) error {
		r.Also = append(r.Also, res.Outputs...)
		return r
	}
	batch, err := schemas.PackedBatches.Decode(nil, m.Value)
	if err != nil {
		return res, refuse(stagekit.DecodeRefusal(err))
	}
	if s.batches[batch.BatchID] || batch.BatchIndex <= s.lastIndex {
		return res, nil // redelivered: trained already
	}
	if batch.ContractHash != s.cfg.ContractHash {
		return res, refuse(pipeline.Refuse("contract_mismatch", "batch %s of contract %s, trainer runs %s", batch.BatchID, batch.ContractHash, s.cfg.ContractHash))
	}
	dups := 0
	var ids []string
	for ri := range batch.Rows {
		row := &batch.Rows[ri]
		for k, id := range row.SegTrajectoryIDs {
			if !s.trained[id] {
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
	start := time.Now()
	met, last, err := s.tr.Update(batch, s.cfg.Objective, s.cfg.Adam, s.cfg.Epochs)
	if err != nil {
		if untrainable(err) {
			// A batch the policy cannot train on (for example a token
			// outside the behavior distribution) goes to quarantine; the
			// trainer is unchanged and goes on with the next batch.
			return res, refuse(pipeline.Refuse("untrainable_batch", "batch %s: %v", batch.BatchID, err))
		}
		return res, fmt.Errorf("gpu: train batch %s: %w", batch.BatchID, err)
	}
	u := UpdateRecord{Version: s.tr.Version(), BatchID: batch.BatchID, BatchIndex: batch.BatchIndex,
		Metrics: met, Last: last, Duplicates: dups, StepSeconds: time.Since(start).Seconds()}
	ub, err := json.MarshalIndent(u, "", "  ")
	if err != nil {
		return res, fmt.Errorf("gpu: update record: %w", err)
	}
	if err := writeAtomic(filepath.Join(s.cfg.ReleaseDir, UpdateName(u.Version)), ub); err != nil {
		return res, err
	}
	if err := writeAtomic(filepath.Join(s.cfg.ReleaseDir, OptimName(u.Version)), s.tr.optimBytes()); err != nil {
		return res, err
	}
	out, err := s.release()
	if err != nil {
		return res, err
	}
	res.Outputs = append(res.Outputs, out)
	s.lastIndex = batch.BatchIndex
	s.batches[batch.BatchID] = true
	at := s.cfg.Now().UnixMicro()
	for _, id := range ids {
		s.trained[id] = true
		ev, err := stagekit.Census(s.cfg.Topics.Census, schemas.CensusEvent{
			RunID: s.cfg.RunID, AttemptID: id, Kind: schemas.CensusTrained, Stage: s.Name(),
			BatchID: batch.BatchID, Update: batch.BatchIndex, PolicyVersion: u.Version, At: at,
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
