package census

import (
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"strings"

	"github.com/trajflow/trajflow/schemas"
)

// Print writes the funnel, the by-task table (the top tasks by launched
// attempts) and the launched vs admitted distributions; a partial report
// (Unreadable files) says so first, naming every file it lacks.
func (r *Report) Print(w io.Writer, top int) {
	if r.Partial() {
		fmt.Fprintf(w, "PARTIAL: %d snapshot file(s) unreadable; every count below lacks their records:\n", len(r.Unreadable))
		for _, f := range r.Unreadable {
			fmt.Fprintf(w, "  %s\n", f.File.Path)
		}
		fmt.Fprintln(w)
	}
	r.printFunnel(w)
	adm := r.admitted()
	fmt.Fprintf(w, "\nlaunched vs admitted (launched n=%d recorded trajectories, admitted n=%d)\n", len(r.Launched), len(adm))
	r.printByTask(w, top)
	dist := func(name string, pick func(Attempt) (float64, bool)) {
		fmt.Fprintf(w, "  %-12s launched %s\n  %-12s admitted %s\n", name, summary(values(r.Launched, pick)), "", summary(values(adm, pick)))
	}
	fmt.Fprintln(w, "distributions (n, mean, p10, p50, p90):")
	dist("reward", func(f Attempt) (float64, bool) { return f.Reward, f.HasReward })
	dist("length", func(f Attempt) (float64, bool) { return float64(f.Tokens), true })
	dist("latency ms", func(f Attempt) (float64, bool) { return f.LatencyMS, true })
	tl := r.Timeline()
	fmt.Fprintln(w, "time in flight of the trained attempts, ms (n, mean, p10, p50, p90):")
	fmt.Fprintf(w, "  %-12s %s   dispatched -> started (in the tasks topic, for a rollout worker)\n", "waiting", summary(tl.Waiting))
	fmt.Fprintf(w, "  %-12s %s   started -> completed\n", "running", summary(tl.Running))
	fmt.Fprintf(w, "  %-12s %s   completed -> trained (hops to pack, the pack window, the trainer)\n", "to update", summary(tl.ToUpdate))
	r.PrintUpdates(w)
}

// printFunnel writes every census kind with its share of the launched
// attempts (dispatched events, or the recorded trajectories without them).
func (r *Report) printFunnel(w io.Writer) {
	launched := r.Count(schemas.CensusDispatched)
	source := "dispatched events"
	if launched == 0 {
		launched = len(r.Launched)
		source = "recorded trajectories"
	}
	pct := func(n int) string {
		if launched == 0 {
			return "-"
		}
		return fmt.Sprintf("%5.1f%%", 100*float64(n)/float64(launched))
	}
	fmt.Fprintf(w, "attempt funnel (%d distinct census events; denominator: %d launched attempts, from %s)\n", r.Events, launched, source)
	line := func(name string, n int) { fmt.Fprintf(w, "  %-34s %8d  %s\n", name, n, pct(n)) }
	line("launched", launched)
	line("dispatched", r.Count(schemas.CensusDispatched))
	line("started", r.Count(schemas.CensusStarted))
	line("completed", r.Count(schemas.CensusCompleted))
	line("failed (infrastructure)", len(r.FailedInfra))
	line("failed (task)", len(r.FailedTask))
	line("timed out", r.Count(schemas.CensusTimedOut))
	for _, kind := range []string{schemas.CensusQuarantined, schemas.CensusFiltered} {
		line(kind, r.Count(kind))
		var keys []string
		for k := range r.Reasons {
			if strings.HasPrefix(k, kind+"/") {
				keys = append(keys, k)
			}
		}
		sort.Strings(keys)
		for _, k := range keys {
			line("  "+strings.TrimPrefix(k, kind+"/"), len(r.Reasons[k]))
		}
	}
	line("admitted", r.Count(schemas.CensusAdmitted))
	line("trained", r.Count(schemas.CensusTrained))
	if len(r.Retried) > 0 {
		reasons := make([]string, 0, len(r.Retried))
		n := 0
		for k, v := range r.Retried {
			reasons = append(reasons, k)
			n += v
		}
		sort.Strings(reasons)
		fmt.Fprintf(w, "environment calls retried (events, not attempts): %d\n", n)
		for _, k := range reasons {
			fmt.Fprintf(w, "  %-34s %8d\n", k, r.Retried[k])
		}
	}
	r.printQuarantine(w)
}

// printQuarantine writes the quarantine topic's records and those tied to
// no attempt, by reason; then what the snapshot lacks.
func (r *Report) printQuarantine(w io.Writer) {
	n := 0
	reasons := make([]string, 0, len(r.Unattributed))
	for k, v := range r.Unattributed {
		reasons = append(reasons, k)
		n += v
	}
	sort.Strings(reasons)
	fmt.Fprintf(w, "quarantine topic: %d records, %d tied to no attempt (not in the funnel above)\n", r.QuarantineRecords, n)
	for _, k := range reasons {
		fmt.Fprintf(w, "  %-34s %8d\n", k, r.Unattributed[k])
	}
	for _, s := range r.Warnings {
		fmt.Fprintf(w, "warning: snapshot incomplete: %s\n", s)
	}
}

// admitted are the launched attempts that were admitted to a batch.
func (r *Report) admitted() []Attempt {
	var adm []Attempt
	for _, f := range r.Launched {
		if r.Admitted[f.ID] {
			adm = append(adm, f)
		}
	}
	return adm
}

// printByTask writes launched, admitted and the admission rate of the top
// tasks by launched attempts.
func (r *Report) printByTask(w io.Writer, top int) {
	fmt.Fprintf(w, "by task (top %d by launched):\n  %-40s %9s %9s %9s\n", top, "task", "launched", "admitted", "rate")
	type row struct {
		task string
		l, a int
	}
	byTask := map[string]*row{}
	for _, f := range r.Launched {
		if byTask[f.Task] == nil {
			byTask[f.Task] = &row{task: f.Task}
		}
		byTask[f.Task].l++
		if r.Admitted[f.ID] {
			byTask[f.Task].a++
		}
	}
	rows := make([]*row, 0, len(byTask))
	for _, v := range byTask {
		rows = append(rows, v)
	}
	slices.SortFunc(rows, func(a, b *row) int {
		if a.l != b.l {
			return b.l - a.l
		}
		return strings.Compare(a.task, b.task)
	})
	for i, v := range rows {
		if i == top {
			fmt.Fprintf(w, "  ... %d more tasks\n", len(rows)-top)
			break
		}
		fmt.Fprintf(w, "  %-40s %9d %9d %8.1f%%\n", v.task, v.l, v.a, 100*float64(v.a)/float64(v.l))
	}
}

// values picks one value of every attempt that has it, sorted.
func values(fs []Attempt, pick func(Attempt) (float64, bool)) []float64 {
	var out []float64
	for _, f := range fs {
		if v, ok := pick(f); ok {
			out = append(out, v)
		}
	}
	slices.Sort(out)
	return out
}

// summary formats n, mean and quantiles of sorted values.
func summary(v []float64) string {
	if len(v) == 0 {
		return "n=0"
	}
	var sum float64
	for _, x := range v {
		sum += x
	}
	q := func(p float64) float64 { return v[int(math.Min(float64(len(v)-1), math.Floor(p*float64(len(v)))))] }
	return fmt.Sprintf("n=%-7d mean=%-10.4g p10=%-10.4g p50=%-10.4g p90=%-10.4g", len(v), sum/float64(len(v)), q(0.1), q(0.5), q(0.9))
}
