package dashboard

import (
	"fmt"
	"strconv"
	"time"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/schemas"
)

// Records holds every record of a run's topics that the dashboard reads,
// decoded once, whichever source they came from (Parquet snapshots or the
// live topics): a source calls Add for each message in offset order per
// partition. Redelivered records (same id) are kept once, the first time,
// and counted.
type Records struct {
	Tasks    map[string]schemas.TaskAttempt // attempt id -> the first dispatch of it
	Launched []string                       // attempt ids in tasks-topic order
	Rounds   map[int64]bool                 // trajflow-round headers seen

	Trajs     map[string]*schemas.Trajectory // record id (attempt id) -> trajectory
	TrajOrder []string
	Valid     map[string]bool
	Rewarded  map[string]*RewardInfo
	Scored    map[string]*ScoredInfo

	Batches    []*BatchRec
	BatchByID  map[string]int    // batch id -> index in Batches (first copy)
	BatchCount map[string]int    // batch id -> messages on the batches topic
	Segments   map[string]SegRef // trajectory id -> its first admission
	Admits     map[string]int    // trajectory id -> admissions in batches

	Census    []schemas.CensusEvent
	CensusBy  map[string][]int // attempt id -> indexes into Census
	Incidents []schemas.Incident
	Releases  []ReleaseMsg
	Windows   []WindowMsg
	Quar      []Quarantined

	// Flow is what each topic carried, by short topic name.
	Flow map[string]*Flow
	// Undecodable counts messages of each topic that did not decode as the
	// topic's kind; Problems keeps the first few errors.
	Undecodable map[string]int
	Problems    []string
	// Redelivered counts records seen again under the same id, by topic.
	Redelivered map[string]int

	censusSeen map[string]bool
}

// RewardInfo is what the rewarded topic adds to a trajectory.
type RewardInfo struct {
	Rewards []schemas.RewardComponent `json:"rewards"`
	Total   float64                   `json:"reward_total"`
}

// ScoredInfo is what the scored topic adds to a trajectory.
type ScoredInfo struct {
	TurnRewards      []float32          `json:"turn_rewards"`
	TurnReturns      []float32          `json:"turn_returns"`
	TurnAdvantages   []float32          `json:"turn_advantages"`
	TurnValueTargets []float32          `json:"turn_value_targets"`
	Group            schemas.GroupStats `json:"group"`
	Estimator        string             `json:"estimator"`
	EstimatorVersion string             `json:"estimator_version"`
}

// BatchRec is one message of the batches topic.
type BatchRec struct {
	schemas.PackedBatch
	Time   time.Time
	Offset int64
}

// SegRef locates a trajectory in a packed batch.
type SegRef struct {
	Batch, Row, Seg int
}

// ReleaseMsg is one manifest on the policy topic.
type ReleaseMsg struct {
	schemas.PolicyRelease
	Time time.Time
}

// WindowMsg is one record of the windows topic.
type WindowMsg struct {
	schemas.WindowRecord
	Time time.Time
}

// Quarantined is one record of the quarantine topic: its headers say why.
type Quarantined struct {
	Reason    string    `json:"reason"`
	Detail    string    `json:"detail"`
	Stage     string    `json:"stage"`
	Source    string    `json:"source"` // topic/partition@offset of the refused record
	Kind      string    `json:"kind"`   // trajflow-kind of the refused record
	ID        string    `json:"id"`     // trajflow-id of the refused record
	Attempts  []string  `json:"attempts,omitempty"`
	Time      time.Time `json:"time"`
	Partition int       `json:"partition"`
	Offset    int64     `json:"offset"`
}

// Flow is what one topic carried: messages, records and tokens, with the
// time of every message (the broker's timestamp).
type Flow struct {
	Messages int         `json:"messages"`
	Records  int         `json:"records"`
	Tokens   int64       `json:"tokens"`
	Points   []FlowPoint `json:"-"`
}

// FlowPoint is one message of a topic: when, and how many tokens.
type FlowPoint struct {
	At     time.Time
	Tokens int64
}

// NewRecords returns empty Records.
func NewRecords() *Records {
	return &Records{
		Tasks: map[string]schemas.TaskAttempt{}, Rounds: map[int64]bool{},
		Trajs: map[string]*schemas.Trajectory{}, Valid: map[string]bool{},
		Rewarded: map[string]*RewardInfo{}, Scored: map[string]*ScoredInfo{},
		BatchByID: map[string]int{}, BatchCount: map[string]int{}, Segments: map[string]SegRef{}, Admits: map[string]int{},
		CensusBy: map[string][]int{}, Flow: map[string]*Flow{}, Undecodable: map[string]int{},
		Redelivered: map[string]int{}, censusSeen: map[string]bool{},
	}
}

