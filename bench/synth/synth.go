// Package synth generates synthetic rollouts with a realistic shape:
// heavy-tailed (log-normal) token lengths with a long tail, multi-turn
// episodes with tool observations, group structure, policy-version lag and
// a share of failed and invalid attempts. It feeds tests, `trajflow bench`
// and capacity planning (docs/SYSTEMS.md §18: "measure one episode distribution").
// Everything is a pure function of the Config and the group index.
package synth

import (
	"math"
	"math/rand/v2"

	"github.com/trajflow/trajflow/schemas"
)

// Config describes the distribution.
type Config struct {
	RunID        string
	ContractHash string
	GroupSize    int
	Vocab        int32
	// Tokens per episode ~ LogNormal(mu, sigma) clipped to [MinTokens,
	// MaxTokens]; exp(mu + sigma^2/2) is the mean before clipping.
	MeanTokens float64
	Sigma      float64
	MinTokens  int
	MaxTokens  int
	MaxTurns   int
	// ObservationShare is the share of an episode's tokens that are tool
	// observations; PromptTokens the size of the turn-0 prompt.
	ObservationShare float64
	PromptTokens     int
	// PolicyVersion is the trainer's version; each episode's behavior
	// version lags it by a geometric number of versions with mean MeanLag.
	PolicyVersion int64
	MeanLag       float64
	// InvalidShare of turns are parser-invalid actions; FailedShare of
	// attempts fail (still valid training data with reward 0).
	InvalidShare float64
	FailedShare  float64
	// InfraShare of attempts report an infrastructure failure
	// (StatusInfra: validation quarantines them as infrastructure-invalid,
	// never as task failures); CorruptShare of attempts carry a corrupt
	// record (a positive log-prob) that validation quarantines as invalid.
	InfraShare   float64
	CorruptShare float64
	// UniformShare of groups have members of identical reward-relevant
	// shape (same turn count, no invalid turn): under count-based rewards
	// (invalid_action, turn_count) such a group has zero reward variance.
	UniformShare float64
	Seed         uint64
	Tasks        int
}

// Default is a distribution like an agentic coding/tool workload: mean
// ~1000 tokens, tail to 32k.
func Default() Config {
	return Config{
		RunID: "bench", GroupSize: 8, Vocab: 32000, MeanTokens: 1000, Sigma: 1.0,
		MinTokens: 32, MaxTokens: 32768, MaxTurns: 8, ObservationShare: 0.35, PromptTokens: 64,
		PolicyVersion: 10, MeanLag: 0.5, InvalidShare: 0.03, FailedShare: 0.05, Seed: 1, Tasks: 256,
	}
}

// Bench is the distribution `trajflow bench` feeds: Default plus every
// loss of docs/SYSTEMS.md §4 in a realistic share (infrastructure failures, corrupt
// records, zero-variance groups; staleness comes from the lag
// distribution against the contract's max_lag).
func Bench() Config {
	c := Default()
	c.InfraShare = 0.01
	c.CorruptShare = 0.005
	c.UniformShare = 0.05
	return c
}

// Group returns the index-th group: GroupSize trajectories of one task.
func (c Config) Group(index int64) []schemas.Trajectory {
	return c.group(index, randomTokens{c.Vocab})
}

// tokenSource supplies token ids and behavior log-probs.
type tokenSource interface {
	tokens(r *rand.Rand, n int) []int32
	logprobs(r *rand.Rand, n int) []float32
}

type randomTokens struct{ vocab int32 }

func (s randomTokens) tokens(r *rand.Rand, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = r.Int32N(s.vocab)
	}
	return out
}

func (randomTokens) logprobs(r *rand.Rand, n int) []float32 {
	out := make([]float32, n)
	for k := range out {
		out[k] = -float32(r.ExpFloat64())
	}
	return out
}

// Generator produces the groups of a Config fast enough never to be the
// bottleneck of a throughput benchmark: token ids and log-probs are views
// of a fixed random pool (drawn once from Seed) at random offsets instead
// of one random draw per token. Ids and every distribution (lengths,
// turns, lags, shares) are those of Config.Group; the individual draws
// differ (one random stream feeds both shapes and offsets). Groups share the pool's
// backing arrays: treat them as read-only. Safe for concurrent use.
type Generator struct {
	c    Config
	pool tokenPool
}

// NewGenerator returns a Generator over a pool of poolTokens tokens
// (at least MaxTokens; 1<<20 when <= 0).
func (c Config) NewGenerator(poolTokens int) *Generator {
	if poolTokens <= 0 {
		poolTokens = 1 << 20
	}
	poolTokens = max(poolTokens, c.MaxTokens+c.PromptTokens+2*c.MaxTurns+1)
	r := rand.New(rand.NewPCG(c.Seed, 0x5eed))
	p := poolTokens
	return &Generator{c: c, pool: tokenPool{
		ids: randomTokens{c.Vocab}.tokens(r, p),
		lps: randomTokens{}.logprobs(r, p),
	}}
}

// Group returns the index-th group.
func (g *Generator) Group(index int64) []schemas.Trajectory { return g.c.group(index, g.pool) }

// Config returns the generator's distribution.
func (g *Generator) Config() Config { return g.c }

type tokenPool struct {
	ids []int32
	lps []float32
}

