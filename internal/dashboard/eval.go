package dashboard

import (
	"context"
	"fmt"
	"slices"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/evaluation"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// EvalPoint is the hidden-eval measurement of one policy version, made by
// the dashboard from the version's verified checkpoint on the evaluator's
// fixed attempts (internal/evaluation: the same ids and seeds for every
// version), one verdict of the trusted validator per attempt.
type EvalPoint struct {
	Version   int64   `json:"version"`
	Attempts  int     `json:"attempts"`
	Successes int     `json:"successes"`
	Success   float64 `json:"success"`
	Lo        float64 `json:"lo"`
	Hi        float64 `json:"hi"`
	// PassAtK maps k to the mean over eval tasks of pass@k from the task's
	// samples.
	PassAtK []KValue `json:"pass_at_k"`
	// Recorded is the success the run itself recorded for this version
	// (summary.json), when it did; Match tells whether they agree.
	Recorded *float64 `json:"recorded,omitempty"`
	Match    bool     `json:"match"`
}

// KValue is one pass@k estimate.
type KValue struct {
	K     int     `json:"k"`
	Value float64 `json:"value"`
}

// evaluator re-measures releases on the hidden eval split, once per
// version (releases are immutable).
type evaluator struct {
	ev    *evaluation.Evaluator
	reg   *rollout.Registry
	val   *rollout.Validator
	c     *contract.Contract
	cache map[int64]EvalPoint
}

func newEvaluator(c *contract.Contract, samples int) (*evaluator, error) {
	d, err := operators.BuiltinDeps(c)
	if err != nil {
		return nil, err
	}
	ev, err := evaluation.New(evaluation.Config{Registry: d.Tasks, Settings: operators.RolloutSettings(c, d.Tasks),
		Limits: operators.RolloutLimits(c), Seed: c.Seed, Samples: int32(samples)})
	if err != nil {
		return nil, err
	}
	return &evaluator{ev: ev, reg: d.Tasks, val: rollout.NewValidator(d.Tasks), c: c, cache: map[int64]EvalPoint{}}, nil
}

// measure runs every evaluation attempt of version v on m.
func (e *evaluator) measure(ctx context.Context, v int64, m *model.Model) (EvalPoint, error) {
	if p, ok := e.cache[v]; ok {
		return p, nil
	}
	atts := e.ev.Attempts(v)
	trajs, err := e.reg.RunEpisodes(ctx, model.NewPolicy(m, v), atts, operators.RolloutSettings(e.c, e.reg), operators.RolloutLimits(e.c))
	if err != nil {
		return EvalPoint{}, fmt.Errorf("dashboard: hidden eval of version %d: %w", v, err)
	}
	byTask := map[string][2]int{} // task -> successes, attempts
	p := EvalPoint{Version: v, Attempts: len(trajs)}
	for i := range trajs {
		task, _ := e.reg.Lookup(trajs[i].TaskID)
		ok, _, err := e.val.Validate(task, &trajs[i])
		if err != nil {
			return EvalPoint{}, fmt.Errorf("dashboard: hidden eval of version %d: %w", v, err)
		}
		s := byTask[trajs[i].TaskID]
		s[1]++
		if ok {
			s[0]++
			p.Successes++
		}
		byTask[trajs[i].TaskID] = s
	}
	p.Success = float64(p.Successes) / float64(max(1, p.Attempts))
	p.Lo, p.Hi = Wilson(p.Successes, p.Attempts)
	p.PassAtK = passAtKs(byTask, int(e.ev.Samples()))
	e.cache[v] = p
	return p, nil
}

// passAtKs is the mean pass@k over groups of samples (successes,
// attempts), for k = 1, 2, 4, ... up to maxK; a group counts for the k it
// has at least k samples for.
func passAtKs(groups map[string][2]int, maxK int) []KValue {
	var out []KValue
	for k := 1; k <= maxK; k *= 2 {
		var sum float64
		n := 0
		for _, g := range groups {
			if g[1] >= k {
				sum += PassAtK(g[1], g[0], k)
				n++
			}
		}
		if n > 0 {
			out = append(out, KValue{K: k, Value: sum / float64(n)})
		}
	}
	return out
}

// evalVersions chooses the versions to measure among the verified ones:
// those the run recorded an evaluation for, or else version 0, every
// dispatch.eval_every-th version and the newest.
func evalVersions(verified []int64, recorded map[int64]float64, every int) []int64 {
	var out []int64
	for _, v := range verified {
		_, rec := recorded[v]
		switch {
		case len(recorded) > 0:
			if rec {
				out = append(out, v)
			}
		case v == 0, every > 0 && v%int64(every) == 0, v == verified[len(verified)-1]:
			out = append(out, v)
		}
	}
	return slices.Compact(out)
}
