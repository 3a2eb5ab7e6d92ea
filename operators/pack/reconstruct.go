package pack

import (
	"errors"
	"fmt"
	"math"

	"github.com/trajflow/trajflow/schemas"
)

// Errors. Each returned error wraps exactly one of these, so the runtime can
// route the record (quarantine for ErrMalformed and ErrEvalSplit; a bug for
// ErrOptions).
var (
	// ErrOptions reports Options that Validate rejects.
	ErrOptions = errors.New("pack: invalid options")
	// ErrMalformed reports a scored trajectory whose columns disagree
	// (token/log-prob lengths, one advantage per turn, ...). Validation
	// upstream should have quarantined it (docs/PIPELINE.md §9).
	ErrMalformed = errors.New("pack: malformed scored trajectory")
	// ErrEvalSplit reports a hidden-eval trajectory that reached the
	// training path; it is never packed (docs/PIPELINE.md §16, docs/PIPELINE.md §15).
	ErrEvalSplit = errors.New("pack: eval-split trajectory on the training path")
)

// Filter is the reason a trajectory is not packed. The empty Filter means
// admitted. Reasons set upstream (GroupStats.Filtered, e.g.
// "zero_variance") pass through unchanged.
type Filter string

// Filters decided by this package.
const (
	FilterNone Filter = ""
	// FilterStale: a trained turn's behavior policy is more than MaxLag
	// versions behind the trainer (StaleDrop), or no in-window turn is left
	// (StaleMaskTurns).
	FilterStale Filter = "stale"
	// FilterOverlong: the token stream exceeds TokenBudget under
	// OverflowReject (docs/PIPELINE.md §11).
	FilterOverlong Filter = "overlong"
	// FilterNoTargets: the stream has no policy-sampled token that any
	// position predicts (no action tokens at all, or only the stream's very
	// first token). Such a sample would train nothing.
	FilterNoTargets Filter = "no_targets"
	// FilterMixedPolicy: the trajectory's turns were sampled by more than
	// one policy version and the rule is MultiPolicyDiscard.
	FilterMixedPolicy Filter = "mixed_policy"
)

// Validate reports whether o is usable. TokenBudget must be positive; at
// least one of BatchTokens and BatchGroups must be positive; MaxLag must not
// be negative (0 admits only on-policy samples); Overflow and StalePolicy
// must name one of the declared rules. The learning contract fills defaults
// before calling it.
func (o Options) Validate() error {
	switch {
	case o.TokenBudget <= 0:
		return fmt.Errorf("%w: token_budget %d must be positive", ErrOptions, o.TokenBudget)
	case o.TokenBudget > math.MaxInt32:
		return fmt.Errorf("%w: token_budget %d exceeds int32", ErrOptions, o.TokenBudget)
	case o.BatchTokens < 0 || o.BatchGroups < 0:
		return fmt.Errorf("%w: batch_tokens %d and batch_groups %d must not be negative", ErrOptions, o.BatchTokens, o.BatchGroups)
	case o.BatchTokens == 0 && o.BatchGroups == 0:
		return fmt.Errorf("%w: one of batch_tokens and batch_groups must be positive", ErrOptions)
	case o.MaxLag < 0:
		return fmt.Errorf("%w: max_lag %d must not be negative", ErrOptions, o.MaxLag)
	}
	if o.Overflow != OverflowReject && o.Overflow != OverflowTruncate {
		return fmt.Errorf("%w: overflow %q (want %q or %q)", ErrOptions, o.Overflow, OverflowReject, OverflowTruncate)
	}
	if o.StalePolicy != StaleDrop && o.StalePolicy != StaleMaskTurns {
		return fmt.Errorf("%w: stale_policy %q (want %q or %q)", ErrOptions, o.StalePolicy, StaleDrop, StaleMaskTurns)
	}
	switch o.MultiPolicy {
	case "", MultiPolicySegments, MultiPolicyNewest, MultiPolicyDiscard:
	default:
		return fmt.Errorf("%w: multi_policy %q (want %q, %q or %q)", ErrOptions, o.MultiPolicy, MultiPolicySegments, MultiPolicyNewest, MultiPolicyDiscard)
	}
	return nil
}

// Span is the run of target-aligned entries of one turn's action tokens.
// Entries At .. At+Len-1 of a segment predict Tokens[At+1] .. Tokens[At+Len],
// which are that turn's action tokens (docs/PIPELINE.md §11: logits at i predict
// input_ids[i+1]).
type Span struct {
	At            int32   // first target-aligned entry
	Len           int32   // number of entries (action tokens kept as targets)
	Turn          int32   // turn index (position in Trajectory.Turns)
	PolicyVersion int64   // behavior version that sampled these tokens
	Advantage     float32 // the turn's advantage, broadcast to its action tokens (docs/PIPELINE.md §10)
	ValueTarget   float32 // the turn's value target (0 when no critic ran)
	// Stale marks a turn outside the admission window under
	// StaleMaskTurns: its tokens stay in the stream as context and are
	// not targets (mask 0).
	Stale bool
	// Older marks a turn of an older version than the trajectory's newest
	// under MultiPolicyNewest: context, like a stale turn, but not stale.
	Older bool
}