// Add decodes one message of the topic named short and records it. A
// message that does not decode is counted (Undecodable), never fatal: the
// quarantine of the stage that consumed it says what happened to it.
func (r *Records) Add(short string, m parquet.Message) {
	fl := r.Flow[short]
	if fl == nil {
		fl = &Flow{}
		r.Flow[short] = fl
	}
	fl.Messages++
	records, tokens, err := r.decode(short, m)
	if err != nil {
		r.Undecodable[short]++
		if len(r.Problems) < 20 {
			r.Problems = append(r.Problems, fmt.Sprintf("%s/%d@%d: %v", short, m.Partition, m.Offset, err))
		}
		return
	}
	fl.Records += records
	fl.Tokens += tokens
	fl.Points = append(fl.Points, FlowPoint{At: m.Time, Tokens: tokens})
}

// decode dispatches on the topic and returns the records and tokens the
// message held.
func (r *Records) decode(short string, m parquet.Message) (int, int64, error) {
	switch short {
	case "tasks":
		return r.addTasks(m)
	case "trajectories":
		return r.addTrajectories(m)
	case "valid":
		rows, err := schemas.Trajectories.Decode(nil, m.Value)
		for i := range rows {
			r.Valid[rows[i].RecordID] = true
		}
		return len(rows), trajTokens(rows, func(t *schemas.Trajectory) *schemas.Trajectory { return t }), err
	case "rewarded":
		return r.addRewarded(m)
	case "scored":
		return r.addScored(m)
	case "batches":
		return r.addBatch(m)
	case "census":
		return r.addCensus(m)
	case "incidents":
		inc, err := schemas.DecodeIncident(m.Value)
		if err == nil {
			r.Incidents = append(r.Incidents, inc)
		}
		return 1, 0, err
	case "policy":
		rel, err := schemas.DecodeRelease(m.Value)
		if err == nil {
			r.Releases = append(r.Releases, ReleaseMsg{rel, m.Time})
		}
		return 1, 0, err
	case "windows":
		w, err := schemas.DecodeWindow(m.Value)
		if err == nil {
			r.Windows = append(r.Windows, WindowMsg{w, m.Time})
		}
		return 1, w.Tokens, err
	case "quarantine":
		r.Quar = append(r.Quar, quarantined(m))
		return 1, 0, nil
	}
	return 1, 0, nil
}

func (r *Records) addTasks(m parquet.Message) (int, int64, error) {
	rows, err := schemas.TaskAttempts.Decode(nil, m.Value)
	if err != nil {
		return 0, 0, err
	}
	if v := header(m, schemas.HeaderRound); v != "" {
		if n, err := strconv.ParseInt(v, 10, 64); err == nil {
			r.Rounds[n] = true
		}
	}
	for _, a := range rows {
		if _, ok := r.Tasks[a.AttemptID]; ok {
			r.Redelivered["tasks"]++
			continue
		}
		r.Tasks[a.AttemptID] = a
		r.Launched = append(r.Launched, a.AttemptID)
	}
	return len(rows), 0, nil
}

func (r *Records) addTrajectories(m parquet.Message) (int, int64, error) {
	rows, err := schemas.Trajectories.Decode(nil, m.Value)
	if err != nil {
		return 0, 0, err
	}
	for i := range rows {
		t := rows[i]
		if _, ok := r.Trajs[t.RecordID]; ok {
			r.Redelivered["trajectories"]++
			continue
		}
		r.Trajs[t.RecordID] = &t
		r.TrajOrder = append(r.TrajOrder, t.RecordID)
	}
	return len(rows), trajTokens(rows, func(t *schemas.Trajectory) *schemas.Trajectory { return t }), nil
}

func (r *Records) addRewarded(m parquet.Message) (int, int64, error) {
	rows, err := schemas.RewardedTrajectories.Decode(nil, m.Value)
	if err != nil {
		return 0, 0, err
	}
	for i := range rows {
		if _, ok := r.Rewarded[rows[i].RecordID]; ok {
			r.Redelivered["rewarded"]++
			continue
		}
		r.Rewarded[rows[i].RecordID] = &RewardInfo{Rewards: rows[i].Rewards, Total: rows[i].RewardTotal}
	}
	return len(rows), trajTokens(rows, func(t *schemas.Rewarded) *schemas.Trajectory { return &t.Trajectory }), nil
}

func (r *Records) addScored(m parquet.Message) (int, int64, error) {
	rows, err := schemas.ScoredTrajectories.Decode(nil, m.Value)
	if err != nil {
		return 0, 0, err
	}
	for i := range rows {
		s := &rows[i]
		if _, ok := r.Scored[s.RecordID]; ok {
			r.Redelivered["scored"]++
			continue
		}
		r.Scored[s.RecordID] = &ScoredInfo{TurnRewards: s.TurnRewards, TurnReturns: s.TurnReturns,
			TurnAdvantages: s.TurnAdvantages, TurnValueTargets: s.TurnValueTargets, Group: s.Group,
			Estimator: s.Estimator, EstimatorVersion: s.EstimatorVersion}
	}
	return len(rows), trajTokens(rows, func(t *schemas.Scored) *schemas.Trajectory { return &t.Trajectory }), nil
}

