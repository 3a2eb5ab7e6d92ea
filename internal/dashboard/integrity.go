package dashboard

import (
	"fmt"
	"slices"
	"strings"

	"github.com/trajflow/trajflow/schemas"
)

// Integrity is the safety and integrity panel: authorization denials and
// invalid actions, hidden-eval ids reaching the training plane, incidents,
// quarantine by stage and reason, and every hash the dashboard checked.
type Integrity struct {
	Denied          TurnFlags          `json:"denied"`
	Invalid         TurnFlags          `json:"invalid"`
	EvalAccess      EvalAccess         `json:"eval_access"`
	IncidentTotal   int                `json:"incident_total"`
	IncidentReasons []ReasonCount      `json:"incident_reasons"`
	Incidents       []schemas.Incident `json:"incidents"`
	Quarantine      QuarantinePanel    `json:"quarantine"`
	Hashes          Hashes             `json:"hashes"`
	Undecodable     map[string]int     `json:"undecodable"`
	Redelivered     map[string]int     `json:"redelivered"`
	Problems        []string           `json:"problems"`
}

// TurnFlags counts turns with one decision, by reason and version.
type TurnFlags struct {
	Turns     int            `json:"turns"`
	Attempts  int            `json:"attempts"`
	Reasons   []ReasonCount  `json:"reasons"`
	ByVersion []VersionCount `json:"by_version"`
}

// VersionCount is a count at one policy version.
type VersionCount struct {
	Version int64 `json:"version"`
	Count   int   `json:"count"`
}

// EvalAccess counts hidden-eval ids seen by the training plane: incidents,
// quarantine records and census events with reason eval_task_id, and
// eval-split trajectories on the trajectories topic.
type EvalAccess struct {
	Incidents    int `json:"incidents"`
	Quarantined  int `json:"quarantined"`
	Census       int `json:"census"`
	Trajectories int `json:"eval_split_trajectories"`
}

// QuarantinePanel is the quarantine topic by stage and reason.
type QuarantinePanel struct {
	Total        int           `json:"total"`
	Reasons      []StageReason `json:"reasons"`
	Unattributed int           `json:"unattributed"`
	Records      []Quarantined `json:"records"`
}

// StageReason is a quarantine count of one stage and reason.
type StageReason struct {
	Stage  string `json:"stage"`
	Reason string `json:"reason"`
	Count  int    `json:"count"`
}

// Hashes is every verification the dashboard made or read.
type Hashes struct {
	Files            *FileChecks    `json:"snapshot_files,omitempty"`
	ReleasesVerified int            `json:"releases_verified"`
	ReleaseFailures  []ReleaseCheck `json:"release_failures"`
	// ManifestMismatch lists versions whose manifest on the policy topic
	// names another checkpoint hash than the release directory's.
	ManifestMismatch []string `json:"manifest_mismatch"`
	// HeaderMismatch counts records quarantined because their headers
	// disagreed with their body.
	HeaderMismatch int `json:"header_mismatch"`
}

// maxRows bounds the record tables (the latest ones are kept).
const maxRows = 100

// evalTaskReason is the reason every stage gives an eval-split id on the
// training plane.
const evalTaskReason = "eval_task_id"

