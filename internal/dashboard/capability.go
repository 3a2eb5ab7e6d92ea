package dashboard

import (
	"slices"
	"strings"

	"github.com/trajflow/trajflow/schemas"
)

// Capability is the capability panel: verified success of the training
// rollouts by behavior version and by task (Wilson 95% intervals), pass@k
// from each group's samples of one task, action validity, and the hidden
// eval re-measured from the releases.
type Capability struct {
	SuccessDefinition string         `json:"success_definition"`
	Ks                []int          `json:"ks"`
	ByVersion         []VersionCap   `json:"by_version"`
	ByTask            []TaskCap      `json:"by_task"`
	Tasks             int            `json:"tasks"`
	Eval              []EvalPoint    `json:"eval"`
	EvalNote          string         `json:"eval_note"`
	RecordedEvals     []RecordedEval `json:"recorded_evals"`
}

// RecordedEval is a hidden-eval result the run recorded (summary.json).
type RecordedEval struct {
	Version int64   `json:"version"`
	Success float64 `json:"success"`
}

// VersionCap is the capability of the rollouts sampled by one version.
type VersionCap struct {
	Version   int64    `json:"version"`
	Attempts  int      `json:"attempts"` // recorded trajectories
	Judged    int      `json:"judged"`   // with a verdict of the trusted validator
	Successes int      `json:"successes"`
	Success   float64  `json:"success"`
	Lo        float64  `json:"lo"`
	Hi        float64  `json:"hi"`
	Groups    int      `json:"groups"`
	PassAtK   []KValue `json:"pass_at_k"`
	Turns     int      `json:"turns"`
	TurnsOK   int      `json:"turns_ok"`
	Invalid   int      `json:"turns_invalid"`
	Denied    int      `json:"turns_denied"`
	Validity  float64  `json:"validity"` // share of turns parsed and authorized
}

// TaskCap is the capability on one task, over every version.
type TaskCap struct {
	Task      string  `json:"task"`
	Attempts  int     `json:"attempts"`
	Judged    int     `json:"judged"`
	Successes int     `json:"successes"`
	Admitted  int     `json:"admitted"`
	Success   float64 `json:"success"`
	Lo        float64 `json:"lo"`
	Hi        float64 `json:"hi"`
}

// maxTaskRows bounds the by-task table (the tasks with most attempts).
const maxTaskRows = 40

func capability(st *State, groupSize int) Capability {
	r := st.Records
	c := Capability{SuccessDefinition: "the trusted validator's component (" + strings.Join(trustedValidators, ", ") +
		") with raw > 0; attempts without its verdict are not judged", Eval: st.Evals, EvalNote: st.EvalNote}
	for k := 1; k <= max(1, groupSize); k *= 2 {
		c.Ks = append(c.Ks, k)
	}
	byV := map[int64]*VersionCap{}
	groups := map[int64]map[string][2]int{} // version -> group -> successes, judged
	byTask := map[string]*TaskCap{}
	for _, id := range r.TrajOrder {
		t := r.Trajs[id]
		v := behaviorVersion(t)
		vc := byV[v]
		if vc == nil {
			vc = &VersionCap{Version: v}
			byV[v], groups[v] = vc, map[string][2]int{}
		}
		tc := byTask[t.TaskID]
		if tc == nil {
			tc = &TaskCap{Task: t.TaskID}
			byTask[t.TaskID] = tc
		}
		vc.Attempts++
		tc.Attempts++
		if r.Admits[id] > 0 {
			tc.Admitted++
		}
		countTurns(vc, t)
		ok, judged := verified(r, id)
		if !judged {
			continue
		}
		g := groups[v][t.GroupID]
		g[1]++
		vc.Judged++
		tc.Judged++
		if ok {
			g[0]++
			vc.Successes++
			tc.Successes++
		}
		groups[v][t.GroupID] = g
	}
	for _, v := range sortedKeys(byV) {
		vc := byV[v]
		vc.Success = ratio(vc.Successes, vc.Judged)
		vc.Lo, vc.Hi = Wilson(vc.Successes, vc.Judged)
		vc.Groups = len(groups[v])
		vc.PassAtK = passAtKs(groups[v], max(1, groupSize))
		vc.Validity = ratio(vc.TurnsOK, vc.Turns)
		c.ByVersion = append(c.ByVersion, *vc)
	}
	c.Tasks = len(byTask)
	for _, tc := range byTask {
		tc.Success = ratio(tc.Successes, tc.Judged)
		tc.Lo, tc.Hi = Wilson(tc.Successes, tc.Judged)
		c.ByTask = append(c.ByTask, *tc)
	}
	slices.SortFunc(c.ByTask, func(a, b TaskCap) int {
		if a.Attempts != b.Attempts {
			return b.Attempts - a.Attempts
		}
		return strings.Compare(a.Task, b.Task)
	})
	c.ByTask = c.ByTask[:min(len(c.ByTask), maxTaskRows)]
	if s := st.Recorded; s != nil {
		for _, e := range s.Evals {
			c.RecordedEvals = append(c.RecordedEvals, RecordedEval{Version: e.Version, Success: e.Success})
		}
	}
	return c
}

// countTurns adds a trajectory's turn decisions to vc.
func countTurns(vc *VersionCap, t *schemas.Trajectory) {
	for _, turn := range t.Turns {
		vc.Turns++
		switch turn.Decision {
		case schemas.DecisionOK:
			vc.TurnsOK++
		case schemas.DecisionInvalid:
			vc.Invalid++
		case schemas.DecisionDenied:
			vc.Denied++
		}
	}
}

func ratio(a, b int) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}