// Segment is one reconstructed training sequence (docs/PIPELINE.md §11): the token
// stream of one trajectory and, compactly, what its target-aligned columns
// hold. Every entry outside a non-stale Span is context: mask 0, old
// log-prob 0, advantage 0, value target 0, turn id -1, policy version -1.
// Pack expands the spans into the per-token columns of a PackedRow.
type Segment struct {
	TrajectoryID string
	GroupID      string
	// Tokens is the input stream: per turn PromptIDs ++ ActionIDs ++
	// ObservationIDs, cut at TokenBudget when truncated. Never empty.
	Tokens []int32
	// Spans lists, in stream order, every turn with at least one action
	// token that is a target.
	Spans []Span
	// Logprobs holds the behavior log-probabilities of the span targets,
	// concatenated in span order (sum of Span.Len entries): the log-prob
	// of Tokens[At+1+j] is entry j of its span's run.
	Logprobs []float32
	// Trained is the number of entries with mask 1 (tokens of non-stale
	// spans).
	Trained int32
	// OldestVersion is the oldest behavior version among trained tokens.
	OldestVersion int64
	// Truncated is set when OverflowTruncate cut the stream. The kept
	// prefix is unchanged, so its old log-probs stay valid (docs/PIPELINE.md §11).
	Truncated bool
	// Weight is the sample weight (1; the column exists for task/group
	// weighting declared by the contract).
	Weight float32
}

// targets is the number of target entries of the segment's spans, stale
// or not.
func (s *Segment) targets() int {
	n := 0
	for _, sp := range s.Spans {
		n += int(sp.Len)
	}
	return n
}

// staleTargets is the number of target entries of the stale spans.
func (s *Segment) staleTargets() int {
	n := 0
	for _, sp := range s.Spans {
		if sp.Stale {
			n += int(sp.Len)
		}
	}
	return n
}

// Len is the number of tokens of the segment.
func (s *Segment) Len() int { return len(s.Tokens) }

// Role of an input token.
type Role uint8

// Roles.
const (
	RoleContext     Role = iota // prompt, observation, or an action token no position predicts
	RoleAction                  // a policy-sampled token that is a training target
	RoleStaleAction             // a policy-sampled token of a stale (or older-version) turn kept as context
)

// String returns "context", "action" or "stale".
func (r Role) String() string {
	switch r {
	case RoleContext:
		return "context"
	case RoleAction:
		return "action"
	case RoleStaleAction:
		return "stale"
	}
	return fmt.Sprintf("Role(%d)", uint8(r))
}

// Roles returns the role of every input token, indexed by input position
// (not target-aligned): Roles()[p] describes Tokens[p].
func (s *Segment) Roles() []Role {
	r := make([]Role, len(s.Tokens))
	for _, sp := range s.Spans {
		role := RoleAction
		if sp.Stale || sp.Older {
			role = RoleStaleAction
		}
		for p := sp.At + 1; p <= sp.At+sp.Len; p++ {
			r[p] = role
		}
	}
	return r
}

