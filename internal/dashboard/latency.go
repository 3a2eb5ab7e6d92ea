package dashboard

import (
	"cmp"
	"slices"

	"github.com/trajflow/trajflow/schemas"
)

// TailFactor defines the long tail of attempt times: an attempt whose wall
// time (finished minus started) exceeds this multiple of the median wall
// time of the attempts its policy version sampled. In a synchronous round
// the slowest attempt holds every other one (systems §6). The census's
// stragglers are another count: attempts not completed when an update
// began.
const TailFactor = 2.0

// slowestShown is how many of the slowest attempts the panel lists.
const slowestShown = 10

// Latency is where rollout time went (pipeline §20, the systems panel's
// environment latency and slow attempts): every turn's wait for
// the policy server and for the environment's step, every attempt's wall
// time, the share of attempt time each took, and the long tail, overall,
// by behavior version and by task domain. Trajectories without both
// times, or with a finish before the start, are counted in Untimed and
// left out of the attempt distributions; negative turn latencies are left
// out of the turn distributions.
type Latency struct {
	GenerationMS Dist `json:"generation_ms"`   // per turn
	EnvStepMS    Dist `json:"env_step_ms"`     // per turn
	AttemptS     Dist `json:"attempt_seconds"` // per timed attempt
	// GenerationShare and EnvShare are the turns' generation and
	// environment time over the timed attempts' wall time (0 with none).
	GenerationShare float64 `json:"generation_share"`
	EnvShare        float64 `json:"env_share"`
	Untimed         int     `json:"untimed_attempts"`
	TailFactor      float64 `json:"tail_factor"`
	Tail            int     `json:"tail_attempts"` // attempts in the long tail

	ByVersion []VersionTiming `json:"by_version"`
	ByDomain  []DomainTiming  `json:"by_domain"`
	Slowest   []SlowAttempt   `json:"slowest"` // slowest first
	Failures  []FailureRow    `json:"failures"`
}

// FailureRow counts the census's events of one kind, stage and reason
// among the failures of rollout: attempts that failed (run again when the
// failure is the infrastructure's) and environment calls retried (systems
// §12, §14). Rows are ordered by kind, then most events first.
type FailureRow struct {
	Kind     string `json:"kind"` // schemas.CensusFailed or schemas.CensusRetried
	Stage    string `json:"stage"`
	Reason   string `json:"reason"`
	Infra    bool   `json:"infra"`
	Events   int    `json:"events"`
	Attempts int    `json:"attempts"` // distinct attempts the events name
}

// VersionTiming is the attempts one policy version sampled.
type VersionTiming struct {
	Version      int64 `json:"version"`
	AttemptS     Dist  `json:"attempt_seconds"`
	Tail         int   `json:"tail_attempts"`
	GenerationMS Dist  `json:"generation_ms"`
	EnvStepMS    Dist  `json:"env_step_ms"`
}

// DomainTiming is the environment's side for one task domain: its step
// latency and its verdicts on the turns.
type DomainTiming struct {
	Domain    string `json:"domain"`
	Attempts  int    `json:"attempts"`
	Turns     int    `json:"turns"`
	EnvStepMS Dist   `json:"env_step_ms"`
	Invalid   int    `json:"turns_invalid"`
	Denied    int    `json:"turns_denied"`
}

// SlowAttempt is one of the slowest timed attempts.
type SlowAttempt struct {
	ID          string  `json:"id"`
	Task        string  `json:"task"`
	Version     int64   `json:"version"`
	Seconds     float64 `json:"seconds"`
	Turns       int     `json:"turns"`
	GenerationS float64 `json:"generation_seconds"`
	EnvS        float64 `json:"env_seconds"`
	InTail      bool    `json:"in_tail"`
	Outcome     string  `json:"outcome"` // the census fate, "" undecided
}

// timing is one trajectory's times.
type timing struct {
	t          *schemas.Trajectory
	seconds    float64 // -1: untimed
	gen, env   []float64
	genS, envS float64
}

func timingOf(t *schemas.Trajectory) timing {
	tm := timing{t: t, seconds: -1}
	if t.StartedAt > 0 && t.FinishedAt >= t.StartedAt {
		tm.seconds = float64(t.FinishedAt-t.StartedAt) / 1e6
	}
	for _, turn := range t.Turns {
		if turn.GenLatencyUS >= 0 {
			tm.gen = append(tm.gen, float64(turn.GenLatencyUS)/1e3)
			tm.genS += float64(turn.GenLatencyUS) / 1e6
		}
		if turn.EnvLatencyUS >= 0 {
			tm.env = append(tm.env, float64(turn.EnvLatencyUS)/1e3)
			tm.envS += float64(turn.EnvLatencyUS) / 1e6
		}
	}
	return tm
}

