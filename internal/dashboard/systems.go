package dashboard

import (
	"slices"
	"strings"
	"time"

	"github.com/trajflow/trajflow/schemas"
)

// Systems is the systems panel: token rates of every stage (from the
// broker timestamps of its output messages), the trainer's, consumer lag
// (live), the accepted-token yield with every loss itemized by its census
// reason, weight-sync and training times per release, the policy lag of
// trained tokens, pack's windows and the rollouts' latency.
type Systems struct {
	Start     time.Time    `json:"start"`
	BucketS   float64      `json:"bucket_seconds"`
	Stages    []StageRate  `json:"stages"`
	Trainer   []TrainerRow `json:"trainer"`
	Lags      []GroupLag   `json:"consumer_lag"`
	LagNote   string       `json:"consumer_lag_note,omitempty"`
	Yield     Yield        `json:"yield"`
	Sync      []SyncRow    `json:"sync"`
	PolicyLag []LagCount   `json:"policy_lag"`
	Windows   []WindowRow  `json:"windows"`
	Latency   Latency      `json:"latency"`
}

// StageRate is the token rate of one stage's output topic.
type StageRate struct {
	Stage      string    `json:"stage"`
	Topic      string    `json:"topic"`
	Messages   int       `json:"messages"`
	Records    int       `json:"records"`
	Tokens     int64     `json:"tokens"`
	Seconds    float64   `json:"seconds"`
	TokensPerS float64   `json:"tokens_per_s"`
	Series     []float64 `json:"series"` // tokens/s per bucket from Start
}

// TrainerRow is one update: the batch's input tokens over the time since
// the previous release.
type TrainerRow struct {
	Version     int64   `json:"version"`
	Tokens      int64   `json:"tokens"`
	Seconds     float64 `json:"seconds"`
	TokensPerS  float64 `json:"tokens_per_s"`
	StepSeconds float64 `json:"step_seconds"`
}

// Yield is the share of generated action tokens that reached an update,
// with every loss itemized (docs/SYSTEMS.md §4).
type Yield struct {
	Generated int64   `json:"generated_action_tokens"`
	Trained   int64   `json:"trained_action_tokens"`
	Yield     float64 `json:"yield"`
	Losses    []Loss  `json:"losses"`
	// NoTrajectory counts launched attempts with no recorded trajectory
	// (failed before it, or still running); their tokens are unknown.
	NoTrajectory int `json:"attempts_without_trajectory"`
}

// Loss is one category of lost action tokens.
type Loss struct {
	Kind     string  `json:"kind"` // census kind, "masked" or "undecided"
	Reason   string  `json:"reason"`
	Attempts int     `json:"attempts"`
	Tokens   int64   `json:"action_tokens"`
	Share    float64 `json:"share"` // of generated action tokens
}

// SyncRow times one release: its batch's arrival on the batches topic to
// the manifest on the policy topic (training and publication), and the
// manifest to the first rollout sampled with it (weight sync, and in
// stop-and-synchronize mode the dispatch of the next round).
type SyncRow struct {
	Version      int64      `json:"version"`
	ReleasedAt   time.Time  `json:"released_at"`
	TrainSeconds *float64   `json:"train_seconds"`
	FirstRollout *time.Time `json:"first_rollout_at"`
	SyncSeconds  *float64   `json:"sync_seconds"`
	StepSeconds  *float64   `json:"step_seconds"`
}

// LagCount is the trained tokens at one policy lag.
type LagCount struct {
	Lag    int64 `json:"lag"`
	Tokens int64 `json:"tokens"`
}

// WindowRow is one pack window.
type WindowRow struct {
	BatchIndex  int64   `json:"batch_index"`
	BatchID     string  `json:"batch_id"`
	ClosedBy    string  `json:"closed_by"`
	Records     int     `json:"records"`
	Admitted    int     `json:"admitted"`
	Filtered    int     `json:"filtered"`
	Tokens      int64   `json:"tokens"`
	Trained     int64   `json:"trained_tokens"`
	Efficiency  float64 `json:"efficiency"`
	MaxLag      int64   `json:"max_lag"`
	RewardMean  float64 `json:"reward_mean"`
	SuccessRate float64 `json:"success_rate"`
}

