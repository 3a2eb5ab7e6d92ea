package dashboard

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// View is what the dashboard serves from one State: the panels (Summary,
// also kept encoded) and the indexes the trajectory viewer uses.
type View struct {
	Summary Summary
	JSON    []byte
	st      *State
	fates   map[string]Fate
}

// Fate is what the census says became of an attempt.
type Fate struct {
	Outcome string `json:"outcome"` // admitted, filtered, quarantined, failed, or "" (undecided)
	Reason  string `json:"reason,omitempty"`
	Stage   string `json:"stage,omitempty"`
}

// Summary is the JSON document behind the page (/api/summary).
type Summary struct {
	Run        RunPanel   `json:"run"`
	Overview   Overview   `json:"overview"`
	Capability Capability `json:"capability"`
	Learning   Learning   `json:"learning"`
	Systems    Systems    `json:"systems"`
	Integrity  Integrity  `json:"integrity"`
}

// RunPanel names the run and where it was read.
type RunPanel struct {
	Run          string    `json:"run"`
	Source       string    `json:"source"`
	Live         bool      `json:"live"`
	ContractHash string    `json:"contract_hash"`
	Mode         string    `json:"mode"`
	GroupSize    int       `json:"group_size"`
	ReadAt       time.Time `json:"read_at"`
}

// Overview are the run's counts, computed from the records, beside those
// the run recorded in summary.json (Checks).
type Overview struct {
	Rounds       int      `json:"rounds"`
	Updates      int      `json:"updates"`
	Batches      int      `json:"batches"`
	Launched     int      `json:"attempts_launched"`
	Recorded     int      `json:"trajectories_recorded"`
	Admitted     int      `json:"trajectories_admitted"`
	Filtered     int      `json:"trajectories_filtered"`
	Quarantined  int      `json:"quarantined"`
	Duplicates   int      `json:"duplicates_admitted"`
	Undecided    int      `json:"undecided"`
	CensusEvents int      `json:"census_events"`
	LastVersion  int64    `json:"last_version"`
	EvalInitial  *float64 `json:"eval_success_initial"`
	EvalFinal    *float64 `json:"eval_success_final"`
	// UnreadableFiles lists the snapshot files (relative to the run's
	// output directory) that are missing or did not verify: the counts
	// above lack their records, and the Checks computed from the records
	// are Partial.
	UnreadableFiles []string `json:"unreadable_files"`
	Checks          []Check  `json:"checks"`
}

// Check compares a count the dashboard computed with the run's own.
type Check struct {
	Name      string  `json:"name"`
	Dashboard float64 `json:"dashboard"`
	Recorded  float64 `json:"recorded"`
	OK        bool    `json:"ok"`
	// Partial, when set ("partial: N files unreadable"), says the
	// dashboard's count is of the records of the files it could read: a
	// difference is no evidence against the run.
	Partial string `json:"partial,omitempty"`
}

// Assemble computes every panel of st.
func Assemble(st *State) *View {
	v := &View{st: st, fates: fates(st.Records)}
	c := st.Contract
	if c == nil {
		c = contract.Default()
	}
	v.Summary = Summary{
		Run: RunPanel{Run: st.Run, Source: st.Source, Live: st.Live, ContractHash: c.Hash(), Mode: c.Dispatch.Mode,
			GroupSize: c.Sampler.GroupSize, ReadAt: st.ReadAt},
		Overview:   overview(st, v.fates),
		Capability: capability(st, c.Sampler.GroupSize),
		Learning:   learning(st),
		Systems:    systems(st, v.fates),
		Integrity:  integrity(st),
	}
	nonNil(&v.Summary, false) // under the write lock: the records may be touched
	v.JSON, _ = json.Marshal(&v.Summary)
	return v
}

// fates reads every attempt's decisive census event: admitted, filtered,
// quarantined or failed (the first of them), and admitted for every
// trajectory a batch holds.
func fates(r *Records) map[string]Fate {
	out := map[string]Fate{}
	for _, ev := range r.Census {
		switch ev.Kind {
		case schemas.CensusAdmitted, schemas.CensusFiltered, schemas.CensusQuarantined, schemas.CensusFailed:
		default:
			continue
		}
		if f, ok := out[ev.AttemptID]; ok && f.Outcome != schemas.CensusFailed {
			continue
		}
		out[ev.AttemptID] = Fate{Outcome: ev.Kind, Reason: ev.Reason, Stage: ev.Stage}
	}
	for id := range r.Segments {
		out[id] = Fate{Outcome: schemas.CensusAdmitted, Stage: "pack"}
	}
	return out
}

// accounting is internal/audit's accounting of the records: launched (the
// tasks topic) against admitted (batches) and the census.
func accounting(r *Records) audit.Counts {
	rep := &audit.Report{Batches: len(r.Batches), BatchIDs: r.BatchCount, Admitted: r.Admits,
		Filtered: map[string]string{}, Quarantined: map[string]string{}, Census: map[string]int{}}
	for _, ev := range r.Census {
		rep.Census[ev.Kind]++
		switch ev.Kind {
		case schemas.CensusFiltered:
			rep.Filtered[ev.AttemptID] = ev.Reason
		case schemas.CensusQuarantined:
			rep.Quarantined[ev.AttemptID] = ev.Reason
		}
	}
	return rep.Account(r.Launched)
}

