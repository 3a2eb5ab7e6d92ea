package dashboard

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// TrajectoryRow is one line of the trajectory finder.
type TrajectoryRow struct {
	ID       string   `json:"id"`
	Task     string   `json:"task"`
	Group    string   `json:"group"`
	Member   int32    `json:"member"`
	Version  int64    `json:"version"`
	Status   string   `json:"status"`
	Turns    int      `json:"turns"`
	Tokens   int      `json:"tokens"`
	Reward   *float64 `json:"reward"`
	Success  *bool    `json:"success"`
	Outcome  string   `json:"outcome"`
	Reason   string   `json:"reason,omitempty"`
	Recorded bool     `json:"recorded"` // a trajectory exists (else only the census knows the attempt)
}

// Query selects trajectories: by id (prefix), task (substring), group
// (prefix), behavior version and outcome; every set field must match.
type Query struct {
	ID, Task, Group, Outcome string
	Version                  *int64
	Limit                    int
}

// TrajectoryList is the answer of /api/trajectories.
type TrajectoryList struct {
	Total int             `json:"total"`
	Rows  []TrajectoryRow `json:"rows"`
}

// Find lists the attempts matching q, in recording order, launched
// attempts without a trajectory last.
func (v *View) Find(q Query) TrajectoryList {
	r := v.st.Records
	if q.Limit <= 0 {
		q.Limit = 50
	}
	var out TrajectoryList
	add := func(row TrajectoryRow) {
		out.Total++
		if len(out.Rows) < q.Limit {
			out.Rows = append(out.Rows, row)
		}
	}
	match := func(id, task, group, outcome string, version int64) bool {
		return strings.HasPrefix(id, q.ID) && strings.Contains(task, q.Task) && strings.HasPrefix(group, q.Group) &&
			(q.Outcome == "" || q.Outcome == outcome) && (q.Version == nil || *q.Version == version)
	}
	for _, id := range r.TrajOrder {
		t := r.Trajs[id]
		f := v.fates[id]
		if match(id, t.TaskID, t.GroupID, f.Outcome, behaviorVersion(t)) {
			add(v.row(t))
		}
	}
	for _, id := range r.Launched {
		if r.Trajs[id] != nil {
			continue
		}
		a := r.Tasks[id]
		f := v.fates[id]
		if match(id, a.TaskID, a.GroupID, f.Outcome, a.PolicyVersion) {
			add(TrajectoryRow{ID: id, Task: a.TaskID, Group: a.GroupID, Member: a.Member, Version: a.PolicyVersion,
				Outcome: f.Outcome, Reason: f.Reason})
		}
	}
	return out
}

func (v *View) row(t *schemas.Trajectory) TrajectoryRow {
	r := v.st.Records
	f := v.fates[t.RecordID]
	row := TrajectoryRow{ID: t.RecordID, Task: t.TaskID, Group: t.GroupID, Member: t.Member, Version: behaviorVersion(t),
		Status: t.Status, Turns: len(t.Turns), Tokens: streamLen(t), Outcome: f.Outcome, Reason: f.Reason, Recorded: true}
	if ri := r.Rewarded[t.RecordID]; ri != nil {
		total := ri.Total
		row.Reward = &total
	}
	if ok, judged := verified(r, t.RecordID); judged {
		row.Success = &ok
	}
	return row
}

// Token is one token of a trajectory's stream with what the records say
// about it: its role, the behavior log-prob it was sampled with (action
// tokens), and — when the trajectory was packed — the packed row's
// target-aligned columns at the position that predicts it.
type Token struct {
	ID      int32    `json:"id"`
	Text    string   `json:"text"`
	Role    string   `json:"role"` // prompt, action, observation
	Turn    int32    `json:"turn"`
	Logprob *float64 `json:"logprob"`     // behavior log-prob (trajectory)
	Old     *float64 `json:"old_logprob"` // packed old_logprobs
	Adv     *float64 `json:"advantage"`   // packed advantages (else the scored turn advantage)
	Mask    *int     `json:"mask"`        // packed action_mask: 1 iff trained
	Lag     *int64   `json:"lag"`         // trainer version - behavior version of a trained token
}

// TurnView is one turn: its span of the stream and what it did.
type TurnView struct {
	Index       int32    `json:"index"`
	Version     int64    `json:"version"`
	Decision    string   `json:"decision"`
	Reason      string   `json:"reason,omitempty"`
	Start       int      `json:"start"` // stream position of its first prompt token
	Prompt      int      `json:"prompt"`
	Action      int      `json:"action"`
	Observation int      `json:"observation"`
	Call        string   `json:"call"`   // the action, decoded
	Result      string   `json:"result"` // the observation, decoded
	Value       *float64 `json:"value"`  // the critic's value before the action (none: no critic)
	GenMS       float64  `json:"gen_ms"`
	EnvMS       float64  `json:"env_ms"`
	Reward      *float64 `json:"reward"`
	Return      *float64 `json:"return"`
	Advantage   *float64 `json:"advantage"`
}

