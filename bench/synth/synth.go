// Package synth generates synthetic rollouts with a realistic shape:
// heavy-tailed (log-normal) token lengths with a long tail, multi-turn
// episodes with tool observations, group structure, policy-version lag and
// a share of failed and invalid attempts. It feeds tests, `trajflow bench`
// and capacity planning (systems §18: "measure one episode distribution").
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

// Group returns the index-th group: GroupSize trajectories of one task.
func (c Config) Group(index int64) []schemas.Trajectory {
	r := rand.New(rand.NewPCG(c.Seed, uint64(index)*0x9e3779b97f4a7c15+1))
	task := "task-" + itoa(int64(r.IntN(max(c.Tasks, 1))))
	gid := schemas.GroupID(c.RunID, task, index)
	out := make([]schemas.Trajectory, c.GroupSize)
	mu := math.Log(c.MeanTokens) - c.Sigma*c.Sigma/2
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
		out[m] = c.trajectory(r, id, task, gid, int32(m), total, version)
	}
	return out
}

func (c Config) trajectory(r *rand.Rand, id, task, gid string, member int32, total int, version int64) schemas.Trajectory {
	turns := 1 + r.IntN(max(c.MaxTurns, 1))
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
			tu.PromptIDs = c.tokens(r, prompt)
		} else {
			tu.PromptIDs = c.tokens(r, 2)
		}
		tu.ActionIDs = c.tokens(r, max(n, 1))
		tu.ActionLogprobs = make([]float32, len(tu.ActionIDs))
		for k := range tu.ActionLogprobs {
			tu.ActionLogprobs[k] = -float32(r.ExpFloat64())
		}
		tu.PolicyVersion = version
		tu.Decision = schemas.DecisionOK
		if r.Float64() < c.InvalidShare {
			tu.Decision = schemas.DecisionInvalid
			tu.DecisionReason = "malformed call"
		}
		tu.ObservationIDs = c.tokens(r, o)
		tu.Value = float32(math.NaN())
		tu.GenLatencyUS = int64(len(tu.ActionIDs)) * 20
		tu.EnvLatencyUS = 1000 + int64(r.IntN(50000))
	}
	return t
}

func (c Config) tokens(r *rand.Rand, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = r.Int32N(c.Vocab)
	}
	return out
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
