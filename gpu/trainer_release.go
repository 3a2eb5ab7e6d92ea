package gpu

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/schemas"
)

// ErrRelease is wrapped by errors of releasing or loading a policy.
var ErrRelease = errors.New("gpu: policy release")

// ReleaseMeta is what a release records besides the weights (systems §8).
type ReleaseMeta struct {
	TokenizerHash    string
	ChatTemplateHash string
	SamplerContract  string // the sampler settings id (model.Settings.ID)
	ContractHash     string
	// Now stamps CreatedAt; nil means time.Now.
	Now func() time.Time
}

// CheckpointName is the file name of the checkpoint of a policy version.
func CheckpointName(version int64) string { return fmt.Sprintf("policy-v%08d.ckpt", version) }

// ManifestName is the file name of the manifest of a policy version.
func ManifestName(version int64) string { return fmt.Sprintf("policy-v%08d.json", version) }

// Release publishes the current policy under dir (systems §8 "Publication
// protocol"): the checkpoint is written to a temporary file in dir, fsynced,
// hashed (sha256 of its bytes) and renamed atomically to
// CheckpointName(version); the directory is fsynced; then the manifest is
// written the same way to ManifestName(version), with Ready = true. A
// reader that sees the manifest therefore sees a complete checkpoint. The
// returned release is the manifest.
func (t *Trainer) Release(dir string, meta ReleaseMeta) (schemas.PolicyRelease, error) {
	b, err := t.m.Bytes()
	if err != nil {
		return schemas.PolicyRelease{}, fmt.Errorf("%w: %w", ErrRelease, err)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return schemas.PolicyRelease{}, fmt.Errorf("%w: %w", ErrRelease, err)
	}
	ckpt := filepath.Join(abs, CheckpointName(t.version))
	if err := writeAtomic(ckpt, b); err != nil {
		return schemas.PolicyRelease{}, err
	}
	now := meta.Now
	if now == nil {
		now = time.Now
	}
	rel := schemas.PolicyRelease{
		PolicyVersion:    t.version,
		TrainingStep:     t.steps,
		CheckpointHash:   model.HashBytes(b),
		CheckpointURI:    "file://" + filepath.ToSlash(ckpt),
		ModelConfigHash:  t.m.Config.Hash(),
		TokenizerHash:    meta.TokenizerHash,
		ChatTemplateHash: meta.ChatTemplateHash,
		SamplerContract:  meta.SamplerContract,
		ContractHash:     meta.ContractHash,
		CreatedAt:        now().UTC().Format(time.RFC3339),
		Ready:            true,
	}
	js, err := json.MarshalIndent(rel, "", "  ")
	if err != nil {
		return schemas.PolicyRelease{}, fmt.Errorf("%w: %w", ErrRelease, err)
	}
	if err := writeAtomic(filepath.Join(abs, ManifestName(t.version)), js); err != nil {
		return schemas.PolicyRelease{}, err
	}
	return rel, nil
}

// writeAtomic writes b to a temporary file beside path, fsyncs it, renames
// it to path and fsyncs the directory.
func writeAtomic(path string, b []byte) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return fmt.Errorf("%w: %w", ErrRelease, err)
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			os.Remove(tmp)
		}
	}()
	if _, err = f.Write(b); err != nil {
		f.Close()
		return fmt.Errorf("%w: write %s: %w", ErrRelease, tmp, err)
	}
	if err = f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("%w: fsync %s: %w", ErrRelease, tmp, err)
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("%w: close %s: %w", ErrRelease, tmp, err)
	}
	if err = os.Rename(tmp, path); err != nil {
		return fmt.Errorf("%w: rename to %s: %w", ErrRelease, path, err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("%w: open dir %s: %w", ErrRelease, dir, err)
	}
	defer d.Close()
	if err = d.Sync(); err != nil {
		return fmt.Errorf("%w: fsync dir %s: %w", ErrRelease, dir, err)
	}
	return nil
}

// LoadRelease loads the policy of a release into a new snapshot (a
// rollout worker's shadow slot, systems §8): the manifest must be Ready,
// the checkpoint at CheckpointURI (file:// or a plain path) must hash to
// CheckpointHash, and its architecture to ModelConfigHash. Any mismatch is
// an error wrapping ErrRelease and nothing is returned; the caller keeps
// serving its current version.
func LoadRelease(rel schemas.PolicyRelease) (*model.Policy, error) {
	if !rel.Ready {
		return nil, fmt.Errorf("%w: version %d is not ready", ErrRelease, rel.PolicyVersion)
	}
	path := strings.TrimPrefix(rel.CheckpointURI, "file://")
	b, err := os.ReadFile(filepath.FromSlash(path))
	if err != nil {
		return nil, fmt.Errorf("%w: version %d: %w", ErrRelease, rel.PolicyVersion, err)
	}
	m, err := model.LoadVerified(b, rel.CheckpointHash)
	if err != nil {
		return nil, fmt.Errorf("%w: version %d: %w", ErrRelease, rel.PolicyVersion, err)
	}
	if h := m.Config.Hash(); h != rel.ModelConfigHash {
		return nil, fmt.Errorf("%w: version %d: model config hash %s, manifest says %s", ErrRelease, rel.PolicyVersion, h, rel.ModelConfigHash)
	}
	return model.NewPolicy(m, rel.PolicyVersion), nil
}
