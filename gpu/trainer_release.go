package gpu

import (
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/regfile"
	"github.com/trajflow/trajflow/schemas"
)

// ErrRelease is wrapped by errors of releasing or loading a policy.
var ErrRelease = errors.New("gpu: policy release")

// ReleaseMeta is what a release records besides the weights (docs/SYSTEMS.md §8).
type ReleaseMeta struct {
	TokenizerHash    string
	ChatTemplateHash string
	SamplerContract  string // the sampler settings id (model.Settings.ID)
	ContractHash     string
	// NextBatch, CurriculumVersion and RewardVersion are recorded in the
	// manifest (schemas.PolicyRelease).
	NextBatch         int64
	CurriculumVersion string
	RewardVersion     string
	// Now stamps CreatedAt; nil means time.Now.
	Now func() time.Time
}

// CheckpointName is the file name of the checkpoint of a policy version.
func CheckpointName(version int64) string { return fmt.Sprintf("policy-v%08d.ckpt", version) }

// ManifestName is the file name of the manifest of a policy version.
func ManifestName(version int64) string { return fmt.Sprintf("policy-v%08d.json", version) }

// Files is where a trainer keeps its release files (pipeline.ReleaseStore
// implements it): Write is atomic (temporary file, fsync, rename,
// directory fsync), so a reader sees a whole file or none.
type Files interface {
	Write(name string, data []byte) (uri string, err error)
	Read(nameOrURI string) ([]byte, error)
}

// Release publishes the current policy in files (ReleaseModel).
func (t *Trainer) Release(files Files, meta ReleaseMeta) (schemas.PolicyRelease, error) {
	return ReleaseModel(files, t.m, t.version, t.steps, meta)
}

// ReleaseModel publishes model m as policy version `version` after `steps`
// optimizer steps in files (docs/SYSTEMS.md §8 "Publication protocol"): the
// checkpoint is written atomically under CheckpointName(version) and
// hashed (sha256 of its bytes), then the manifest, with Ready = true, under
// ManifestName(version). A reader that sees the manifest therefore sees a
// complete checkpoint. The returned release is the manifest. Every backend
// publishes through it (the CPU trainer with its model, a device backend
// with the parameters it downloaded), so releases do not depend on the
// device that trained them.
func ReleaseModel(files Files, m *model.Model, version, steps int64, meta ReleaseMeta) (schemas.PolicyRelease, error) {
	b, err := m.Bytes()
	if err != nil {
		return schemas.PolicyRelease{}, fmt.Errorf("%w: %w", ErrRelease, err)
	}
	uri, err := files.Write(CheckpointName(version), b)
	if err != nil {
		return schemas.PolicyRelease{}, fmt.Errorf("%w: %w", ErrRelease, err)
	}
	now := meta.Now
	if now == nil {
		now = time.Now
	}
	rel := schemas.PolicyRelease{
		PolicyVersion:     version,
		TrainingStep:      steps,
		CheckpointHash:    model.HashBytes(b),
		CheckpointURI:     uri,
		ModelConfigHash:   m.Config.Hash(),
		TokenizerHash:     meta.TokenizerHash,
		ChatTemplateHash:  meta.ChatTemplateHash,
		SamplerContract:   meta.SamplerContract,
		ContractHash:      meta.ContractHash,
		CreatedAt:         now().UTC().Format(time.RFC3339),
		Ready:             true,
		NextBatch:         meta.NextBatch,
		CurriculumVersion: meta.CurriculumVersion,
		RewardVersion:     meta.RewardVersion,
	}
	js, err := json.MarshalIndent(rel, "", "  ")
	if err != nil {
		return schemas.PolicyRelease{}, fmt.Errorf("%w: %w", ErrRelease, err)
	}
	if _, err := files.Write(ManifestName(version), js); err != nil {
		return schemas.PolicyRelease{}, fmt.Errorf("%w: %w", ErrRelease, err)
	}
	return rel, nil
}

// LoadRelease loads the policy of a release into a new snapshot (a
// rollout worker's shadow slot, docs/SYSTEMS.md §8): the manifest must be Ready,
// the checkpoint at CheckpointURI (file:// or a plain path) must hash to
// CheckpointHash, and its architecture to ModelConfigHash. Any mismatch is
// an error wrapping ErrRelease and nothing is returned; the caller keeps
// serving its current version. The checkpoint must be a regular file of
// at most model.MaxCheckpointBytes: a device or a pipe the URI names is
// refused, never read until it ends.
func LoadRelease(rel schemas.PolicyRelease) (*model.Policy, error) {
	path := filepath.FromSlash(strings.TrimPrefix(rel.CheckpointURI, "file://"))
	b, err := regfile.Read(path, model.MaxCheckpointBytes)
	var bad *regfile.Error
	if errors.As(err, &bad) {
		return nil, fmt.Errorf("%w: version %d: checkpoint %s: %w", ErrRelease, rel.PolicyVersion, path, err)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: version %d: %w", ErrRelease, rel.PolicyVersion, err)
	}
	return PolicyFromRelease(rel, b)
}

// PolicyFromRelease makes the policy snapshot of a release from the bytes
// of its checkpoint, checking what LoadRelease checks.
func PolicyFromRelease(rel schemas.PolicyRelease, b []byte) (*model.Policy, error) {
	m, err := ModelFromRelease(rel, b)
	if err != nil {
		return nil, err
	}
	return model.NewPolicy(m, rel.PolicyVersion), nil
}

// ModelFromRelease verifies a release's checkpoint bytes (ready manifest,
// checkpoint hash, model config hash) and returns its model.
func ModelFromRelease(rel schemas.PolicyRelease, b []byte) (*model.Model, error) {
	if !rel.Ready {
		return nil, fmt.Errorf("%w: version %d is not ready", ErrRelease, rel.PolicyVersion)
	}
	m, err := model.LoadVerified(b, rel.CheckpointHash)
	if err != nil {
		return nil, fmt.Errorf("%w: version %d: %w", ErrRelease, rel.PolicyVersion, err)
	}
	if h := m.Config.Hash(); h != rel.ModelConfigHash {
		return nil, fmt.Errorf("%w: version %d: model config hash %s, manifest says %s", ErrRelease, rel.PolicyVersion, h, rel.ModelConfigHash)
	}
	return m, nil
}
