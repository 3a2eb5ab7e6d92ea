package validate

import (
	"math"
	"slices"

	"github.com/trajflow/trajflow/schemas"
)

// A check inspects one property of a trajectory and returns accepted when it
// holds.
type check func(t *schemas.Trajectory, o *Options) Verdict

// checks run in this order; Check reports the first failure. Incidents come
// first so that a leaked evaluation task is raised as an incident even when
// the same record is also broken in another way.
var checks = []check{
	checkEvalTask,
	checkIncidentEnd,
	checkIDs,
	checkGroupMember,
	checkStatus,
	checkVersions,
	checkTimestamps,
	checkTurnsPresent,
	checkDuplicateTurn,
	checkTurnOrder,
	checkEmptyPrompt,
	checkEmptyAction,
	checkLogprobLength,
	checkLogprobFinite,
	checkLogprobSign,
	checkTokenRange,
	checkPolicyVersion,
	checkDecision,
	checkValue,
	checkEndState,
	checkBootstrap,
	checkBudget,
}

// Check classifies a finalized trajectory (docs/PIPELINE.md §9). It returns the
// first failing check in a fixed order (incidents before infrastructure
// faults; trajectory-level before turn-level), so the same record always
// gets the same verdict. t is not modified. A nil t is infra-invalid.
//
// What Check does not cover: duplicate delivery (deduplicated by record id
// downstream, docs/GUARANTEES.md) and group completeness (the advantage
// stage's declared partial-group policy, docs/PIPELINE.md §10).
func Check(t *schemas.Trajectory, opts Options) Verdict {
	if t == nil {
		return reject(ReasonMissingID, "nil trajectory")
	}
	for i := range checks {
		if v := checks[i](t, &opts); v.Class != Valid {
			return v
		}
	}
	return accepted
}

func checkEvalTask(t *schemas.Trajectory, o *Options) Verdict {
	if t.Split == schemas.SplitEval {
		return reject(ReasonEvalTaskID, "task %q has split %q", t.TaskID, t.Split)
	}
	if o.EvalDenylist != nil && t.TaskID != "" && o.EvalDenylist(t.TaskID) {
		return reject(ReasonEvalTaskID, "task %q is on the evaluation denylist", t.TaskID)
	}
	return accepted
}

func checkIncidentEnd(t *schemas.Trajectory, o *Options) Verdict {
	if t.EndReason != "" && slices.Contains(o.IncidentEndReasons, t.EndReason) {
		return reject(ReasonSafetyIncident, "episode ended with %q", t.EndReason)
	}
	return accepted
}

func checkIDs(t *schemas.Trajectory, _ *Options) Verdict {
	for _, f := range [...]struct{ name, v string }{
		{"record_id", t.RecordID}, {"run_id", t.RunID}, {"task_id", t.TaskID}, {"group_id", t.GroupID},
	} {
		if f.v == "" {
			return reject(ReasonMissingID, "%s is empty", f.name)
		}
	}
	return accepted
}

func checkGroupMember(t *schemas.Trajectory, _ *Options) Verdict {
	switch {
	case t.GroupSize < 1:
		return reject(ReasonGroupMember, "group size %d", t.GroupSize)
	case t.Member < 0 || t.Member >= t.GroupSize:
		return reject(ReasonGroupMember, "member %d outside group of size %d", t.Member, t.GroupSize)
	case t.Attempt < 0:
		return reject(ReasonGroupMember, "attempt %d", t.Attempt)
	}
	return accepted
}

func checkStatus(t *schemas.Trajectory, o *Options) Verdict {
	switch t.Status {
	case schemas.StatusCompleted, schemas.StatusFailed:
		return accepted
	case schemas.StatusTimedOut:
		if o.TimeoutIsTruncation {
			return accepted
		}
		return reject(ReasonTimedOut, "attempt timed out (timeouts are infrastructure failures under this contract)")
	case schemas.StatusInfra:
		return reject(ReasonInfraFailure, "attempt reported an infrastructure failure (end reason %q)", t.EndReason)
	}
	return reject(ReasonUnknownStatus, "status %q", t.Status)
}

