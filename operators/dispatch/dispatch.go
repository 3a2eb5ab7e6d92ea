// Package dispatch is the dispatcher of docs/PIPELINE.md §6: for every update round
// it draws tasks from the train split of a task registry (task weights,
// per-domain quotas), reserves the membership of each group, attaches the
// behavior policy version and emits the attempts on the tasks topic. Its
// plan is a pure function of the contract seed and the round index, so a
// redelivered or re-planned round reproduces the same attempt ids and seeds.
package dispatch

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"strconv"

	"github.com/trajflow/trajflow/schemas"
)

// ErrConfig is wrapped by errors of a dispatcher configuration.
var ErrConfig = errors.New("dispatch: bad configuration")

// ErrDenied is wrapped when a task on the hidden-evaluation denylist would
// be dispatched for training (docs/PIPELINE.md §6: eval ids are refused).
var ErrDenied = errors.New("dispatch: task on the evaluation denylist")

// Task is one dispatchable task of the train split.
type Task struct {
	ID          string
	Version     string
	Domain      string
	Split       string // must be schemas.SplitTrain
	EnvVersion  string
	Weight      float64 // relative draw weight; 0 means 1
	Description string  // free text, not used for planning
}

// Planner draws the groups of each round. It is immutable and safe for
// concurrent use.
type Planner struct {
	runID        string
	contractHash string
	seed         int64
	tasks        []Task
	tasksPer     int
	groupsPer    int
	groupSize    int32
	quota        map[string]int // domain -> most groups per round
}

// PlannerConfig configures a Planner.
type PlannerConfig struct {
	RunID        string
	ContractHash string
	Seed         int64  // the contract seed
	Tasks        []Task // the train split; order does not matter
	// Denylist reports hidden-evaluation task ids; a task on it (or of
	// split eval) makes NewPlanner fail with ErrDenied.
	Denylist func(taskID string) bool
	// TasksPerRound distinct tasks get GroupsPerRound/TasksPerRound groups
	// each; GroupSize attempts per group.
	TasksPerRound  int
	GroupsPerRound int
	GroupSize      int32
	// DomainQuotas caps the share of a round's groups per domain (domain
	// -> fraction in (0, 1]); domains without a quota are uncapped.
	DomainQuotas map[string]float64
}

// NewPlanner validates cfg. Every task must be of the train split and off
// the denylist: the denylist is enforced here, before anything is drawn.
func NewPlanner(cfg PlannerConfig) (*Planner, error) {
	switch {
	case cfg.RunID == "":
		return nil, fmt.Errorf("%w: empty run id", ErrConfig)
	case cfg.TasksPerRound < 1 || cfg.GroupsPerRound < 1 || cfg.GroupsPerRound%cfg.TasksPerRound != 0:
		return nil, fmt.Errorf("%w: %d groups over %d tasks per round", ErrConfig, cfg.GroupsPerRound, cfg.TasksPerRound)
	case cfg.GroupSize < 1:
		return nil, fmt.Errorf("%w: group size %d", ErrConfig, cfg.GroupSize)
	}
	p := &Planner{
		runID: cfg.RunID, contractHash: cfg.ContractHash, seed: cfg.Seed,
		tasksPer: cfg.TasksPerRound, groupsPer: cfg.GroupsPerRound, groupSize: cfg.GroupSize,
		quota: map[string]int{},
	}
	seen := map[string]bool{}
	for _, t := range cfg.Tasks {
		if t.ID == "" || seen[t.ID] {
			return nil, fmt.Errorf("%w: task id %q empty or repeated", ErrConfig, t.ID)
		}
		seen[t.ID] = true
		if t.Split != schemas.SplitTrain || (cfg.Denylist != nil && cfg.Denylist(t.ID)) {
			return nil, fmt.Errorf("%w: %s (split %q)", ErrDenied, t.ID, t.Split)
		}
		if t.Weight < 0 || math.IsNaN(t.Weight) || math.IsInf(t.Weight, 0) {
			return nil, fmt.Errorf("%w: task %s weight %v", ErrConfig, t.ID, t.Weight)
		}
		if t.Weight == 0 {
			t.Weight = 1
		}
		p.tasks = append(p.tasks, t)
	}
	sort.Slice(p.tasks, func(i, j int) bool { return p.tasks[i].ID < p.tasks[j].ID })
	per := cfg.GroupsPerRound / cfg.TasksPerRound
	for d, q := range cfg.DomainQuotas {
		if !(q > 0 && q <= 1) {
			return nil, fmt.Errorf("%w: quota of domain %q is %v", ErrConfig, d, q)
		}
		p.quota[d] = int(math.Floor(q*float64(cfg.GroupsPerRound)+1e-9)) / per // tasks of the domain per round
	}
	// The quotas must leave enough tasks to fill a round.
	avail := map[string]int{}
	for _, t := range p.tasks {
		avail[t.Domain]++
	}
	fill := 0
	for d, n := range avail {
		if q, ok := p.quota[d]; ok {
			n = min(n, q)
		}
		fill += n
	}
	if fill < cfg.TasksPerRound {
		return nil, fmt.Errorf("%w: the quotas and the %d tasks allow %d distinct tasks per round, need %d",
			ErrConfig, len(p.tasks), fill, cfg.TasksPerRound)
	}
	return p, nil
}