// BatchRef is the packed row that trained a trajectory.
type BatchRef struct {
	BatchID        string  `json:"batch_id"`
	BatchIndex     int64   `json:"batch_index"`
	TrainerVersion int64   `json:"trainer_version"`
	Row            int     `json:"row"`
	Segment        int     `json:"segment"`
	Start          int     `json:"start"`
	Length         int32   `json:"length"`
	Weight         float32 `json:"weight"`
	Truncated      bool    `json:"truncated"`
	Trained        int64   `json:"trained_tokens"`
	Admissions     int     `json:"admissions"`
	// Aligned says the row's input ids equal the trajectory's stream and
	// the old log-prob of every trained token equals the behavior log-prob
	// the trajectory recorded; Misaligned names the first difference.
	Aligned    bool   `json:"aligned"`
	Misaligned string `json:"misaligned,omitempty"`
}

// TrajectoryDetail is the answer of /api/trajectory.
type TrajectoryDetail struct {
	ID         string                    `json:"id"`
	Task       *schemas.TaskAttempt      `json:"task"`
	Trajectory *schemas.Trajectory       `json:"trajectory"`
	Vocabulary string                    `json:"vocabulary"`
	Fate       Fate                      `json:"fate"`
	Tokens     []Token                   `json:"tokens"`
	Turns      []TurnView                `json:"turns"`
	Rewards    []schemas.RewardComponent `json:"rewards"`
	Reward     *float64                  `json:"reward_total"`
	Scored     *ScoredInfo               `json:"scored"`
	Census     []schemas.CensusEvent     `json:"census"`
	Batch      *BatchRef                 `json:"batch"`
	Update     *UpdateRow                `json:"update"`
	Window     *WindowRow                `json:"window"`
	Quarantine []Quarantined             `json:"quarantine"`
	Incidents  []schemas.Incident        `json:"incidents"`
}

// Detail returns everything the records hold about one attempt.
func (v *View) Detail(id string) (*TrajectoryDetail, error) {
	r := v.st.Records
	t := r.Trajs[id]
	task, launched := r.Tasks[id]
	if t == nil && !launched && len(r.CensusBy[id]) == 0 {
		return nil, fmt.Errorf("no attempt %q in run %s", id, v.st.Run)
	}
	d := &TrajectoryDetail{ID: id, Fate: v.fates[id], Tokens: []Token{}, Turns: []TurnView{}, Census: []schemas.CensusEvent{}}
	if launched {
		d.Task = &task
	}
	for _, i := range r.CensusBy[id] {
		d.Census = append(d.Census, r.Census[i])
	}
	slices.SortStableFunc(d.Census, func(a, b schemas.CensusEvent) int { return int(a.At - b.At) })
	for i := range r.Quar {
		if slices.Contains(r.Quar[i].Attempts, id) || r.Quar[i].ID == id {
			d.Quarantine = append(d.Quarantine, r.Quar[i])
		}
	}
	for _, inc := range r.Incidents {
		if inc.AttemptID == id {
			d.Incidents = append(d.Incidents, inc)
		}
	}
	if t == nil {
		return d, nil
	}
	// The turns are laid out in Tokens and Turns; the copy keeps the
	// trajectory's own fields (JSON has no NaN: a critic's missing value).
	tc := *t
	tc.Turns, tc.BootstrapValue = nil, float32(finite(float64(t.BootstrapValue)))
	d.Trajectory = &tc
	if ri := r.Rewarded[id]; ri != nil {
		total := finite(ri.Total)
		d.Reward = &total
		for _, c := range ri.Rewards {
			c.Raw, c.Weight, c.Value, c.Uncertainty = finite(c.Raw), finite(c.Weight), finite(c.Value), finite(c.Uncertainty)
			d.Rewards = append(d.Rewards, c)
		}
	}
	if sc := r.Scored[id]; sc != nil {
		c := *sc
		c.TurnRewards, c.TurnReturns = finite32s(sc.TurnRewards), finite32s(sc.TurnReturns)
		c.TurnAdvantages, c.TurnValueTargets = finite32s(sc.TurnAdvantages), finite32s(sc.TurnValueTargets)
		c.Group.Mean, c.Group.Std = finite(c.Group.Mean), finite(c.Group.Std)
		c.Group.Min, c.Group.Max = finite(c.Group.Min), finite(c.Group.Max)
		d.Scored = &c
	}
	d.Vocabulary = vocabulary(t)
	d.Tokens, d.Turns = v.stream(t, d.Scored)
	if ref, ok := r.Segments[id]; ok {
		d.Batch = v.pack(t, ref, d.Tokens)
		if u, ok := v.st.Releases.UpdateOfBatch(d.Batch.BatchID); ok {
			rows, _ := updateRows([]schemas.UpdateRecord{u}, v.st.lossOptions())
			d.Update = &rows[0]
		}
	}
	d.Window = v.window(id)
	return d, nil
}

