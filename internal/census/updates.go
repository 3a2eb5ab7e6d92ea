package census

import (
	"fmt"
	"io"
	"slices"
	"sort"

	"github.com/trajflow/trajflow/schemas"
)

// life is what the census events say about one attempt.
type life struct {
	task                     string
	round                    int64 // dispatch round (dispatched event's update)
	dispatched               bool
	dispatchedAt             int64 // µs
	started                  bool
	startedAt                int64 // µs, the first start
	completedAt              int64 // µs; 0: never completed
	trainedAt                int64 // µs
	latencyUS, tokens        int64
	trained, excluded        bool
	update, version          int64 // the update (batch index) that trained or excluded it
	staleTokens              int64 // excluded as stale, at pack or at the update
	excludedAtUpdate, onPack bool
	reward                   float64
	hasReward                bool
}

// observe folds one distinct census event into the attempt's life.
func (r *Report) observe(ev *schemas.CensusEvent) {
	l := r.lives[ev.AttemptID]
	if l == nil {
		l = &life{update: -1}
		r.lives[ev.AttemptID] = l
	}
	l.staleTokens += ev.StaleTokens
	r.StaleTokens += ev.StaleTokens
	switch ev.Kind {
	case schemas.CensusDispatched:
		l.dispatched, l.task, l.round, l.dispatchedAt = true, ev.TaskID, ev.Update, ev.At
	case schemas.CensusStarted:
		if !l.started || ev.At < l.startedAt {
			l.started, l.startedAt = true, ev.At
		}
	case schemas.CensusCompleted:
		l.completedAt, l.latencyUS, l.tokens = ev.At, ev.LatencyUS, ev.Tokens
	case schemas.CensusTrained:
		l.trained, l.update, l.version, l.trainedAt = true, ev.Update, ev.PolicyVersion, ev.At
		r.updateAt(ev.Update, ev.At, ev.PolicyVersion)
	case schemas.CensusFiltered:
		if ev.Stage == "train" {
			l.excluded, l.excludedAtUpdate, l.update = true, true, ev.Update
			r.updateAt(ev.Update, ev.At, ev.PolicyVersion+1)
		} else if ev.StaleTokens > 0 {
			l.onPack = true
		}
	}
}

// updateAt records when update u (a batch index) began: the trainer's
// census events of one update share their time.
func (r *Report) updateAt(u, at, version int64) {
	if cur, ok := r.updateStart[u]; !ok || at < cur {
		r.updateStart[u] = at
	}
	if version > r.updateVersion[u] {
		r.updateVersion[u] = version
	}
}

// UpdateRow is the selection-bias account of one update (docs/PIPELINE.md §18
// gate E, docs/SYSTEMS.md §6): what was trained against what was launched in the
// rounds that fed it, and the stragglers at its boundary.
type UpdateRow struct {
	Update  int64 // batch index
	Version int64 // policy version the update produced
	Rounds  []int64
	// Launched are the attempts of Rounds; Trained those the update
	// trained, Excluded those it excluded (lag rule at the update).
	Launched, Trained, Excluded int
	// Means over launched and trained attempts: reward (attempts with a
	// reward), length (tokens), latency (ms); distinct tasks.
	RewardLaunched, RewardTrained   float64
	LengthLaunched, LengthTrained   float64
	LatencyLaunched, LatencyTrained float64
	TasksLaunched, TasksTrained     int
	// StaleTokens excluded at this update.
	StaleTokens int64
	// Stragglers were dispatched before the update began and had not
	// completed: the rule at the boundary is the contract's (sync: none
	// can exist; async: they finish on their snapshot, or continue with
	// the newer policy). StragglersTrained of them were trained later,
	// StragglersExcluded excluded as stale (at pack or at an update).
	Stragglers, StragglersTrained, StragglersExcluded int
}

// Updates returns the per-update selection account, by update.
func (r *Report) Updates() []UpdateRow {
	rounds := map[int64][]string{} // round -> attempts
	byUpdate := map[int64][]string{}
	for id, l := range r.lives {
		if l.dispatched {
			rounds[l.round] = append(rounds[l.round], id)
		}
		if l.update >= 0 {
			byUpdate[l.update] = append(byUpdate[l.update], id)
		}
	}
	var out []UpdateRow
	for u, ids := range byUpdate {
		row := UpdateRow{Update: u, Version: r.updateVersion[u]}
		fed := map[int64]bool{}
		var trained []*life
		for _, id := range ids {
			l := r.lives[id]
			if l.trained {
				row.Trained++
				trained = append(trained, l)
			} else {
				row.Excluded++
			}
			row.StaleTokens += l.staleTokensAt(u)
			if l.dispatched {
				fed[l.round] = true
			}
		}
		var launched []*life
		for rd := range fed {
			row.Rounds = append(row.Rounds, rd)
			for _, id := range rounds[rd] {
				launched = append(launched, r.lives[id])
			}
		}
		slices.Sort(row.Rounds)
		row.Launched = len(launched)
		row.RewardLaunched, row.LengthLaunched, row.LatencyLaunched, row.TasksLaunched = means(launched)
		row.RewardTrained, row.LengthTrained, row.LatencyTrained, row.TasksTrained = means(trained)
		start := r.updateStart[u]
		for _, l := range r.lives {
			if !l.dispatched || l.dispatchedAt >= start || (l.completedAt != 0 && l.completedAt < start) {
				continue
			}
			row.Stragglers++
			switch {
			case l.trained:
				row.StragglersTrained++
			case l.staleTokens > 0:
				row.StragglersExcluded++
			}
		}
		out = append(out, row)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Update < out[j].Update })
	return out
}