func overview(st *State, f map[string]Fate) Overview {
	r := st.Records
	acc := accounting(r)
	o := Overview{Rounds: len(r.Rounds), Batches: len(r.Batches), Launched: acc.Launched, Recorded: len(r.Trajs),
		Admitted: acc.Admitted, Filtered: acc.Filtered, Quarantined: acc.Quarantined, Duplicates: acc.Duplicated,
		Undecided: acc.Lost, CensusEvents: len(r.Census)}
	for _, rel := range r.Releases {
		o.LastVersion = max(o.LastVersion, rel.PolicyVersion)
	}
	if st.Releases != nil {
		o.Updates = len(st.Releases.Updates)
	} else {
		o.Updates = int(o.LastVersion)
	}
	if n := len(st.Evals); n > 0 {
		o.EvalInitial, o.EvalFinal = &st.Evals[0].Success, &st.Evals[n-1].Success
	} else if s := st.Recorded; s != nil {
		o.EvalInitial, o.EvalFinal = &s.EvalSuccessInitial, &s.EvalSuccessFinal
	}
	partial := ""
	if st.Files != nil && len(st.Files.Unreadable) > 0 {
		o.UnreadableFiles = st.Files.Unreadable
		partial = fmt.Sprintf("partial: %d files unreadable", len(o.UnreadableFiles))
		if len(o.UnreadableFiles) == 1 {
			partial = "partial: 1 file unreadable"
		}
	}
	if s := st.Recorded; s != nil {
		// fromRecords says whether the dashboard's count comes from the
		// snapshot's records (partial when files are unreadable), not from
		// the release directory or the dashboard's own eval.
		add := func(name string, dash, rec float64, fromRecords bool) {
			c := Check{Name: name, Dashboard: dash, Recorded: rec, OK: dash == rec}
			if fromRecords {
				c.Partial = partial
			}
			o.Checks = append(o.Checks, c)
		}
		add("updates", float64(o.Updates), float64(s.Updates), st.Releases == nil)
		add("attempts_launched", float64(o.Launched), float64(s.AttemptsLaunched), true)
		add("trajectories_admitted", float64(o.Admitted), float64(s.TrajectoriesAdmitted), true)
		add("trajectories_filtered", float64(o.Filtered), float64(s.TrajectoriesFiltered), true)
		add("quarantined", float64(o.Quarantined), float64(s.Quarantined), true)
		add("duplicates_admitted", float64(o.Duplicates), float64(s.DuplicatesAdmitted), true)
		add("lost", float64(o.Undecided), float64(s.Lost), true)
		add("batches", float64(o.Batches), float64(len(s.BatchHashes)), true)
		if o.EvalInitial != nil && len(st.Evals) > 0 {
			add("eval_success_initial", *o.EvalInitial, s.EvalSuccessInitial, false)
			add("eval_success_final", *o.EvalFinal, s.EvalSuccessFinal, false)
		}
	}
	return o
}

// behaviorVersion is the policy version that sampled a trajectory's first
// action (the version its attempt asked for).
func behaviorVersion(t *schemas.Trajectory) int64 {
	if len(t.Turns) > 0 {
		return t.Turns[0].PolicyVersion
	}
	return -1
}

// trustedValidators are the reward components of the built-in trusted
// validators: a trajectory's verified success is theirs, never the sum of
// the reward.
var trustedValidators = []string{rollout.EvalSuccess, rollout.EvalLedgerSuccess, rollout.EvalTextSuccess}

// verified returns the trusted validator's verdict on a trajectory, and
// whether there is one (rewarded, with the component and no error).
func verified(r *Records, id string) (ok, judged bool) {
	ri := r.Rewarded[id]
	if ri == nil {
		return false, false
	}
	for _, c := range ri.Rewards {
		if slices.Contains(trustedValidators, c.Name) && c.Error == "" {
			return c.Raw > 0, true
		}
	}
	return false, false
}

// sortedKeys returns the keys of m, ascending.
func sortedKeys[K interface{ ~int64 | ~string }, V any](m map[K]V) []K {
	ks := make([]K, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// reasonCounts turns a count map into rows sorted by count, then name.
func reasonCounts(m map[string]int) []ReasonCount {
	out := make([]ReasonCount, 0, len(m))
	for k, n := range m {
		out = append(out, ReasonCount{Reason: k, Count: n})
	}
	slices.SortFunc(out, func(a, b ReasonCount) int {
		if a.Count != b.Count {
			return b.Count - a.Count
		}
		return strings.Compare(a.Reason, b.Reason)
	})
	return out
}

// ReasonCount is a reason and how often it occurred.
type ReasonCount struct {
	Reason string `json:"reason"`
	Count  int    `json:"count"`
}