// Reconstruct builds the training sequence of one scored trajectory
// (docs/PIPELINE.md §11) and applies lag-aware admission (docs/PIPELINE.md §15) against
// trainerVersion. It is a pure function; it copies what it keeps, so s may
// be reused afterwards.
//
// The order of decisions is: a trajectory already filtered upstream
// (Group.Filtered) returns that reason; invalid options are an error
// wrapping ErrOptions; an eval-split trajectory is an error wrapping
// ErrEvalSplit; malformed columns are an error wrapping ErrMalformed
// (len(ActionIDs) != len(ActionLogprobs) in a turn, len(TurnAdvantages) !=
// len(Turns), TurnValueTargets neither empty nor one per turn, a policy
// version outside int32) or values that cannot be trained (a NaN or
// infinite turn advantage or value target, a behavior log-prob that is NaN,
// -Inf or > 0, named by field and index: validation upstream refuses them
// too, docs/PIPELINE.md §9, and pack is the last step before training); a stream
// without action tokens is FilterNoTargets; then the overflow rule
// (FilterOverlong, or a truncated prefix of TokenBudget tokens); then the
// lag rule on the kept turns. A turn's lag is trainerVersion - PolicyVersion; a turn is stale
// when its lag exceeds MaxLag. Under StaleDrop a stale turn with target
// tokens filters the trajectory (FilterStale); under StaleMaskTurns stale
// turns become context, and if no target remains the trajectory is
// FilterStale. A stream with no target at all is FilterNoTargets.
//
// Invalid and denied actions (Decision != "ok") were sampled by the policy
// and are trained with their turn's advantage (docs/PIPELINE.md §7, §10). Prompt and
// observation tokens are never targets. The first token of the stream is
// never a target (no position predicts it).
func Reconstruct(s *schemas.Scored, trainerVersion int64, opts Options) (Segment, Filter, error) {
	if s.Group.Filtered != "" {
		return Segment{}, Filter(s.Group.Filtered), nil
	}
	budget := opts.TokenBudget
	if budget <= 0 || budget > math.MaxInt32 {
		return Segment{}, FilterNone, fmt.Errorf("%w: token_budget %d", ErrOptions, budget)
	}
	truncate := false
	switch opts.Overflow {
	case OverflowReject:
	case OverflowTruncate:
		truncate = true
	default:
		return Segment{}, FilterNone, fmt.Errorf("%w: overflow %q", ErrOptions, opts.Overflow)
	}
	if opts.StalePolicy != StaleDrop && opts.StalePolicy != StaleMaskTurns {
		return Segment{}, FilterNone, fmt.Errorf("%w: stale_policy %q", ErrOptions, opts.StalePolicy)
	}
	if s.Split == schemas.SplitEval {
		return Segment{}, FilterNone, fmt.Errorf("%w: record %s of task %s", ErrEvalSplit, s.RecordID, s.TaskID)
	}

	turns := s.Turns
	if len(s.TurnAdvantages) != len(turns) {
		return Segment{}, FilterNone, fmt.Errorf("%w: record %s has %d turn advantages for %d turns",
			ErrMalformed, s.RecordID, len(s.TurnAdvantages), len(turns))
	}
	vts := s.TurnValueTargets
	if len(vts) != 0 && len(vts) != len(turns) {
		return Segment{}, FilterNone, fmt.Errorf("%w: record %s has %d turn value targets for %d turns",
			ErrMalformed, s.RecordID, len(vts), len(turns))
	}
	if err := checkTurnValues(s); err != nil {
		return Segment{}, FilterNone, err
	}
	n, actions, withActions := 0, 0, 0
	for i := range turns {
		t := &turns[i]
		if len(t.ActionIDs) != len(t.ActionLogprobs) {
			return Segment{}, FilterNone, fmt.Errorf("%w: record %s turn %d has %d action tokens and %d log-probs",
				ErrMalformed, s.RecordID, i, len(t.ActionIDs), len(t.ActionLogprobs))
		}
		if err := checkLogprobs(s.RecordID, i, t.ActionLogprobs); err != nil {
			return Segment{}, FilterNone, err
		}
		if len(t.ActionIDs) > 0 {
			if t.PolicyVersion < math.MinInt32 || t.PolicyVersion > math.MaxInt32 {
				return Segment{}, FilterNone, fmt.Errorf("%w: record %s turn %d policy version %d outside int32",
					ErrMalformed, s.RecordID, i, t.PolicyVersion)
			}
			withActions++
		}
		n += len(t.PromptIDs) + len(t.ActionIDs) + len(t.ObservationIDs)
		actions += len(t.ActionIDs)
	}
	if actions == 0 {
		return Segment{}, FilterNoTargets, nil
	}
	keep := n
	if n > budget {
		if !truncate {
			return Segment{}, FilterOverlong, nil
		}
		keep = budget
		if actions > keep {
			actions = keep
		}
	}

	// One pass over the turns: copy the kept prefix and record the target
	// spans (docs/PIPELINE.md §11: logits at i predict input_ids[i+1], so action
	// token at input position p is the target of entry p-1).
	seg := Segment{
		TrajectoryID: s.RecordID,
		GroupID:      s.GroupID,
		Tokens:       make([]int32, keep),
		Spans:        make([]Span, 0, withActions),
		Logprobs:     make([]float32, 0, actions),
		Truncated:    keep < n,
		Weight:       1,
	}
	toks := seg.Tokens
	pos := 0
	for i := range turns {
		if pos >= keep {
			break
		}
		t := &turns[i]
		pos += copy(toks[pos:], t.PromptIDs)
		if len(t.ActionIDs) > 0 && pos < keep {
			start := pos
			pos += copy(toks[pos:], t.ActionIDs)
			skip := 0
			if start == 0 { // the stream's first token is predicted by nobody
				skip = 1
			}
			if cnt := pos - start - skip; cnt > 0 {
				sp := Span{
					At:            int32(start + skip - 1),
					Len:           int32(cnt),
					Turn:          int32(i),
					PolicyVersion: t.PolicyVersion,
					Advantage:     s.TurnAdvantages[i],
				}
				if len(vts) != 0 {
					sp.ValueTarget = vts[i]
				}
				seg.Spans = append(seg.Spans, sp)
				seg.Logprobs = append(seg.Logprobs, t.ActionLogprobs[skip:skip+cnt]...)
			}
		}
		pos += copy(toks[pos:], t.ObservationIDs)
	}
	if f := multiPolicy(&seg, opts.MultiPolicy); f != FilterNone {
		return Segment{}, f, nil
	}
	if f := admit(&seg, trainerVersion, opts.MaxLag, opts.StalePolicy == StaleDrop); f != FilterNone {
		return Segment{}, f, nil
	}
	return seg, FilterNone, nil
}

