package main

import (
	"context"
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"strings"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/schemas"
)

func init() {
	register("census", "census DIR: the attempt funnel of a run and the launched vs admitted distributions, from its snapshots", cmdCensus)
}

// censusReport is the attempt census of a run (pipeline §6, §9; systems §6).
type censusReport struct {
	Events      int                        // distinct census events
	Kinds       map[string]map[string]bool // kind -> attempts
	Reasons     map[string]map[string]bool // "kind/reason" -> attempts
	FailedInfra map[string]bool
	FailedTask  map[string]bool
	Launched    []attemptFacts // attempts whose trajectory was recorded
	Admitted    map[string]bool
}

// attemptFacts is what the selection-bias check compares.
type attemptFacts struct {
	ID        string
	Task      string
	Reward    float64
	HasReward bool
	Tokens    int
	LatencyMS float64
}

func cmdCensus(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("census", stderr)
	runName := fs.String("run", "", "run to read when DIR holds several")
	top := fs.Int("tasks", 20, "rows of the by-task table")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return fmt.Errorf("%w: trajflow census DIR", errUsage)
	}
	runDir, err := parquet.FindRun(pos[0], *runName)
	if err != nil {
		return err
	}
	rep, err := collectCensus(runDir)
	if err != nil {
		return err
	}
	rep.print(stdout, *top)
	return nil
}

func collectCensus(runDir string) (*censusReport, error) {
	snap, err := parquet.ReadRun(runDir, []string{"census", "trajectories", "rewarded"}, parquet.ReadOptions{})
	if err != nil {
		return nil, err
	}
	r := &censusReport{Kinds: map[string]map[string]bool{}, Reasons: map[string]map[string]bool{},
		FailedInfra: map[string]bool{}, FailedTask: map[string]bool{}, Admitted: map[string]bool{}}
	seen := map[string]bool{}
	add := func(m map[string]map[string]bool, k, id string) {
		if m[k] == nil {
			m[k] = map[string]bool{}
		}
		m[k][id] = true
	}
	for _, m := range snap.Topics["census"] {
		ev, err := schemas.DecodeCensus(m.Value)
		if err != nil {
			return nil, fmt.Errorf("census event at %d@%d: %w", m.Partition, m.Offset, err)
		}
		if ev.EventID != "" && seen[ev.EventID] {
			continue // redelivered
		}
		seen[ev.EventID] = true
		r.Events++
		add(r.Kinds, ev.Kind, ev.AttemptID)
		switch ev.Kind {
		case schemas.CensusQuarantined, schemas.CensusFiltered:
			add(r.Reasons, ev.Kind+"/"+ev.Reason, ev.AttemptID)
		case schemas.CensusFailed:
			if ev.Infra {
				r.FailedInfra[ev.AttemptID] = true
			} else {
				r.FailedTask[ev.AttemptID] = true
			}
		case schemas.CensusAdmitted:
			r.Admitted[ev.AttemptID] = true
		}
	}
	rewards := map[string]float64{}
	for _, m := range snap.Topics["rewarded"] {
		rows, err := schemas.RewardedTrajectories.Decode(nil, m.Value)
		if err != nil {
			continue // quarantined upstream of nothing: a rewarded message always decodes
		}
		for _, row := range rows {
			rewards[row.RecordID] = row.RewardTotal
		}
	}
	done := map[string]bool{}
	for _, m := range snap.Topics["trajectories"] {
		rows, err := schemas.Trajectories.Decode(nil, m.Value)
		if err != nil {
			continue // the validate stage quarantined it; the census counts it
		}
		for _, t := range rows {
			if done[t.RecordID] {
				continue
			}
			done[t.RecordID] = true
			f := attemptFacts{ID: t.RecordID, Task: t.TaskID, LatencyMS: float64(t.FinishedAt-t.StartedAt) / 1000}
			for _, turn := range t.Turns {
				f.Tokens += len(turn.PromptIDs) + len(turn.ActionIDs) + len(turn.ObservationIDs)
			}
			f.Reward, f.HasReward = rewards[t.RecordID]
			r.Launched = append(r.Launched, f)
		}
	}
	slices.SortFunc(r.Launched, func(a, b attemptFacts) int { return strings.Compare(a.ID, b.ID) })
	return r, nil
}

func (r *censusReport) count(kind string) int { return len(r.Kinds[kind]) }

func (r *censusReport) print(w io.Writer, top int) {
	launched := r.count(schemas.CensusDispatched)
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
	line("dispatched", r.count(schemas.CensusDispatched))
	line("started", r.count(schemas.CensusStarted))
	line("completed", r.count(schemas.CensusCompleted))
	line("failed (infrastructure)", len(r.FailedInfra))
	line("failed (task)", len(r.FailedTask))
	line("timed out", r.count(schemas.CensusTimedOut))
	for _, kind := range []string{schemas.CensusQuarantined, schemas.CensusFiltered} {
		line(kind, r.count(kind))
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
	line("admitted", r.count(schemas.CensusAdmitted))
	line("trained", r.count(schemas.CensusTrained))

	// Selection-bias check (systems §6): what was admitted against what
	// was launched, with the denominators.
	var adm []attemptFacts
	for _, f := range r.Launched {
		if r.Admitted[f.ID] {
			adm = append(adm, f)
		}
	}
	fmt.Fprintf(w, "\nlaunched vs admitted (launched n=%d recorded trajectories, admitted n=%d)\n", len(r.Launched), len(adm))
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
	dist := func(name string, pick func(attemptFacts) (float64, bool)) {
		vals := func(fs []attemptFacts) []float64 {
			var out []float64
			for _, f := range fs {
				if v, ok := pick(f); ok {
					out = append(out, v)
				}
			}
			slices.Sort(out)
			return out
		}
		l, a := vals(r.Launched), vals(adm)
		fmt.Fprintf(w, "  %-12s launched %s\n  %-12s admitted %s\n", name, summary(l), "", summary(a))
	}
	fmt.Fprintln(w, "distributions (n, mean, p10, p50, p90):")
	dist("reward", func(f attemptFacts) (float64, bool) { return f.Reward, f.HasReward })
	dist("length", func(f attemptFacts) (float64, bool) { return float64(f.Tokens), true })
	dist("latency ms", func(f attemptFacts) (float64, bool) { return f.LatencyMS, true })
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