// vocabulary names how the dashboard decodes a trajectory's tokens.
func vocabulary(t *schemas.Trajectory) string {
	if t.TokenizerHash == rollout.TokenizerHash {
		return "built-in kv vocabulary (operators/rollout/vocab.go)"
	}
	return "token ids (the tokenizer " + t.TokenizerHash + " is the policy server's); action texts from the environment's artifacts"
}

// stream lays out the token stream of t turn by turn.
func (v *View) stream(t *schemas.Trajectory, sc *ScoredInfo) ([]Token, []TurnView) {
	builtin := t.TokenizerHash == rollout.TokenizerHash
	texts := textActions(t)
	var toks []Token
	var turns []TurnView
	for ti, turn := range t.Turns {
		tv := TurnView{Index: turn.Index, Version: turn.PolicyVersion, Decision: turn.Decision, Reason: turn.DecisionReason,
			Start: len(toks), Prompt: len(turn.PromptIDs), Action: len(turn.ActionIDs), Observation: len(turn.ObservationIDs),
			GenMS: float64(turn.GenLatencyUS) / 1000, EnvMS: float64(turn.EnvLatencyUS) / 1000}
		if !math.IsNaN(float64(turn.Value)) && !math.IsInf(float64(turn.Value), 0) {
			val := float64(turn.Value)
			tv.Value = &val
		}
		var adv *float64
		if sc != nil {
			tv.Reward, tv.Return, tv.Advantage = at32(sc.TurnRewards, ti), at32(sc.TurnReturns, ti), at32(sc.TurnAdvantages, ti)
			adv = tv.Advantage
		}
		add := func(ids []int32, role string, lps []float32) {
			for i, id := range ids {
				tok := Token{ID: id, Text: tokenText(id, builtin), Role: role, Turn: turn.Index}
				if role == "action" {
					tok.Logprob, tok.Adv = at32(lps, i), adv
				}
				toks = append(toks, tok)
			}
		}
		add(turn.PromptIDs, "prompt", nil)
		add(turn.ActionIDs, "action", turn.ActionLogprobs)
		add(turn.ObservationIDs, "observation", nil)
		if builtin {
			tv.Call, tv.Result = describeAction(turn.ActionIDs, t.ParserVersion), describeObservation(turn.ObservationIDs)
		} else if s, ok := texts[turn.Index]; ok {
			tv.Call = s
			tv.Result = fmt.Sprintf("%d observation tokens", len(turn.ObservationIDs))
		}
		turns = append(turns, tv)
	}
	return toks, turns
}

// finite32s is a copy of s with NaN and infinities replaced by 0.
func finite32s(s []float32) []float32 {
	out := make([]float32, len(s))
	for i, x := range s {
		out[i] = float32(finite(float64(x)))
	}
	return out
}

func at32(s []float32, i int) *float64 {
	if i < 0 || i >= len(s) {
		return nil
	}
	f := finite(float64(s[i]))
	return &f
}

