package rollout

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"strconv"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/schemas"
)

// Domain is the domain of every task of the kv family (the demo's).
const Domain = "kv-lookup"

// Task families of the built-in registry. A registry holds the tasks of
// one family; its configuration (RegistryConfig.Family) or the learning
// contract's environment artifact (FamilyOfArtifact) chooses it.
const (
	// FamilyKV: key-value lookup in the built-in token vocabulary (the
	// demo's family; env.go).
	FamilyKV = "kv"
	// FamilyLedger: a ledger with a state-changing transfer tool, in the
	// built-in token vocabulary (ledger.go).
	FamilyLedger = "ledger"
	// FamilyText: arithmetic with a calculator and a key-value lookup tool,
	// in text for language models (text.go).
	FamilyText = "text"
)

// ErrUnknownTask is wrapped when a task id is not in the registry or its
// versions differ from the registry's.
var ErrUnknownTask = errors.New("rollout: unknown task")

// RegistryConfig declares a task registry.
type RegistryConfig struct {
	// Family is FamilyKV (also when empty), FamilyLedger or FamilyText.
	Family      string `json:"family,omitempty" yaml:"family"`
	EnvVersion  string `json:"env_version" yaml:"env_version"`   // enters the hidden tables
	TaskVersion string `json:"task_version" yaml:"task_version"` // version of the task definitions
	Seed        int64  `json:"seed" yaml:"seed"`                 // family salt; enters the hidden tables
	Train       int    `json:"train" yaml:"train"`               // train tasks
	Eval        int    `json:"eval" yaml:"eval"`                 // hidden-eval tasks
	Keys        int    `json:"keys" yaml:"keys"`                 // kv 2..MaxKeys; ledger accounts 3..MaxKeys; text 3..8
	Values      int    `json:"values" yaml:"values"`             // kv 2..MaxValues; ledger balances 3..MaxValues; text 10..1000
}

// DefaultRegistryConfig is the registry of the demo.
func DefaultRegistryConfig() RegistryConfig {
	return RegistryConfig{EnvVersion: "kv-env/v1", TaskVersion: "1", Seed: 1, Train: 256, Eval: 64, Keys: 4, Values: 8}
}

// DefaultFamilyConfig is the default registry of a family ("" is FamilyKV,
// whose default is DefaultRegistryConfig).
func DefaultFamilyConfig(family string) (RegistryConfig, error) {
	switch family {
	case "", FamilyKV:
		return DefaultRegistryConfig(), nil
	case FamilyLedger:
		return RegistryConfig{Family: FamilyLedger, EnvVersion: "ledger-env/v1", TaskVersion: "1", Seed: 1, Train: 256, Eval: 64, Keys: 4, Values: 8}, nil
	case FamilyText:
		return RegistryConfig{Family: FamilyText, EnvVersion: "text-env/v1", TaskVersion: "1", Seed: 1, Train: 256, Eval: 64, Keys: 6, Values: 100}, nil
	}
	return RegistryConfig{}, fmt.Errorf("rollout: registry: unknown family %q (have %q, %q, %q)", family, FamilyKV, FamilyLedger, FamilyText)
}

// Task is what the agent loop may know of a task: identity, versions,
// split and the key the prompt names (kv: the key to look up; ledger: the
// destination account; text: the task kind). The hidden parts stay inside
// the Registry.
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

// Registry holds the tasks of both splits of one family. It is immutable
// and safe for concurrent use. It is also the in-process Environment of its
// family (Reset).
type Registry struct {
	cfg    RegistryConfig
	fam    family
	tasks  map[string]Task
	hidden map[string]hidden // FamilyKV
	train  []Task
	eval   []Task
}

// family is the part of a registry that differs between task families.
type family interface {
	name() string
	domain() string
	// check validates the family's part of the configuration.
	check(cfg RegistryConfig) error
	// derive builds task id's hidden part from its hash h and returns
	// the task's public prompt key (Task.Key).
	derive(id string, h [32]byte) int32
	grammar() model.Grammar
	spec() Spec
	reset(t Task) (Episode, Observation)
	resume(t Task, state []byte) (Episode, error)
	// judge is the family's trusted validator: the verdict, the evidence
	// (JSON-encodable) or an error when the trajectory cannot be judged.
	judge(task Task, t *schemas.Trajectory) (bool, any, error)
	evaluator() string
}

