package rollout

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"strconv"

	"github.com/trajflow/trajflow/schemas"
)

// Domain is the domain of every task of the family.
const Domain = "kv-lookup"

// ErrUnknownTask is wrapped when a task id is not in the registry or its
// versions differ from the registry's.
var ErrUnknownTask = errors.New("rollout: unknown task")

// RegistryConfig declares a task registry.
type RegistryConfig struct {
	EnvVersion  string `json:"env_version" yaml:"env_version"`   // enters the hidden tables
	TaskVersion string `json:"task_version" yaml:"task_version"` // version of the task definitions
	Seed        int64  `json:"seed" yaml:"seed"`                 // family salt; enters the hidden tables
	Train       int    `json:"train" yaml:"train"`               // train tasks
	Eval        int    `json:"eval" yaml:"eval"`                 // hidden-eval tasks
	Keys        int    `json:"keys" yaml:"keys"`                 // 2..MaxKeys
	Values      int    `json:"values" yaml:"values"`             // 2..MaxValues
}

// DefaultRegistryConfig is the registry of the demo.
func DefaultRegistryConfig() RegistryConfig {
	return RegistryConfig{EnvVersion: "kv-env/v1", TaskVersion: "1", Seed: 1, Train: 256, Eval: 64, Keys: 4, Values: 8}
}

// Task is what the agent loop may know of a task: identity, versions,
// split and the key the prompt names. The hidden table and the forbidden
// key stay inside the Registry.
type Task struct {
	ID         string
	Version    string
	Domain     string
	Split      string // schemas.SplitTrain or schemas.SplitEval
	EnvVersion string
	Key        int32 // the key the prompt names
}

// hidden is the part of a task only the environment, the authorizer and
// the validator see.
type hidden struct {
	table     []int32 // value index of every key
	forbidden int32   // the key whose lookup is denied (never Key)
}

// Registry holds the tasks of both splits. It is immutable and safe for
// concurrent use.
type Registry struct {
	cfg    RegistryConfig
	tasks  map[string]Task
	hidden map[string]hidden
	train  []Task
	eval   []Task
}

// NewRegistry builds the registry: train task i has id "kv-train-%05d",
// eval task i "kv-eval-%05d", so the splits are disjoint by construction.
// Each task's prompt key, table and forbidden key are derived from
// SHA-256(seed, env version, task id): the same configuration gives the
// same tasks in every process.
func NewRegistry(cfg RegistryConfig) (*Registry, error) {
	switch {
	case cfg.Keys < 2 || cfg.Keys > MaxKeys:
		return nil, fmt.Errorf("rollout: registry: keys %d not in [2, %d]", cfg.Keys, MaxKeys)
	case cfg.Values < 2 || cfg.Values > MaxValues:
		return nil, fmt.Errorf("rollout: registry: values %d not in [2, %d]", cfg.Values, MaxValues)
	case cfg.Train < 0 || cfg.Eval < 0 || cfg.Train+cfg.Eval == 0:
		return nil, fmt.Errorf("rollout: registry: %d train and %d eval tasks", cfg.Train, cfg.Eval)
	case cfg.EnvVersion == "" || cfg.TaskVersion == "":
		return nil, fmt.Errorf("rollout: registry: empty env or task version")
	}
	r := &Registry{cfg: cfg, tasks: map[string]Task{}, hidden: map[string]hidden{}}
	add := func(split string, i int) Task {
		id := fmt.Sprintf("kv-%s-%05d", split, i)
		h := sha256.Sum256([]byte("trajflow/kv-task/v1:" + strconv.FormatInt(cfg.Seed, 10) + ":" + cfg.EnvVersion + ":" + id))
		key := int32(h[0]) % int32(cfg.Keys)
		hd := hidden{table: make([]int32, cfg.Keys)}
		for k := range hd.table {
			hd.table[k] = int32(h[1+k]) % int32(cfg.Values)
		}
		hd.forbidden = (key + 1 + int32(h[1+MaxKeys])%int32(cfg.Keys-1)) % int32(cfg.Keys)
		t := Task{ID: id, Version: cfg.TaskVersion, Domain: Domain, Split: split, EnvVersion: cfg.EnvVersion, Key: key}
		r.tasks[id] = t
		r.hidden[id] = hd
		return t
	}
	for i := 0; i < cfg.Train; i++ {
		r.train = append(r.train, add(schemas.SplitTrain, i))
	}
	for i := 0; i < cfg.Eval; i++ {
		r.eval = append(r.eval, add(schemas.SplitEval, i))
	}
	return r, nil
}

// Config returns the registry's configuration.
func (r *Registry) Config() RegistryConfig { return r.cfg }

// Grammar returns the decoding grammar of the registry's tasks.
func (r *Registry) Grammar() Grammar { return Grammar{Keys: r.cfg.Keys, Values: r.cfg.Values} }

// Train returns the train split in id order (a copy).
func (r *Registry) Train() []Task { return append([]Task(nil), r.train...) }

// Eval returns the hidden-eval split in id order (a copy). Dispatch must
// never route these to training (pipeline §6 denylist); pack refuses them.
func (r *Registry) Eval() []Task { return append([]Task(nil), r.eval...) }

// IsEval reports whether id is a hidden-eval task id (the denylist of
// pipeline §6).
func (r *Registry) IsEval(id string) bool {
	t, ok := r.tasks[id]
	return ok && t.Split == schemas.SplitEval
}

// Lookup returns the task of id.
func (r *Registry) Lookup(id string) (Task, bool) {
	t, ok := r.tasks[id]
	return t, ok
}

// lookup returns the task and its hidden part, checking the versions a
// record declares.
func (r *Registry) lookup(id, taskVersion, envVersion string) (Task, hidden, error) {
	t, ok := r.tasks[id]
	if !ok {
		return Task{}, hidden{}, fmt.Errorf("%w: %q", ErrUnknownTask, id)
	}
	if taskVersion != t.Version || envVersion != t.EnvVersion {
		return Task{}, hidden{}, fmt.Errorf("%w: %q at task version %q env version %q, registry has %q %q",
			ErrUnknownTask, id, taskVersion, envVersion, t.Version, t.EnvVersion)
	}
	return t, r.hidden[id], nil
}

// Attempts returns the attempts of one group of G members of task t
// (pipeline §6): ids from schemas.GroupID/AttemptID, member seeds from
// schemas.SeedFor, and the behavior policy version attached.
func Attempts(runID string, t Task, groupIndex int64, g int32, contractSeed, policyVersion int64, contractHash string) []schemas.TaskAttempt {
	gid := schemas.GroupID(runID, t.ID, groupIndex)
	out := make([]schemas.TaskAttempt, g)
	for m := int32(0); m < g; m++ {
		aid := schemas.AttemptID(runID, t.ID, gid, m, 0)
		out[m] = schemas.TaskAttempt{
			AttemptID: aid, RunID: runID, TaskID: t.ID, TaskVersion: t.Version, Domain: t.Domain,
			Split: t.Split, EnvVersion: t.EnvVersion, GroupID: gid, GroupSize: g, Member: m,
			Seed: int64(schemas.SeedFor(contractSeed, aid, "env")), PolicyVersion: policyVersion,
			ContractHash: contractHash,
		}
	}
	return out
}