// multiPolicy applies the rule for trajectories sampled by several policy
// versions (docs/SYSTEMS.md §7): per segment, nothing to do (every token keeps
// its own version and log-prob); MultiPolicyNewest marks the turns older
// than the newest version as context; MultiPolicyDiscard filters the
// trajectory.
func multiPolicy(seg *Segment, rule string) Filter {
	if rule == "" || rule == MultiPolicySegments || len(seg.Spans) < 2 {
		return FilterNone
	}
	newest := seg.Spans[0].PolicyVersion
	mixed := false
	for _, sp := range seg.Spans[1:] {
		mixed = mixed || sp.PolicyVersion != newest
		newest = max(newest, sp.PolicyVersion)
	}
	if !mixed {
		return FilterNone
	}
	if rule == MultiPolicyDiscard {
		return FilterMixedPolicy
	}
	for i := range seg.Spans {
		seg.Spans[i].Older = seg.Spans[i].PolicyVersion < newest
	}
	return FilterNone
}

// checkTurnValues refuses a non-finite turn advantage or value target:
// they become the advantages and value targets of the trained tokens.
func checkTurnValues(s *schemas.Scored) error {
	for _, col := range []struct {
		name string
		v    []float32
	}{{"turn_advantages", s.TurnAdvantages}, {"turn_value_targets", s.TurnValueTargets}} {
		for i, x := range col.v {
			if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
				return fmt.Errorf("%w: record %s: %s[%d] is %v", ErrMalformed, s.RecordID, col.name, i, x)
			}
		}
	}
	return nil
}

// checkLogprobs refuses a behavior log-prob of turn i that is not in
// [-MaxFloat32, 0] (NaN, -Inf, > 0). As int32, the bits of every such
// value are above those of -MaxFloat32 (0xFF7FFFFF), the only valid one
// among them being +0: one integer maximum (no branch per entry) tells
// whether the list is valid, and the offending entry is looked for only
// when it is not.
func checkLogprobs(id string, i int, lps []float32) error {
	const lastValid = int32(-0x00800001) // int32(0xFF7FFFFF), the bits of -MaxFloat32
	hi := int32(math.MinInt32)
	for _, lp := range lps {
		b := int32(math.Float32bits(lp))
		if b == 0 { // +0
			b = math.MinInt32
		}
		hi = max(hi, b)
	}
	if hi <= lastValid {
		return nil
	}
	for j, lp := range lps {
		if !(lp <= 0 && lp >= -math.MaxFloat32) {
			return fmt.Errorf("%w: record %s: turns[%d].action_logprobs[%d] is %s", ErrMalformed, id, i, j, badLogprob(lp))
		}
	}
	return nil
}

// badLogprob says why lp is not a log-probability.
func badLogprob(lp float32) string {
	if lp > 0 && !math.IsInf(float64(lp), 1) {
		return fmt.Sprintf("%v > 0", lp)
	}
	return fmt.Sprint(lp)
}

// admit applies the lag rule to seg's spans against trainerVersion (it may
// be applied again with a newer version: staleness is recomputed from each
// span's PolicyVersion) and sets Trained and OldestVersion.
func admit(seg *Segment, trainerVersion, maxLag int64, drop bool) Filter {
	var trained int32
	oldest, have := int64(-1), false
	stale := false
	for i := range seg.Spans {
		sp := &seg.Spans[i]
		if sp.Older {
			continue // context (MultiPolicyNewest), never judged stale
		}
		sp.Stale = trainerVersion-sp.PolicyVersion > maxLag
		if sp.Stale {
			if drop {
				return FilterStale
			}
			stale = true
			continue
		}
		trained += sp.Len
		if !have || sp.PolicyVersion < oldest {
			oldest, have = sp.PolicyVersion, true
		}
	}
	if trained == 0 {
		if stale {
			return FilterStale
		}
		return FilterNoTargets
	}
	seg.Trained = trained
	seg.OldestVersion = oldest
	return FilterNone
}