func checkVersions(t *schemas.Trajectory, o *Options) Verdict {
	if o.ContractHash != "" && t.ContractHash != o.ContractHash {
		return reject(ReasonVersionMismatch, "contract hash %q, run expects %q", t.ContractHash, o.ContractHash)
	}
	if o.TokenizerHash != "" && t.TokenizerHash != o.TokenizerHash {
		return reject(ReasonVersionMismatch, "tokenizer hash %q, run expects %q", t.TokenizerHash, o.TokenizerHash)
	}
	if len(o.ParserVersions) > 0 && !slices.Contains(o.ParserVersions, t.ParserVersion) {
		return reject(ReasonVersionMismatch, "parser version %q, run accepts %q", t.ParserVersion, o.ParserVersions)
	}
	if len(o.EnvVersions) > 0 && !slices.Contains(o.EnvVersions, t.EnvVersion) {
		return reject(ReasonVersionMismatch, "environment version %q, run accepts %q", t.EnvVersion, o.EnvVersions)
	}
	return accepted
}

func checkTimestamps(t *schemas.Trajectory, _ *Options) Verdict {
	if t.StartedAt != 0 && t.FinishedAt != 0 && t.FinishedAt < t.StartedAt {
		return reject(ReasonTimestampOrder, "finished at %d us before start at %d us", t.FinishedAt, t.StartedAt)
	}
	return accepted
}

func checkTurnsPresent(t *schemas.Trajectory, _ *Options) Verdict {
	if len(t.Turns) == 0 {
		return reject(ReasonNoTurns, "trajectory has no turns")
	}
	return accepted
}

func checkDuplicateTurn(t *schemas.Trajectory, _ *Options) Verdict {
	first := make(map[int32]int, len(t.Turns))
	for i := range t.Turns {
		idx := t.Turns[i].Index
		if j, ok := first[idx]; ok {
			return reject(ReasonDuplicateTurn, "turn index %d at positions %d and %d", idx, j, i)
		}
		first[idx] = i
	}
	return accepted
}

func checkTurnOrder(t *schemas.Trajectory, _ *Options) Verdict {
	for i := range t.Turns {
		if t.Turns[i].Index != int32(i) {
			return reject(ReasonTurnOrder, "position %d holds turn index %d", i, t.Turns[i].Index)
		}
	}
	return accepted
}

func checkEmptyPrompt(t *schemas.Trajectory, _ *Options) Verdict {
	if len(t.Turns[0].PromptIDs) == 0 {
		return reject(ReasonEmptyPrompt, "turn 0: no prompt tokens")
	}
	return accepted
}

func checkEmptyAction(t *schemas.Trajectory, _ *Options) Verdict {
	for i := range t.Turns {
		if len(t.Turns[i].ActionIDs) == 0 {
			return reject(ReasonEmptyAction, "turn %d: no action tokens", i)
		}
	}
	return accepted
}

func checkLogprobLength(t *schemas.Trajectory, _ *Options) Verdict {
	for i := range t.Turns {
		tr := &t.Turns[i]
		if len(tr.ActionIDs) != len(tr.ActionLogprobs) {
			return reject(ReasonLogprobLengthMismatch, "turn %d: %d action ids, %d log-probs", i, len(tr.ActionIDs), len(tr.ActionLogprobs))
		}
	}
	return accepted
}

func checkLogprobFinite(t *schemas.Trajectory, _ *Options) Verdict {
	for i := range t.Turns {
		for j, lp := range t.Turns[i].ActionLogprobs {
			if !isFinite32(lp) {
				return reject(ReasonNonFiniteLogprob, "turn %d: log-prob %d is %v", i, j, lp)
			}
		}
	}
	return accepted
}

func checkLogprobSign(t *schemas.Trajectory, o *Options) Verdict {
	for i := range t.Turns {
		for j, lp := range t.Turns[i].ActionLogprobs {
			if lp > o.LogprobTolerance {
				return reject(ReasonPositiveLogprob, "turn %d: log-prob %d is %v > 0", i, j, lp)
			}
		}
	}
	return accepted
}