// stageTopics are the data-plane topics and the stage producing each.
var stageTopics = [][2]string{{"tasks", "dispatch"}, {"trajectories", "rollout"}, {"valid", "validate"},
	{"rewarded", "reward"}, {"scored", "advantage"}, {"batches", "pack"}}

// buckets is the number of points of every rate series.
const buckets = 40

func systems(st *State, f map[string]Fate) Systems {
	r := st.Records
	s := Systems{Yield: yield(r, f), PolicyLag: policyLag(r), Windows: windows(r), Latency: latency(r, f), Lags: st.Lags, LagNote: st.LagError}
	if !st.Live {
		s.LagNote = "consumer lag is read live from the cluster's committed offsets (snapshots hold no consumer offsets)"
	}
	s.stageRates(r)
	s.trainerAndSync(st)
	return s
}

// stageRates fills Stages from the topics' message times.
func (s *Systems) stageRates(r *Records) {
	var t0, t1 time.Time
	for _, fl := range r.Flow {
		for _, p := range fl.Points {
			if p.At.IsZero() {
				continue
			}
			if t0.IsZero() || p.At.Before(t0) {
				t0 = p.At
			}
			if p.At.After(t1) {
				t1 = p.At
			}
		}
	}
	span := t1.Sub(t0).Seconds()
	s.Start, s.BucketS = t0, max(span, 1e-3)/buckets
	for _, st := range stageTopics {
		fl := r.Flow[st[0]]
		if fl == nil {
			continue
		}
		sr := StageRate{Stage: st[1], Topic: st[0], Messages: fl.Messages, Records: fl.Records, Tokens: fl.Tokens, Series: make([]float64, buckets)}
		var first, last time.Time
		for _, p := range fl.Points {
			if p.At.IsZero() {
				continue
			}
			if first.IsZero() || p.At.Before(first) {
				first = p.At
			}
			last = maxTime(last, p.At)
			b := min(buckets-1, int(p.At.Sub(t0).Seconds()/s.BucketS))
			sr.Series[b] += float64(p.Tokens) / s.BucketS
		}
		sr.Seconds = last.Sub(first).Seconds()
		if sr.Seconds > 0 {
			sr.TokensPerS = float64(fl.Tokens) / sr.Seconds
		}
		s.Stages = append(s.Stages, sr)
	}
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// trainerAndSync fills Trainer and Sync from the policy topic, the update
// records and the first rollout of every version.
func (s *Systems) trainerAndSync(st *State) {
	r := st.Records
	rels := map[int64]time.Time{}
	for _, rel := range r.Releases {
		if _, ok := rels[rel.PolicyVersion]; !ok {
			rels[rel.PolicyVersion] = rel.Time
		}
	}
	firstUse := map[int64]time.Time{}
	for _, t := range r.Trajs {
		v := behaviorVersion(t)
		at := time.UnixMicro(t.StartedAt)
		if u, ok := firstUse[v]; t.StartedAt > 0 && (!ok || at.Before(u)) {
			firstUse[v] = at
		}
	}
	for _, v := range sortedKeys(rels) {
		row := SyncRow{Version: v, ReleasedAt: rels[v]}
		if u, ok := firstUse[v]; ok {
			d := u.Sub(rels[v]).Seconds()
			row.FirstRollout, row.SyncSeconds = &u, &d
		}
		if u, ok := st.Releases.Update(v); ok {
			step := u.StepSeconds
			row.StepSeconds = &step
			if i, ok := r.BatchByID[u.BatchID]; ok && !r.Batches[i].Time.IsZero() {
				d := rels[v].Sub(r.Batches[i].Time).Seconds()
				row.TrainSeconds = &d
			}
			if prev, ok := rels[v-1]; ok {
				tr := TrainerRow{Version: v, Tokens: u.Metrics.InputTokens, Seconds: rels[v].Sub(prev).Seconds(), StepSeconds: u.StepSeconds}
				if tr.Seconds > 0 {
					tr.TokensPerS = float64(tr.Tokens) / tr.Seconds
				}
				s.Trainer = append(s.Trainer, tr)
			}
		}
		s.Sync = append(s.Sync, row)
	}
}

// yield itemizes what became of the action tokens of every recorded
// trajectory: trained (mask 1 in its batch), masked in its batch
// (truncated, stale turns, duplicates), or lost with its census fate.
func yield(r *Records, f map[string]Fate) Yield {
	var y Yield
	losses := map[[2]string]*Loss{}
	lose := func(kind, reason string, tokens int64) {
		k := [2]string{kind, reason}
		l := losses[k]
		if l == nil {
			l = &Loss{Kind: kind, Reason: reason}
			losses[k] = l
		}
		l.Attempts++
		l.Tokens += tokens
	}
	for _, id := range r.TrajOrder {
		act := int64(actionTokens(r.Trajs[id]))
		y.Generated += act
		fate := f[id]
		if ref, ok := r.Segments[id]; ok {
			trained := segmentTrained(r, ref)
			y.Trained += trained
			if act > trained {
				lose("masked", "not a target in its batch (truncated, stale or duplicate)", act-trained)
			}
			continue
		}
		switch fate.Outcome {
		case "":
			lose("undecided", "no decision yet", act)
		case schemas.CensusAdmitted:
			lose("undecided", "admitted, batch not read", act)
		default:
			lose(fate.Outcome, fate.Stage+": "+fate.Reason, act)
		}
	}
	for _, id := range r.Launched {
		if _, ok := r.Trajs[id]; !ok {
			y.NoTrajectory++
		}
	}
	y.Yield = ratio64(y.Trained, y.Generated)
	for _, l := range losses {
		l.Share = ratio64(l.Tokens, y.Generated)
		y.Losses = append(y.Losses, *l)
	}
	slices.SortFunc(y.Losses, func(a, b Loss) int {
		if a.Tokens != b.Tokens {
			return int(b.Tokens - a.Tokens)
		}
		return strings.Compare(a.Kind+a.Reason, b.Kind+b.Reason)
	})
	return y
}

func ratio64(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// segmentTrained counts the targets of a segment with mask 1.
func segmentTrained(r *Records, ref SegRef) int64 {
	row := &r.Batches[ref.Batch].Rows[ref.Row]
	var n int64
	for i, s := range row.SegmentIDs {
		if int(s) == ref.Seg && i < len(row.ActionMask) && row.ActionMask[i] == 1 {
			n++
		}
	}
	return n
}

// policyLag counts trained tokens by lag (trainer version at packing
// minus the behavior version of the token).
func policyLag(r *Records) []LagCount {
	m := map[int64]int64{}
	for _, b := range r.Batches {
		for _, row := range b.Rows {
			for i, mask := range row.ActionMask {
				if mask == 1 && i < len(row.PolicyVersions) {
					m[b.TrainerVersion-int64(row.PolicyVersions[i])]++
				}
			}
		}
	}
	var out []LagCount
	for _, k := range sortedKeys(m) {
		out = append(out, LagCount{Lag: k, Tokens: m[k]})
	}
	return out
}

func windows(r *Records) []WindowRow {
	var out []WindowRow
	for _, w := range r.Windows {
		out = append(out, WindowRow{BatchIndex: w.BatchIndex, BatchID: w.BatchID, ClosedBy: w.ClosedBy, Records: w.Records,
			Admitted: len(w.Admitted), Filtered: len(w.Filtered), Tokens: w.Tokens, Trained: w.TrainedTokens,
			Efficiency: w.Efficiency, MaxLag: w.MaxLag, RewardMean: w.RewardMean, SuccessRate: w.SuccessRate})
	}
	return out
}