// GroupsPerRound is the number of groups of every round.
func (p *Planner) GroupsPerRound() int { return p.groupsPer }

// Group is one planned group: its index in the run, its task and the id.
type Group struct {
	Round   int64
	Index   int64 // round*GroupsPerRound + position in the round
	Task    Task
	GroupID string
}

// Plan draws the groups of round r: TasksPerRound distinct tasks, by
// weight without replacement from a PCG stream seeded with
// schemas.SeedFor(seed, "round/<r>", "dispatch"), skipping domains whose
// quota is reached; each task gets GroupsPerRound/TasksPerRound
// consecutive groups. The result depends only on the configuration and r.
func (p *Planner) Plan(r int64) []Group {
	s := schemas.SeedFor(p.seed, "round/"+strconv.FormatInt(r, 10), "dispatch")
	rng := rand.New(rand.NewPCG(s, s^0x9e3779b97f4a7c15))
	left := make([]bool, len(p.tasks))
	for i := range left {
		left[i] = true
	}
	used := map[string]int{}
	per := p.groupsPer / p.tasksPer
	out := make([]Group, 0, p.groupsPer)
	for len(out) < p.groupsPer {
		total := 0.0
		for i, t := range p.tasks {
			if left[i] && p.domainOpen(t.Domain, used) {
				total += t.Weight
			}
		}
		u := rng.Float64() * total
		pick := -1
		for i, t := range p.tasks {
			if !left[i] || !p.domainOpen(t.Domain, used) {
				continue
			}
			pick = i
			if u < t.Weight {
				break
			}
			u -= t.Weight
		}
		left[pick] = false
		t := p.tasks[pick]
		used[t.Domain]++
		for k := 0; k < per; k++ {
			idx := r*int64(p.groupsPer) + int64(len(out))
			out = append(out, Group{Round: r, Index: idx, Task: t, GroupID: schemas.GroupID(p.runID, t.ID, idx)})
		}
	}
	return out
}

func (p *Planner) domainOpen(d string, used map[string]int) bool {
	q, ok := p.quota[d]
	return !ok || used[d] < q
}

// Attempts returns the attempts of group g at behavior version
// policyVersion (docs/PIPELINE.md §6): attempt ids schemas.AttemptID(run, task,
// group, member, 0), member seeds schemas.SeedFor(seed, attempt id,
// "env"), dispatched at dispatchedAt (unix microseconds).
func (p *Planner) Attempts(g Group, policyVersion, dispatchedAt int64) []schemas.TaskAttempt {
	out := make([]schemas.TaskAttempt, p.groupSize)
	for m := int32(0); m < p.groupSize; m++ {
		aid := schemas.AttemptID(p.runID, g.Task.ID, g.GroupID, m, 0)
		out[m] = schemas.TaskAttempt{
			AttemptID: aid, RunID: p.runID, TaskID: g.Task.ID, TaskVersion: g.Task.Version, Domain: g.Task.Domain,
			Split: g.Task.Split, EnvVersion: g.Task.EnvVersion, GroupID: g.GroupID, GroupSize: p.groupSize, Member: m,
			Seed: int64(schemas.SeedFor(p.seed, aid, "env")), PolicyVersion: policyVersion,
			ContractHash: p.contractHash, DispatchedAt: dispatchedAt,
		}
	}
	return out
}