func (p tokenPool) tokens(r *rand.Rand, n int) []int32 {
	off := r.IntN(len(p.ids) - n + 1)
	return p.ids[off : off+n : off+n]
}

func (p tokenPool) logprobs(r *rand.Rand, n int) []float32 {
	off := r.IntN(len(p.lps) - n + 1)
	return p.lps[off : off+n : off+n]
}

func (c Config) group(index int64, src tokenSource) []schemas.Trajectory {
	r := rand.New(rand.NewPCG(c.Seed, uint64(index)*0x9e3779b97f4a7c15+1))
	task := "task-" + itoa(int64(r.IntN(max(c.Tasks, 1))))
	gid := schemas.GroupID(c.RunID, task, index)
	out := make([]schemas.Trajectory, c.GroupSize)
	mu := math.Log(c.MeanTokens) - c.Sigma*c.Sigma/2
	uniformTurns := 0 // > 0: every member has this many turns, none invalid
	if c.UniformShare > 0 && r.Float64() < c.UniformShare {
		uniformTurns = 1 + r.IntN(max(c.MaxTurns, 1))
	}
	for m := range out {
		id := schemas.AttemptID(c.RunID, task, gid, int32(m), 0)
		total := int(math.Exp(mu + c.Sigma*r.NormFloat64()))
		total = min(max(total, c.MinTokens), c.MaxTokens)
		lag := int64(0)
		if c.MeanLag > 0 {
			p := 1 / (1 + c.MeanLag)
			for r.Float64() > p && lag < 64 {
				lag++
			}
		}
		version := max(c.PolicyVersion-lag, 0)
		out[m] = c.trajectory(r, src, id, task, gid, int32(m), total, version, uniformTurns)
	}
	return out
}

func (c Config) trajectory(r *rand.Rand, src tokenSource, id, task, gid string, member int32, total int, version int64, uniformTurns int) schemas.Trajectory {
	turns := 1 + r.IntN(max(c.MaxTurns, 1))
	if uniformTurns > 0 {
		turns = uniformTurns
	}
	prompt := min(c.PromptTokens, total/2)
	rest := max(total-prompt, 2*turns)
	obsTotal := int(float64(rest) * c.ObservationShare)
	actTotal := max(rest-obsTotal, turns)
	t := schemas.Trajectory{
		RecordID: id, RunID: c.RunID, TaskID: task, TaskVersion: "v1", Domain: "synthetic",
		Split: schemas.SplitTrain, EnvVersion: "synth-env/1", GroupID: gid, GroupSize: int32(c.GroupSize),
		Member: member, Seed: int64(r.Uint64() >> 1), ContractHash: c.ContractHash, SamplerID: "synth",
		ParserVersion: "synth-parser/1", TokenizerHash: "", Status: schemas.StatusCompleted,
		End: schemas.EndTerminated, EndReason: "answer", BootstrapValue: float32(math.NaN()),
		StartedAt: 1, FinishedAt: 2,
	}
	if r.Float64() < c.FailedShare {
		t.Status = schemas.StatusFailed
	}
	corrupt := false
	if c.InfraShare > 0 || c.CorruptShare > 0 {
		switch u := r.Float64(); {
		case u < c.InfraShare:
			t.Status, t.End, t.EndReason = schemas.StatusInfra, schemas.EndTruncated, "sandbox_lost"
		case u < c.InfraShare+c.CorruptShare:
			corrupt = true
		}
	}
	t.Turns = make([]schemas.Turn, turns)
	for i := range t.Turns {
		tu := &t.Turns[i]
		tu.Index = int32(i)
		n := actTotal / turns
		o := obsTotal / turns
		if i == turns-1 {
			n = actTotal - n*(turns-1)
			o = 0
		}
		if i == 0 {
			tu.PromptIDs = src.tokens(r, prompt)
		} else {
			tu.PromptIDs = src.tokens(r, 2)
		}
		tu.ActionIDs = src.tokens(r, max(n, 1))
		tu.ActionLogprobs = src.logprobs(r, len(tu.ActionIDs))
		if corrupt && i == turns-1 {
			lp := append([]float32(nil), tu.ActionLogprobs...)
			lp[0] = 0.5 // a log-probability above 0: corrupt
			tu.ActionLogprobs = lp
		}
		tu.PolicyVersion = version
		tu.Decision = schemas.DecisionOK
		if r.Float64() < c.InvalidShare && uniformTurns == 0 {
			tu.Decision = schemas.DecisionInvalid
			tu.DecisionReason = "malformed call"
		}
		tu.ObservationIDs = src.tokens(r, o)
		tu.Value = float32(math.NaN())
		tu.GenLatencyUS = int64(len(tu.ActionIDs)) * 20
		tu.EnvLatencyUS = 1000 + int64(r.IntN(50000))
	}
	return t
}

// Tokens counts every token of t (prompts, actions, observations) and the
// action tokens alone.
func Tokens(t *schemas.Trajectory) (all, action int) {
	for i := range t.Turns {
		tu := &t.Turns[i]
		all += len(tu.PromptIDs) + len(tu.ActionIDs) + len(tu.ObservationIDs)
		action += len(tu.ActionIDs)
	}
	return all, action
}

func itoa(v int64) string {
	if v == 0 {
		return "0"
	}
	var b [20]byte
	i := len(b)
	for v > 0 {
		i--
		b[i] = byte('0' + v%10)
		v /= 10
	}
	return string(b[i:])
}
