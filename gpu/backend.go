package gpu

import (
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

// Backend is a trainer implementation the train stage drives: the CPU
// reference (*Trainer, always built) or a device backend (gpu/cuda in a
// build with the cuda tag). Every backend trains the same objective on the
// same exact tokens and publishes the same releases.
type Backend interface {
	// Version is the policy version of the current parameters; Steps the
	// optimizer steps taken so far.
	Version() int64
	Steps() int64
	// SetSteps restores the step count of a release.
	SetSteps(n int64)
	// Update takes epochs optimizer steps on batch and makes them one
	// policy version (Version()+1). It returns the metrics of the first
	// step and the objective statistics of the last. On error the
	// parameters and optimizer state are as before (Untrainable(err)
	// tells a batch the policy cannot train from a failure of the
	// backend).
	Update(batch schemas.PackedBatch, opts objective.Options, adam AdamOptions, epochs int) (Metrics, objective.Stats, error)
	// Release publishes the current parameters in files (docs/SYSTEMS.md §8).
	Release(files Files, meta ReleaseMeta) (schemas.PolicyRelease, error)
	// OptimState and SetOptimState save and restore the optimizer state
	// written beside every release.
	OptimState() []byte
	SetOptimState(b []byte) error
	// Close frees the backend's resources.
	Close() error
}

// ObjectiveChecker is implemented by a backend that trains only some
// objectives: CheckObjective returns an error naming the contract fields
// it does not implement (a device backend's ErrUnsupported) rather than
// ignoring them. The train stage calls it when it starts the backend; the
// CPU reference implements every objective.
type ObjectiveChecker interface {
	CheckObjective(opts objective.Options) error
}

// BackendFactory starts a backend from model m at policy version, training
// the behavior distribution b.
type BackendFactory func(m *model.Model, b model.Behavior, version int64) (Backend, error)

// CPUBackend is the BackendFactory of the CPU reference trainer.
func CPUBackend(m *model.Model, b model.Behavior, version int64) (Backend, error) {
	return NewTrainer(m, b, version)
}

// Close implements Backend (the CPU trainer holds nothing to free).
func (t *Trainer) Close() error { return nil }

var _ Backend = (*Trainer)(nil)