// staleTokensAt is what the attempt lost to the lag rule at update u
// (everything, for an attempt excluded or trained there).
func (l *life) staleTokensAt(u int64) int64 {
	if l.update == u {
		return l.staleTokens
	}
	return 0
}

// means of reward, length and latency, and distinct tasks.
func means(ls []*life) (reward, length, latency float64, tasks int) {
	var nr int
	seen := map[string]bool{}
	for _, l := range ls {
		if l.hasReward {
			reward += l.reward
			nr++
		}
		length += float64(l.tokens)
		latency += float64(l.latencyUS) / 1000
		seen[l.task] = true
	}
	if nr > 0 {
		reward /= float64(nr)
	}
	if n := float64(len(ls)); n > 0 {
		length /= n
		latency /= n
	}
	return reward, length, latency, len(seen)
}

// Timeline is where the trained attempts' time in flight went, in
// milliseconds, each sorted: Waiting from dispatched to started (in the
// tasks topic, for a rollout worker), Running from started to completed,
// ToUpdate from completed to trained (the hops to pack, the pack window,
// the trainer). An attempt missing one of those four events is left out.
// A long wait with idle workers is a dispatch or partitioning problem; a
// long way to the update, a window that fills slowly.
type Timeline struct {
	Waiting, Running, ToUpdate []float64
}

// Timeline collects the trained attempts' Timeline.
func (r *Report) Timeline() Timeline {
	var t Timeline
	for _, l := range r.lives {
		if !l.trained || !l.dispatched || !l.started || l.completedAt == 0 {
			continue
		}
		t.Waiting = append(t.Waiting, float64(l.startedAt-l.dispatchedAt)/1000)
		t.Running = append(t.Running, float64(l.completedAt-l.startedAt)/1000)
		t.ToUpdate = append(t.ToUpdate, float64(l.trainedAt-l.completedAt)/1000)
	}
	slices.Sort(t.Waiting)
	slices.Sort(t.Running)
	slices.Sort(t.ToUpdate)
	return t
}

// StaleShare is the share of policy-sampled tokens of the recorded
// trajectories that the lag rule took out of training (at pack or at the
// update), with its numerator and denominator.
func (r *Report) StaleShare() (share float64, stale, generated int64) {
	if r.GeneratedTokens == 0 {
		return 0, r.StaleTokens, 0
	}
	return float64(r.StaleTokens) / float64(r.GeneratedTokens), r.StaleTokens, r.GeneratedTokens
}

// roundsWithoutUpdate returns the rounds with dispatched attempts that fed
// none of rows, and how many attempts they launched.
func (r *Report) roundsWithoutUpdate(rows []UpdateRow) ([]int64, int) {
	fed := map[int64]bool{}
	for _, u := range rows {
		for _, rd := range u.Rounds {
			fed[rd] = true
		}
	}
	launched := map[int64]int{}
	for _, l := range r.lives {
		if l.dispatched && !fed[l.round] {
			launched[l.round]++
		}
	}
	var idle []int64
	n := 0
	for rd, k := range launched {
		idle = append(idle, rd)
		n += k
	}
	slices.Sort(idle)
	return idle, n
}

// PrintUpdates writes the per-update selection account.
func (r *Report) PrintUpdates(w io.Writer) {
	rows := r.Updates()
	share, stale, gen := r.StaleShare()
	fmt.Fprintf(w, "\nstale share: %.4f (%d of %d policy tokens taken out by the lag rule, at pack or at the update)\n", share, stale, gen)
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(w, "per update: batch = the batch index it trained, version = the policy version it made (the demo's update number);")
	fmt.Fprintln(w, "  launched = attempts of the rounds that fed it (in async mode a round can feed two updates); stragglers = dispatched, not completed when it began")
	fmt.Fprintf(w, "  %6s %7s %7s %7s %5s %15s %13s %17s %11s %6s %s\n", "batch", "version", "rounds", "trained", "excl",
		"reward L/T", "length L/T", "latency ms L/T", "tasks L/T", "stale", "stragglers (trained/excluded)")
	for _, u := range rows {
		rs := fmt.Sprint(u.Rounds)
		if len(u.Rounds) > 0 {
			rs = fmt.Sprintf("%d-%d", u.Rounds[0], u.Rounds[len(u.Rounds)-1])
		}
		fmt.Fprintf(w, "  %6d %7d %7s %3d/%-3d %5d %7.3f/%-7.3f %6.1f/%-6.1f %8.1f/%-8.1f %5d/%-5d %6d %d (%d/%d)\n",
			u.Update, u.Version, rs, u.Trained, u.Launched, u.Excluded, u.RewardLaunched, u.RewardTrained,
			u.LengthLaunched, u.LengthTrained, u.LatencyLaunched, u.LatencyTrained, u.TasksLaunched, u.TasksTrained,
			u.StaleTokens, u.Stragglers, u.StragglersTrained, u.StragglersExcluded)
	}
	if idle, n := r.roundsWithoutUpdate(rows); len(idle) > 0 {
		fmt.Fprintf(w, "  rounds that fed no update: %v (%d attempts: every record filtered, or not trained yet)\n", idle, n)
	}
	var bias []float64
	for _, u := range rows {
		if u.LatencyLaunched > 0 {
			bias = append(bias, u.LatencyTrained/u.LatencyLaunched)
		}
	}
	if len(bias) > 0 {
		var s float64
		for _, b := range bias {
			s += b
		}
		fmt.Fprintf(w, "  mean latency trained / launched per update: %.3f (1 = no selection by latency)\n", s/float64(len(bias)))
	}
}