// latency builds the panel from every recorded trajectory; f gives the
// slowest attempts' fates.
func latency(r *Records, f map[string]Fate) Latency {
	l := Latency{TailFactor: TailFactor}
	byVersion := map[int64][]timing{}
	domains := map[string]*DomainTiming{}
	domainEnv := map[string][]float64{}
	var gen, env, attempt []float64
	var genTimed, envTimed, wall float64
	for _, id := range r.TrajOrder {
		tm := timingOf(r.Trajs[id])
		gen, env = append(gen, tm.gen...), append(env, tm.env...)
		v := behaviorVersion(tm.t)
		byVersion[v] = append(byVersion[v], tm)
		d := domains[tm.t.Domain]
		if d == nil {
			d = &DomainTiming{Domain: tm.t.Domain}
			domains[tm.t.Domain] = d
		}
		d.Attempts++
		d.Turns += len(tm.t.Turns)
		domainEnv[tm.t.Domain] = append(domainEnv[tm.t.Domain], tm.env...)
		for _, turn := range tm.t.Turns {
			switch turn.Decision {
			case schemas.DecisionInvalid:
				d.Invalid++
			case schemas.DecisionDenied:
				d.Denied++
			}
		}
		if tm.seconds < 0 {
			l.Untimed++
			continue
		}
		attempt = append(attempt, tm.seconds)
		wall += tm.seconds
		genTimed += tm.genS
		envTimed += tm.envS
	}
	l.GenerationMS, l.EnvStepMS, l.AttemptS = Summarize(gen), Summarize(env), Summarize(attempt)
	if wall > 0 {
		l.GenerationShare, l.EnvShare = genTimed/wall, envTimed/wall
	}
	var slow []SlowAttempt
	for _, v := range sortedKeys(byVersion) {
		vt, s := versionTiming(v, byVersion[v], f)
		l.Tail += vt.Tail
		l.ByVersion = append(l.ByVersion, vt)
		slow = append(slow, s...)
	}
	slices.SortStableFunc(slow, func(a, b SlowAttempt) int { return cmp.Compare(b.Seconds, a.Seconds) })
	l.Slowest = slow[:min(len(slow), slowestShown)]
	l.Failures = failures(r.Census)
	for _, k := range sortedKeys(domains) {
		d := domains[k]
		d.EnvStepMS = Summarize(domainEnv[k])
		l.ByDomain = append(l.ByDomain, *d)
	}
	return l
}

// versionTiming summarizes one version's attempts and returns them as
// SlowAttempts, those in the long tail marked against the version's
// median.
func versionTiming(v int64, tms []timing, f map[string]Fate) (VersionTiming, []SlowAttempt) {
	vt := VersionTiming{Version: v}
	var secs, gen, env []float64
	for _, tm := range tms {
		gen, env = append(gen, tm.gen...), append(env, tm.env...)
		if tm.seconds >= 0 {
			secs = append(secs, tm.seconds)
		}
	}
	vt.AttemptS, vt.GenerationMS, vt.EnvStepMS = Summarize(secs), Summarize(gen), Summarize(env)
	var out []SlowAttempt
	for _, tm := range tms {
		if tm.seconds < 0 {
			continue
		}
		s := SlowAttempt{ID: tm.t.RecordID, Task: tm.t.TaskID, Version: v, Seconds: tm.seconds, Turns: len(tm.t.Turns),
			GenerationS: tm.genS, EnvS: tm.envS, Outcome: f[tm.t.RecordID].Outcome}
		s.InTail = vt.AttemptS.P50 > 0 && tm.seconds > TailFactor*vt.AttemptS.P50
		if s.InTail {
			vt.Tail++
		}
		out = append(out, s)
	}
	return vt, out
}

// failures counts the failed and retried events of the census.
func failures(events []schemas.CensusEvent) []FailureRow {
	type key struct {
		kind, stage, reason string
		infra               bool
	}
	rows := map[key]*FailureRow{}
	attempts := map[key]map[string]bool{}
	for _, ev := range events {
		if ev.Kind != schemas.CensusFailed && ev.Kind != schemas.CensusRetried {
			continue
		}
		k := key{ev.Kind, ev.Stage, ev.Reason, ev.Infra}
		if rows[k] == nil {
			rows[k] = &FailureRow{Kind: ev.Kind, Stage: ev.Stage, Reason: ev.Reason, Infra: ev.Infra}
			attempts[k] = map[string]bool{}
		}
		rows[k].Events++
		attempts[k][ev.AttemptID] = true
	}
	out := make([]FailureRow, 0, len(rows))
	for k, r := range rows {
		r.Attempts = len(attempts[k])
		out = append(out, *r)
	}
	slices.SortFunc(out, func(a, b FailureRow) int {
		return cmp.Or(cmp.Compare(a.Kind, b.Kind), cmp.Compare(b.Events, a.Events),
			cmp.Compare(a.Stage+"/"+a.Reason, b.Stage+"/"+b.Reason), cmp.Compare(btoi(a.Infra), btoi(b.Infra)))
	})
	return out
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