func checkTokenRange(t *schemas.Trajectory, o *Options) Verdict {
	limit := int32(math.MaxInt32)
	if o.VocabSize > 0 {
		limit = o.VocabSize - 1
	}
	for i := range t.Turns {
		tr := &t.Turns[i]
		for _, f := range [...]struct {
			name string
			ids  []int32
		}{{"prompt", tr.PromptIDs}, {"action", tr.ActionIDs}, {"observation", tr.ObservationIDs}} {
			for j, id := range f.ids {
				if id < 0 || id > limit {
					return reject(ReasonTokenIDRange, "turn %d: %s token %d is id %d (vocabulary size %d)", i, f.name, j, id, o.VocabSize)
				}
			}
		}
	}
	return accepted
}

func checkPolicyVersion(t *schemas.Trajectory, _ *Options) Verdict {
	prev := int64(0)
	for i := range t.Turns {
		v := t.Turns[i].PolicyVersion
		if v < 0 {
			return reject(ReasonPolicyVersionOrder, "turn %d: negative policy version %d", i, v)
		}
		if v < prev {
			return reject(ReasonPolicyVersionOrder, "turn %d: policy version %d after %d", i, v, prev)
		}
		prev = v
	}
	return accepted
}

func checkDecision(t *schemas.Trajectory, _ *Options) Verdict {
	for i := range t.Turns {
		switch d := t.Turns[i].Decision; d {
		case schemas.DecisionOK, schemas.DecisionInvalid, schemas.DecisionDenied:
		default:
			return reject(ReasonUnknownDecision, "turn %d: decision %q", i, d)
		}
	}
	return accepted
}

func checkValue(t *schemas.Trajectory, _ *Options) Verdict {
	for i := range t.Turns {
		if v := float64(t.Turns[i].Value); math.IsInf(v, 0) {
			return reject(ReasonNonFiniteValue, "turn %d: critic value %v", i, v)
		}
	}
	return accepted
}

// checkEndState: every accepted episode declares how it ended, because the
// advantage stage bootstraps only from declared truncations (docs/PIPELINE.md §10).
func checkEndState(t *schemas.Trajectory, _ *Options) Verdict {
	switch t.End {
	case schemas.EndTerminated:
		if t.Status == schemas.StatusTimedOut {
			return reject(ReasonEndState, "timed-out episode marked terminated; a timeout is a truncation")
		}
	case schemas.EndTruncated:
		if t.EndReason == "" {
			return reject(ReasonEndState, "truncated episode without an end reason")
		}
	default:
		return reject(ReasonEndState, "end %q is neither %q nor %q", t.End, schemas.EndTerminated, schemas.EndTruncated)
	}
	return accepted
}

func checkBootstrap(t *schemas.Trajectory, o *Options) Verdict {
	if t.End == schemas.EndTruncated && slices.Contains(o.BootstrapReasons, t.EndReason) && !isFinite32(t.BootstrapValue) {
		return reject(ReasonNonFiniteBootstrap, "truncated with %q, bootstrap value %v", t.EndReason, t.BootstrapValue)
	}
	return accepted
}

func checkBudget(t *schemas.Trajectory, o *Options) Verdict {
	if o.MaxTurns > 0 && len(t.Turns) > o.MaxTurns {
		return reject(ReasonOverBudget, "%d turns, budget %d", len(t.Turns), o.MaxTurns)
	}
	total := 0
	for i := range t.Turns {
		tr := &t.Turns[i]
		if o.MaxTokensPerAction > 0 && len(tr.ActionIDs) > o.MaxTokensPerAction {
			return reject(ReasonOverBudget, "turn %d: %d action tokens, budget %d", i, len(tr.ActionIDs), o.MaxTokensPerAction)
		}
		total += len(tr.PromptIDs) + len(tr.ActionIDs) + len(tr.ObservationIDs)
	}
	if o.MaxTokensPerEpisode > 0 && total > o.MaxTokensPerEpisode {
		return reject(ReasonOverBudget, "%d episode tokens, budget %d", total, o.MaxTokensPerEpisode)
	}
	return accepted
}