func integrity(st *State) Integrity {
	r := st.Records
	in := Integrity{Undecodable: r.Undecodable, Redelivered: r.Redelivered, Problems: append([]string(nil), r.Problems...)}
	in.Denied = turnFlags(r, schemas.DecisionDenied)
	in.Invalid = turnFlags(r, schemas.DecisionInvalid)
	reasons := map[string]int{}
	for _, inc := range r.Incidents {
		reasons[inc.Stage+": "+inc.Reason]++
		if inc.Reason == evalTaskReason {
			in.EvalAccess.Incidents++
		}
	}
	in.IncidentTotal, in.IncidentReasons = len(r.Incidents), reasonCounts(reasons)
	in.Incidents = r.Incidents[max(0, len(r.Incidents)-maxRows):]
	for _, ev := range r.Census {
		if ev.Reason == evalTaskReason {
			in.EvalAccess.Census++
		}
	}
	for _, t := range r.Trajs {
		if t.Split == schemas.SplitEval {
			in.EvalAccess.Trajectories++
		}
	}
	in.Quarantine = quarantinePanel(r)
	for _, q := range r.Quar {
		switch q.Reason {
		case evalTaskReason:
			in.EvalAccess.Quarantined++
		case "header_mismatch":
			in.Hashes.HeaderMismatch++
		}
	}
	in.Hashes.Files = st.Files
	in.hashes(st)
	if st.Releases != nil {
		in.Problems = append(in.Problems, st.Releases.Problems...)
	}
	return in
}

// hashes fills the release verifications and compares the manifests of
// the policy topic with the release directory's.
func (in *Integrity) hashes(st *State) {
	if st.Releases == nil {
		return
	}
	for _, v := range sortedKeys(st.Releases.Checks) {
		c := st.Releases.Checks[v]
		if c.OK {
			in.Hashes.ReleasesVerified++
		} else {
			in.Hashes.ReleaseFailures = append(in.Hashes.ReleaseFailures, c)
		}
	}
	for _, rel := range st.Records.Releases {
		m, ok := st.Releases.Manifests[rel.PolicyVersion]
		if ok && m.CheckpointHash != rel.CheckpointHash {
			in.Hashes.ManifestMismatch = append(in.Hashes.ManifestMismatch,
				fmt.Sprintf("version %d: policy topic %s, release directory %s", rel.PolicyVersion, rel.CheckpointHash, m.CheckpointHash))
		}
	}
}

func turnFlags(r *Records, decision string) TurnFlags {
	var f TurnFlags
	reasons := map[string]int{}
	byV := map[int64]int{}
	for _, id := range r.TrajOrder {
		hit := false
		for _, turn := range r.Trajs[id].Turns {
			if turn.Decision != decision {
				continue
			}
			f.Turns++
			hit = true
			reason := turn.DecisionReason
			if reason == "" {
				reason = "(no reason given)"
			}
			reasons[reason]++
			byV[turn.PolicyVersion]++
		}
		if hit {
			f.Attempts++
		}
	}
	f.Reasons = reasonCounts(reasons)
	for _, v := range sortedKeys(byV) {
		f.ByVersion = append(f.ByVersion, VersionCount{Version: v, Count: byV[v]})
	}
	return f
}

func quarantinePanel(r *Records) QuarantinePanel {
	p := QuarantinePanel{Total: len(r.Quar)}
	counts := map[[2]string]int{}
	for i := range r.Quar {
		q := &r.Quar[i]
		counts[[2]string{q.Stage, q.Reason}]++
		if !attributed(r, q) {
			p.Unattributed++
		}
	}
	for k, n := range counts {
		p.Reasons = append(p.Reasons, StageReason{Stage: k[0], Reason: k[1], Count: n})
	}
	sortStageReasons(p.Reasons)
	p.Records = r.Quar[max(0, len(r.Quar)-maxRows):]
	return p
}

// attributed reports whether a quarantine record names an attempt the
// run knows (by the ids of the rows it holds, or its trajflow-id header).
func attributed(r *Records, q *Quarantined) bool {
	known := func(id string) bool {
		_, t := r.Tasks[id]
		return t || len(r.CensusBy[id]) > 0 || r.Trajs[id] != nil
	}
	for _, id := range q.Attempts {
		if known(id) {
			return true
		}
	}
	return q.ID != "" && known(q.ID)
}

func sortStageReasons(s []StageReason) {
	slices.SortFunc(s, func(a, b StageReason) int {
		if a.Count != b.Count {
			return b.Count - a.Count
		}
		return strings.Compare(a.Stage+"/"+a.Reason, b.Stage+"/"+b.Reason)
	})
}