// NewRegistry builds the registry of cfg.Family: train task i has id
// "<family>-train-%05d", eval task i "<family>-eval-%05d" (the kv family:
// "kv-train-%05d"), so the splits are disjoint by construction. Each
// task's public prompt and hidden part are derived from SHA-256(family,
// seed, env version, task id): the same configuration gives the same tasks
// in every process.
func NewRegistry(cfg RegistryConfig) (*Registry, error) {
	r := &Registry{cfg: cfg, tasks: map[string]Task{}, hidden: map[string]hidden{}}
	switch cfg.Family {
	case "", FamilyKV:
		r.fam = kvFamily{r: r}
	case FamilyLedger:
		r.fam = &ledgerFamily{cfg: cfg, hidden: map[string]ledgerHidden{}}
	case FamilyText:
		r.fam = &textFamily{cfg: cfg, hidden: map[string]textHidden{}}
	default:
		_, err := DefaultFamilyConfig(cfg.Family)
		return nil, err
	}
	if err := r.fam.check(cfg); err != nil {
		return nil, err
	}
	switch {
	case cfg.Train < 0 || cfg.Eval < 0 || cfg.Train+cfg.Eval == 0:
		return nil, fmt.Errorf("rollout: registry: %d train and %d eval tasks", cfg.Train, cfg.Eval)
	case cfg.EnvVersion == "" || cfg.TaskVersion == "":
		return nil, fmt.Errorf("rollout: registry: empty env or task version")
	}
	fam := r.fam
	prefix := fam.name()
	add := func(split string, i int) Task {
		id := fmt.Sprintf("%s-%s-%05d", prefix, split, i)
		h := sha256.Sum256([]byte("trajflow/" + prefix + "-task/v1:" + strconv.FormatInt(cfg.Seed, 10) + ":" + cfg.EnvVersion + ":" + id))
		key := fam.derive(id, h)
		t := Task{ID: id, Version: cfg.TaskVersion, Domain: fam.domain(), Split: split, EnvVersion: cfg.EnvVersion, Key: key}
		r.tasks[id] = t
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

// kvFamily is the key-value lookup family (env.go). Its hidden tables live
// in Registry.hidden.
type kvFamily struct{ r *Registry }

func (kvFamily) name() string   { return FamilyKV }
func (kvFamily) domain() string { return Domain }

func (kvFamily) check(cfg RegistryConfig) error {
	switch {
	case cfg.Keys < 2 || cfg.Keys > MaxKeys:
		return fmt.Errorf("rollout: registry: keys %d not in [2, %d]", cfg.Keys, MaxKeys)
	case cfg.Values < 2 || cfg.Values > MaxValues:
		return fmt.Errorf("rollout: registry: values %d not in [2, %d]", cfg.Values, MaxValues)
	}
	return nil
}

func (f kvFamily) derive(id string, h [32]byte) int32 {
	cfg := f.r.cfg
	key := int32(h[0]) % int32(cfg.Keys)
	hd := hidden{table: make([]int32, cfg.Keys)}
	for k := range hd.table {
		hd.table[k] = int32(h[1+k]) % int32(cfg.Values)
	}
	hd.forbidden = (key + 1 + int32(h[1+MaxKeys])%int32(cfg.Keys-1)) % int32(cfg.Keys)
	f.r.hidden[id] = hd
	return key
}

func (f kvFamily) grammar() model.Grammar {
	return Grammar{Keys: f.r.cfg.Keys, Values: f.r.cfg.Values}
}

func (kvFamily) evaluator() string { return EvalSuccess }

// Family returns the registry's family (FamilyKV, FamilyLedger or
// FamilyText).
func (r *Registry) Family() string { return r.fam.name() }

// Config returns the registry's configuration.
func (r *Registry) Config() RegistryConfig { return r.cfg }

// Grammar returns the constrained-decoding grammar of the registry's
// tasks: the kv grammar (Grammar), the ledger grammar (LedgerGrammar), or
// nil for the text family (a language model's sampler has no built-in
// grammar).
func (r *Registry) Grammar() model.Grammar { return r.fam.grammar() }

// Spec returns the episode spec of the registry's family.
func (r *Registry) Spec() Spec { return r.fam.spec() }

// Train returns the train split in id order (a copy).
func (r *Registry) Train() []Task { return append([]Task(nil), r.train...) }

// Eval returns the hidden-eval split in id order (a copy). Dispatch must
// never route these to training (docs/PIPELINE.md §6 denylist); pack refuses them.
func (r *Registry) Eval() []Task { return append([]Task(nil), r.eval...) }

// IsEval reports whether id is a hidden-eval task id (the denylist of
// docs/PIPELINE.md §6).
func (r *Registry) IsEval(id string) bool {
	t, ok := r.tasks[id]
	return ok && t.Split == schemas.SplitEval
}

// Lookup returns the task of id.
func (r *Registry) Lookup(id string) (Task, bool) {
	t, ok := r.tasks[id]
	return t, ok
}

// lookup returns the task and its kv hidden part, checking the versions a
// record declares.
func (r *Registry) lookup(id, taskVersion, envVersion string) (Task, hidden, error) {
	t, err := r.task(id, taskVersion, envVersion)
	if err != nil {
		return Task{}, hidden{}, err
	}
	return t, r.hidden[id], nil
}

// task returns the task of id, checking the versions a record declares.
func (r *Registry) task(id, taskVersion, envVersion string) (Task, error) {
	t, ok := r.tasks[id]
	if !ok {
		return Task{}, fmt.Errorf("%w: %q", ErrUnknownTask, id)
	}
	if taskVersion != t.Version || envVersion != t.EnvVersion {
		return Task{}, fmt.Errorf("%w: %q at task version %q env version %q, registry has %q %q",
			ErrUnknownTask, id, taskVersion, envVersion, t.Version, t.EnvVersion)
	}
	return t, nil
}

// attemptTask returns the task of attempt a, checking its versions and
// split.
func (r *Registry) attemptTask(a schemas.TaskAttempt) (Task, error) {
	t, err := r.task(a.TaskID, a.TaskVersion, a.EnvVersion)
	if err != nil {
		return Task{}, err
	}
	if a.Split != t.Split {
		return Task{}, fmt.Errorf("%w: attempt %s declares split %q, task %s is %q", ErrUnknownTask, a.AttemptID, a.Split, t.ID, t.Split)
	}
	return t, nil
}

// Attempts returns the attempts of one group of G members of task t
// (docs/PIPELINE.md §6): ids from schemas.GroupID/AttemptID, member seeds from
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

func (f kvFamily) judge(task Task, t *schemas.Trajectory) (bool, any, error) {
	ev, err := (&Validator{reg: f.r}).judge(task, t)
	return ev.Success, ev, err
}