// pack overlays the packed row's target-aligned columns on the stream:
// the entry at row position p describes the prediction of input p+1, so
// stream token j takes entry start+j-1 (the first token is predicted by
// nothing).
func (v *View) pack(t *schemas.Trajectory, ref SegRef, toks []Token) *BatchRef {
	r := v.st.Records
	b := r.Batches[ref.Batch]
	row := &b.Rows[ref.Row]
	start := slices.Index(row.SegmentIDs, int32(ref.Seg))
	br := &BatchRef{BatchID: b.BatchID, BatchIndex: b.BatchIndex, TrainerVersion: b.TrainerVersion, Row: ref.Row,
		Segment: ref.Seg, Start: start, Length: row.SegLengths[ref.Seg], Weight: row.SegWeights[ref.Seg],
		Truncated: row.SegTruncated[ref.Seg], Trained: segmentTrained(r, ref), Admissions: r.Admits[t.RecordID], Aligned: true}
	misalign := func(format string, args ...any) {
		if br.Aligned {
			br.Aligned, br.Misaligned = false, fmt.Sprintf(format, args...)
		}
	}
	for j := 0; j < int(br.Length) && j < len(toks); j++ {
		p := start + j
		if row.InputIDs[p] != toks[j].ID {
			misalign("stream token %d is %d, the row holds %d", j, toks[j].ID, row.InputIDs[p])
		}
		if j == 0 {
			continue
		}
		q := p - 1
		mask := int(row.ActionMask[q])
		old := finite(float64(row.OldLogprobs[q]))
		adv := finite(float64(row.Advantages[q]))
		toks[j].Mask, toks[j].Old, toks[j].Adv = &mask, &old, &adv
		if mask == 1 {
			lag := b.TrainerVersion - int64(row.PolicyVersions[q])
			toks[j].Lag = &lag
			if toks[j].Logprob == nil || float32(*toks[j].Logprob) != row.OldLogprobs[q] {
				misalign("trained token %d has old log-prob %v, the trajectory recorded %v", j, row.OldLogprobs[q], toks[j].Logprob)
			}
		}
	}
	if int(br.Length) > len(toks) {
		misalign("segment of %d tokens, stream of %d", br.Length, len(toks))
	}
	return br
}

// window finds the pack window that decided id.
func (v *View) window(id string) *WindowRow {
	for _, w := range v.st.Records.Windows {
		in := slices.Contains(w.Admitted, id) || slices.ContainsFunc(w.Filtered, func(d schemas.WindowDecision) bool { return d.RecordID == id })
		if in {
			rows := windows(&Records{Windows: []WindowMsg{w}})
			return &rows[0]
		}
	}
	return nil
}

// textActions maps a text-family trajectory's turns to the action texts
// its environment logged.
func textActions(t *schemas.Trajectory) map[int32]string {
	if t.TokenizerHash == rollout.TokenizerHash || t.Artifacts == "" {
		return nil
	}
	var art rollout.TextArtifacts
	if err := json.Unmarshal([]byte(t.Artifacts), &art); err != nil {
		return nil
	}
	out := map[int32]string{}
	for _, a := range art.Actions {
		s := a.Text
		if a.Tool != "" {
			s = fmt.Sprintf("%s(%s) — %q", a.Tool, a.Arg, a.Text)
		}
		out[a.Turn] = s
	}
	return out
}

// tokenText decodes one token of the built-in vocabulary.
func tokenText(id int32, builtin bool) string {
	if !builtin {
		return fmt.Sprintf("#%d", id)
	}
	names := map[int32]string{rollout.TokPad: "PAD", rollout.TokBOS: "BOS", rollout.TokTask: "TASK", rollout.TokAct: "ACT",
		rollout.TokObs: "OBS", rollout.TokDeny: "DENY", rollout.TokErr: "ERR", rollout.TokCall: "CALL",
		rollout.TokAns: "ANS", rollout.TokEnd: "END", rollout.TokXfer: "XFER"}
	switch {
	case names[id] != "":
		return names[id]
	case id >= rollout.TokKey0 && id < rollout.TokKey0+rollout.MaxKeys:
		return fmt.Sprintf("k%d", id-rollout.TokKey0)
	case id >= rollout.TokVal0 && id < rollout.TokVal0+rollout.MaxValues:
		return fmt.Sprintf("v%d", id-rollout.TokVal0)
	}
	return fmt.Sprintf("<%d>", id)
}

// describeAction decodes a kv action as a tool call or an answer; the
// actions of the other built-in-vocabulary family (ledger) are spelled out.
func describeAction(ids []int32, parser string) string {
	if parser != rollout.ParserVersion {
		return spell(ids)
	}
	a, err := rollout.Parse(ids, rollout.MaxKeys, rollout.MaxValues)
	if err != nil {
		return "unparsable: " + strings.TrimPrefix(err.Error(), rollout.ErrParse.Error()+": ")
	}
	if a.Kind == rollout.KindCall {
		return fmt.Sprintf("tool call lookup(k%d)", a.Key)
	}
	return fmt.Sprintf("answer v%d", a.Value)
}

// describeObservation decodes a kv observation.
func describeObservation(ids []int32) string {
	switch {
	case len(ids) == 0:
		return "(none: the episode ended)"
	case ids[0] == rollout.TokObs && len(ids) == 2:
		return "tool result " + tokenText(ids[1], true)
	case ids[0] == rollout.TokDeny:
		return "denied by the authorizer"
	case ids[0] == rollout.TokErr:
		return "parse error"
	}
	return spell(ids)
}

// spell writes tokens of the built-in vocabulary as words.
func spell(ids []int32) string {
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = tokenText(id, true)
	}
	return strings.Join(parts, " ")
}
