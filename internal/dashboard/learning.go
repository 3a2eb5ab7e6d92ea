package dashboard

import (
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

// Learning is the learning-dynamics panel: the trainer's update records
// (loss, KL, entropy, ratio and clip fractions by advantage sign, ratio
// and KL by lag) and, by behavior version, the reward components,
// returns, advantages, group statistics and lengths of the rollouts.
type Learning struct {
	Updates   []UpdateRow    `json:"updates"`
	ByVersion []VersionLearn `json:"by_version"`
	Lag       []LagRow       `json:"lag"`
	Note      string         `json:"note,omitempty"`
}

// UpdateRow is one update record. The first optimizer step of an update
// is taken at the behavior policy (ratio exactly 1 on policy); "last" are
// the statistics of its last step.
type UpdateRow struct {
	Version        int64             `json:"version"`
	FromVersion    int64             `json:"from_version"`
	BatchID        string            `json:"batch_id"`
	BatchIndex     int64             `json:"batch_index"`
	Loss           float64           `json:"loss"`
	PolicyLoss     float64           `json:"policy_loss"`
	KL             float64           `json:"kl"`
	Entropy        float64           `json:"entropy"`
	FirstRatioMean float64           `json:"first_ratio_mean"`
	RatioMean      float64           `json:"ratio_mean"`
	RatioMin       float64           `json:"ratio_min"`
	RatioMax       float64           `json:"ratio_max"`
	ApproxKL       float64           `json:"approx_kl"`
	ClipPos        float64           `json:"clip_frac_pos"`
	ClipNeg        float64           `json:"clip_frac_neg"`
	LastEntropy    float64           `json:"last_entropy"`
	GradNorm       float64           `json:"grad_norm"`
	GradScale      float64           `json:"grad_scale"`
	Tokens         int64             `json:"tokens"`
	InputTokens    int64             `json:"input_tokens"`
	Segments       int               `json:"segments"`
	Duplicates     int               `json:"duplicates"`
	StepSeconds    float64           `json:"step_seconds"`
	Lag            []schemas.LagStat `json:"lag"`
	// Cost is the update's cost ledger (absent from a trainer that does
	// not write one).
	Cost *schemas.UpdateCost `json:"cost,omitempty"`
}

// VersionLearn summarizes the rollouts sampled by one version.
type VersionLearn struct {
	Version       int64           `json:"version"`
	Rewarded      int             `json:"rewarded"`
	RewardMean    float64         `json:"reward_mean"`
	Components    []ComponentMean `json:"components"`
	Scored        int             `json:"scored"`
	Return        Dist            `json:"return"`
	Advantage     Dist            `json:"advantage"`
	ZeroAdvantage float64         `json:"zero_advantage_share"`
	Groups        int             `json:"groups"`
	GroupStdMean  float64         `json:"group_std_mean"`
	ZeroVarGroups int             `json:"zero_variance_groups"`
	Tokens        Dist            `json:"tokens"`
	ActionTokens  Dist            `json:"action_tokens"`
	Turns         Dist            `json:"turns"`
}

// ComponentMean is the mean value of one reward component.
type ComponentMean struct {
	Name    string  `json:"name"`
	Version string  `json:"version"`
	N       int     `json:"n"`
	Mean    float64 `json:"mean"`
	Errors  int     `json:"errors"`
}

// LagRow aggregates the update records' lag strata over every update,
// weighted by tokens.
type LagRow struct {
	Lag       int64   `json:"lag"`
	Tokens    int64   `json:"tokens"`
	Updates   int     `json:"updates"`
	RatioMean float64 `json:"ratio_mean"`
	RatioMin  float64 `json:"ratio_min"`
	RatioMax  float64 `json:"ratio_max"`
	ApproxKL  float64 `json:"approx_kl"`
	K3        float64 `json:"k3"`
}

func learning(st *State) Learning {
	var l Learning
	if st.Releases == nil {
		l.Note = "no release directory: the update records (loss, KL, clip fractions, entropy, lag strata) live there (--releases)"
	} else {
		l.Updates, l.Lag = updateRows(st.Releases.Updates, st.lossOptions())
	}
	l.ByVersion = versionLearning(st.Records)
	return l
}

// lossOptions is the run's loss (the zero Options without a contract:
// statistics are then shown as recorded).
func (st *State) lossOptions() objective.Options {
	if st.Contract == nil {
		return objective.Options{}
	}
	return st.Contract.Loss.Options
}

// updateRows are the update records as rows; entropies per trained token
// under o's normalization (objective.Options.PerToken).
func updateRows(us []schemas.UpdateRecord, o objective.Options) ([]UpdateRow, []LagRow) {
	var rows []UpdateRow
	lag := map[int64]*LagRow{}
	for _, u := range us {
		m, last := u.Metrics, u.Last
		rows = append(rows, UpdateRow{Version: u.Version, FromVersion: m.FromVersion, BatchID: u.BatchID, BatchIndex: u.BatchIndex,
			Loss: finite(m.Loss), PolicyLoss: finite(m.PolicyLoss), KL: finite(m.KL), Entropy: finite(o.PerToken(m.Entropy, m.Tokens)),
			FirstRatioMean: finite(m.RatioMean), RatioMean: finite(last.RatioMean), RatioMin: finite(last.RatioMin),
			RatioMax: finite(last.RatioMax), ApproxKL: finite(last.ApproxKLOld), ClipPos: finite(last.ClipFracPos),
			ClipNeg: finite(last.ClipFracNeg), LastEntropy: finite(o.PerToken(last.Entropy, last.Tokens)), GradNorm: finite(m.GradNorm),
			GradScale: finite(m.GradScale), Tokens: m.Tokens, InputTokens: m.InputTokens, Segments: m.Segments,
			Duplicates: u.Duplicates, StepSeconds: u.StepSeconds, Lag: m.Lag, Cost: u.Cost})
		for _, s := range m.Lag {
			r := lag[s.Lag]
			if r == nil {
				r = &LagRow{Lag: s.Lag, RatioMin: s.RatioMin, RatioMax: s.RatioMax}
				lag[s.Lag] = r
			}
			w := float64(s.Tokens)
			r.RatioMean += w * s.RatioMean
			r.ApproxKL += w * s.ApproxKL
			r.K3 += w * s.K3
			r.RatioMin, r.RatioMax = min(r.RatioMin, s.RatioMin), max(r.RatioMax, s.RatioMax)
			r.Tokens += s.Tokens
			r.Updates++
		}
	}
	var lags []LagRow
	for _, k := range sortedKeys(lag) {
		r := lag[k]
		if r.Tokens > 0 {
			w := float64(r.Tokens)
			r.RatioMean, r.ApproxKL, r.K3 = finite(r.RatioMean/w), finite(r.ApproxKL/w), finite(r.K3/w)
		}
		lags = append(lags, *r)
	}
	return rows, lags
}

// versionAcc accumulates one version's rollouts.
type versionAcc struct {
	rewarded               int
	reward                 float64
	comps                  map[string]*ComponentMean
	scored                 int
	returns, advs          []float64
	zeroAdv                int
	groups                 map[string]schemas.GroupStats
	tokens, actions, turns []float64
}

func versionLearning(r *Records) []VersionLearn {
	acc := map[int64]*versionAcc{}
	for _, id := range r.TrajOrder {
		t := r.Trajs[id]
		v := behaviorVersion(t)
		a := acc[v]
		if a == nil {
			a = &versionAcc{comps: map[string]*ComponentMean{}, groups: map[string]schemas.GroupStats{}}
			acc[v] = a
		}
		a.tokens = append(a.tokens, float64(streamLen(t)))
		a.actions = append(a.actions, float64(actionTokens(t)))
		a.turns = append(a.turns, float64(len(t.Turns)))
		if ri := r.Rewarded[id]; ri != nil {
			a.rewarded++
			a.reward += ri.Total
			for _, c := range ri.Rewards {
				cm := a.comps[c.Name]
				if cm == nil {
					cm = &ComponentMean{Name: c.Name, Version: c.Version}
					a.comps[c.Name] = cm
				}
				if c.Error != "" {
					cm.Errors++
					continue
				}
				cm.N++
				cm.Mean += c.Value
			}
		}
		if si := r.Scored[id]; si != nil {
			a.scored++
			a.groups[t.GroupID] = si.Group
			for i, adv := range si.TurnAdvantages {
				a.advs = append(a.advs, float64(adv))
				if adv == 0 {
					a.zeroAdv++
				}
				if i < len(si.TurnReturns) {
					a.returns = append(a.returns, float64(si.TurnReturns[i]))
				}
			}
		}
	}
	var out []VersionLearn
	for _, v := range sortedKeys(acc) {
		out = append(out, acc[v].row(v))
	}
	return out
}

func (a *versionAcc) row(v int64) VersionLearn {
	vl := VersionLearn{Version: v, Rewarded: a.rewarded, Scored: a.scored, Groups: len(a.groups),
		Return: Summarize(a.returns), Advantage: Summarize(a.advs), ZeroAdvantage: ratio(a.zeroAdv, len(a.advs)),
		Tokens: Summarize(a.tokens), ActionTokens: Summarize(a.actions), Turns: Summarize(a.turns)}
	if a.rewarded > 0 {
		vl.RewardMean = a.reward / float64(a.rewarded)
	}
	for _, name := range sortedKeys(a.comps) {
		cm := *a.comps[name]
		if cm.N > 0 {
			cm.Mean /= float64(cm.N)
		}
		vl.Components = append(vl.Components, cm)
	}
	var std float64
	for _, g := range a.groups {
		std += g.Std
		if g.ZeroVar {
			vl.ZeroVarGroups++
		}
	}
	if len(a.groups) > 0 {
		vl.GroupStdMean = finite(std / float64(len(a.groups)))
	}
	return vl
}