func (r *Records) addBatch(m parquet.Message) (int, int64, error) {
	b, err := schemas.PackedBatches.Decode(nil, m.Value)
	if err != nil {
		return 0, 0, err
	}
	var tokens int64
	for _, row := range b.Rows {
		tokens += int64(len(row.InputIDs))
	}
	r.BatchCount[b.BatchID]++
	if _, ok := r.BatchByID[b.BatchID]; ok {
		// A repeated batch: its segments count as admitted again (a
		// duplicate admission), as internal/audit counts them.
		r.Redelivered["batches"]++
		for _, row := range b.Rows {
			for _, id := range row.SegTrajectoryIDs {
				r.Admits[id]++
			}
		}
		return len(b.Rows), tokens, nil
	}
	idx := len(r.Batches)
	r.Batches = append(r.Batches, &BatchRec{PackedBatch: b, Time: m.Time, Offset: m.Offset})
	r.BatchByID[b.BatchID] = idx
	for ri, row := range b.Rows {
		for si, id := range row.SegTrajectoryIDs {
			r.Admits[id]++
			if _, ok := r.Segments[id]; !ok {
				r.Segments[id] = SegRef{Batch: idx, Row: ri, Seg: si}
			}
		}
	}
	return len(b.Rows), tokens, nil
}

func (r *Records) addCensus(m parquet.Message) (int, int64, error) {
	ev, err := schemas.DecodeCensus(m.Value)
	if err != nil {
		return 0, 0, err
	}
	if ev.EventID != "" && r.censusSeen[ev.EventID] {
		r.Redelivered["census"]++
		return 1, 0, nil
	}
	r.censusSeen[ev.EventID] = true
	r.CensusBy[ev.AttemptID] = append(r.CensusBy[ev.AttemptID], len(r.Census))
	r.Census = append(r.Census, ev)
	return 1, ev.Tokens, nil
}

// quarantined reads a quarantine record's headers, and the ids of the
// trajectories it holds when its body is one of the trajectory kinds.
func quarantined(m parquet.Message) Quarantined {
	q := Quarantined{
		Reason: header(m, schemas.HeaderReason), Detail: header(m, schemas.HeaderDetail),
		Stage: header(m, schemas.HeaderStage), Kind: header(m, schemas.HeaderKind), ID: lastHeader(m, schemas.HeaderID),
		Time: m.Time, Partition: m.Partition, Offset: m.Offset,
	}
	if t := header(m, schemas.HeaderSourceTopic); t != "" {
		q.Source = fmt.Sprintf("%s/%s@%s", t, header(m, schemas.HeaderSourcePartition), header(m, schemas.HeaderSourceOffset))
	}
	var ids []string
	switch schemas.Kind(q.Kind) {
	case schemas.KindTrajectory:
		rows, _ := schemas.Trajectories.Decode(nil, m.Value)
		for i := range rows {
			ids = append(ids, rows[i].RecordID)
		}
	case schemas.KindRewarded:
		rows, _ := schemas.RewardedTrajectories.Decode(nil, m.Value)
		for i := range rows {
			ids = append(ids, rows[i].RecordID)
		}
	case schemas.KindScored:
		rows, _ := schemas.ScoredTrajectories.Decode(nil, m.Value)
		for i := range rows {
			ids = append(ids, rows[i].RecordID)
		}
	case schemas.KindTaskAttempt:
		rows, _ := schemas.TaskAttempts.Decode(nil, m.Value)
		for i := range rows {
			ids = append(ids, rows[i].AttemptID)
		}
	}
	q.Attempts = ids
	return q
}

func header(m parquet.Message, key string) string {
	for _, h := range m.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// lastHeader is the value of the last header named key: a refused row's
// quarantine record carries the message's headers, then the row's own.
func lastHeader(m parquet.Message, key string) string {
	v := ""
	for _, h := range m.Headers {
		if h.Key == key {
			v = string(h.Value)
		}
	}
	return v
}

// trajTokens counts every token (prompts, actions, observations) of rows.
func trajTokens[T any](rows []T, traj func(*T) *schemas.Trajectory) int64 {
	var n int64
	for i := range rows {
		n += int64(streamLen(traj(&rows[i])))
	}
	return n
}

// streamLen is the length of a trajectory's token stream.
func streamLen(t *schemas.Trajectory) int {
	n := 0
	for _, turn := range t.Turns {
		n += len(turn.PromptIDs) + len(turn.ActionIDs) + len(turn.ObservationIDs)
	}
	return n
}

// actionTokens counts a trajectory's policy-sampled tokens.
func actionTokens(t *schemas.Trajectory) int {
	n := 0
	for _, turn := range t.Turns {
		n += len(turn.ActionIDs)
	}
	return n
}
