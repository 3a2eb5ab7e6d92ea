package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/schemas"
)

// The ledger family (FamilyLedger): a task family with a state-changing
// tool, so that executing one action twice is observable. Every task has
// Keys accounts with hidden balances (0..Values-1), a source and a
// destination account named in the prompt, and one forbidden account. The
// agent must move one unit from the source to the destination exactly
// once, then answer the destination's new balance.
//
//	turn 0 prompt:  BOS TASK <source> <destination> ACT
//	turn t prompt:  ACT                                  (t > 0)
//	action:         CALL <account> END    balance query (read-only)
//	                XFER <account> END    move 1 unit from the source to <account>
//	                ANS <value> END       answer; the episode terminates
//	observation:    OBS <value>   the account's balance (after a transfer: the receiver's)
//	                DENY          refused by the authorizer or the ledger
//	                ERR           the parser rejected the action
//
// A transfer is refused (DENY) to the forbidden account, to the source
// itself, when the source is empty, or when the receiver is full
// (Values-1). The environment's journal (Artifacts "transfers") records
// every executed transfer with its turn; the trusted validator replays the
// actions against the hidden opening balances and refuses to judge an
// episode whose journal disagrees — a transfer journaled twice for one
// turn is a duplicate execution, an infrastructure fault, never a reward.

// Domain, parser and evaluator of the ledger family.
const (
	LedgerDomain        = "ledger"
	LedgerParserVersion = "ledger-parser/v1"
	EvalLedgerSuccess   = "ledger_success"
)

// Ledger action kinds (KindCall and KindAnswer are shared with kv).
const KindTransfer = "transfer"

type ledgerHidden struct {
	balances  []int32 // opening balance of every account
	src, dst  int32
	forbidden int32
}

type ledgerFamily struct {
	cfg    RegistryConfig
	hidden map[string]ledgerHidden
}

func (*ledgerFamily) name() string      { return FamilyLedger }
func (*ledgerFamily) domain() string    { return LedgerDomain }
func (*ledgerFamily) evaluator() string { return EvalLedgerSuccess }

func (*ledgerFamily) check(cfg RegistryConfig) error {
	switch {
	case cfg.Keys < 3 || cfg.Keys > MaxKeys:
		return fmt.Errorf("rollout: registry: ledger accounts (keys) %d not in [3, %d]", cfg.Keys, MaxKeys)
	case cfg.Values < 3 || cfg.Values > MaxValues:
		return fmt.Errorf("rollout: registry: ledger balances (values) %d not in [3, %d]", cfg.Values, MaxValues)
	}
	return nil
}

func (f *ledgerFamily) derive(id string, h [32]byte) int32 {
	k, v := int32(f.cfg.Keys), int32(f.cfg.Values)
	src := int32(h[0]) % k
	dst := (src + 1 + int32(h[1])%(k-1)) % k
	var others []int32
	for a := int32(0); a < k; a++ {
		if a != src && a != dst {
			others = append(others, a)
		}
	}
	hd := ledgerHidden{balances: make([]int32, k), src: src, dst: dst, forbidden: others[int(h[2])%len(others)]}
	for a := range hd.balances {
		hd.balances[a] = int32(h[3+a]) % v
	}
	hd.balances[src] = 1 + int32(h[3+src])%(v-1) // something to move
	hd.balances[dst] = int32(h[3+dst]) % (v - 1) // room to receive
	f.hidden[id] = hd
	return dst
}

func (f *ledgerFamily) grammar() model.Grammar {
	return LedgerGrammar{Keys: f.cfg.Keys, Values: f.cfg.Values}
}

func (*ledgerFamily) spec() Spec {
	return Spec{Family: FamilyLedger, Observations: ObsTokens, ParserVersion: LedgerParserVersion, TokenizerHash: TokenizerHash,
		TurnPrompt: TurnPrompt(), MaxObservation: maxObservation}
}

// LedgerCall is one balance query or refused transfer in the artifacts.
type LedgerCall struct {
	Turn       int32  `json:"turn"`
	Verb       string `json:"verb"` // KindCall or KindTransfer
	Account    int32  `json:"account"`
	Authorized bool   `json:"authorized"`
	Reason     string `json:"reason,omitempty"`
}

// LedgerTransfer is one executed transfer: an entry of the journal.
type LedgerTransfer struct {
	Turn   int32 `json:"turn"`
	From   int32 `json:"from"`
	To     int32 `json:"to"`
	Amount int32 `json:"amount"`
}

// LedgerArtifacts is the ledger environment's evidence of one episode.
type LedgerArtifacts struct {
	Calls      []LedgerCall     `json:"calls"`
	Transfers  []LedgerTransfer `json:"transfers"`   // the journal
	AnswerTurn int32            `json:"answer_turn"` // -1 when the episode did not answer
}

type ledgerState struct {
	Balances  []int32         `json:"balances"`
	Artifacts LedgerArtifacts `json:"artifacts"`
	Done      bool            `json:"done"`
}

type ledgerEpisode struct {
	task Task
	h    ledgerHidden
	cfg  RegistryConfig
	st   ledgerState
}

func (f *ledgerFamily) reset(t Task) (Episode, Observation) {
	h := f.hidden[t.ID]
	e := &ledgerEpisode{task: t, h: h, cfg: f.cfg, st: ledgerState{
		Balances:  append([]int32(nil), h.balances...),
		Artifacts: LedgerArtifacts{Calls: []LedgerCall{}, Transfers: []LedgerTransfer{}, AnswerTurn: -1},
	}}
	return e, Observation{IDs: []int32{TokBOS, TokTask, TokKey0 + h.src, TokKey0 + h.dst, TokAct}}
}

func (f *ledgerFamily) resume(t Task, state []byte) (Episode, error) {
	ep, _ := f.reset(t)
	e := ep.(*ledgerEpisode)
	var st ledgerState
	if err := json.Unmarshal(state, &st); err != nil {
		return nil, fmt.Errorf("rollout: resume ledger episode of %s: %w", t.ID, err)
	}
	if len(st.Balances) != f.cfg.Keys {
		return nil, fmt.Errorf("rollout: resume ledger episode of %s: %d balances, want %d", t.ID, len(st.Balances), f.cfg.Keys)
	}
	if st.Artifacts.Calls == nil {
		st.Artifacts.Calls = []LedgerCall{}
	}
	if st.Artifacts.Transfers == nil {
		st.Artifacts.Transfers = []LedgerTransfer{}
	}
	e.st = st
	return e, nil
}

// Spec implements Episode.
func (e *ledgerEpisode) Spec() Spec { return (*ledgerFamily)(nil).spec() }

// State implements Stateful.
func (e *ledgerEpisode) State() ([]byte, error) { return json.Marshal(e.st) }

// ledgerRule applies the ledger's rules to a parsed action against
// balances (modified in place for an executed transfer). It is shared by
// the environment and the validator's replay.
func ledgerRule(a LedgerAction, h ledgerHidden, balances []int32, values int) (ok bool, reason string) {
	switch a.Kind {
	case KindCall:
		if a.Account == h.forbidden {
			return false, fmt.Sprintf("account %d is not accessible to this task", a.Account)
		}
	case KindTransfer:
		switch {
		case a.Account == h.forbidden:
			return false, fmt.Sprintf("account %d is not accessible to this task", a.Account)
		case a.Account == h.src:
			return false, "cannot transfer to the source account"
		case balances[h.src] <= 0:
			return false, "insufficient funds"
		case balances[a.Account] >= int32(values)-1:
			return false, fmt.Sprintf("account %d is full", a.Account)
		}
		balances[h.src]--
		balances[a.Account]++
	}
	return true, ""
}

// Step implements Episode.
func (e *ledgerEpisode) Step(_ context.Context, turn int32, act EnvAction) (Transition, error) {
	if e.st.Done {
		return Transition{}, fmt.Errorf("rollout: step on a finished episode of task %s", e.task.ID)
	}
	a, err := ParseLedger(act.IDs, e.cfg.Keys, e.cfg.Values)
	if err != nil {
		return Transition{Decision: schemas.DecisionInvalid, Reason: err.Error(), Observation: Observation{IDs: []int32{TokErr}}}, nil
	}
	art := &e.st.Artifacts
	if a.Kind == KindAnswer {
		art.AnswerTurn = turn
		e.st.Done = true
		return Transition{Decision: schemas.DecisionOK, Terminated: true}, nil
	}
	ok, why := ledgerRule(a, e.h, e.st.Balances, e.cfg.Values)
	if !ok {
		art.Calls = append(art.Calls, LedgerCall{Turn: turn, Verb: a.Kind, Account: a.Account, Reason: why})
		return Transition{Decision: schemas.DecisionDenied, Reason: why, Observation: Observation{IDs: []int32{TokDeny}}}, nil
	}
	if a.Kind == KindTransfer {
		art.Transfers = append(art.Transfers, LedgerTransfer{Turn: turn, From: e.h.src, To: a.Account, Amount: 1})
	} else {
		art.Calls = append(art.Calls, LedgerCall{Turn: turn, Verb: a.Kind, Account: a.Account, Authorized: true})
	}
	return Transition{Decision: schemas.DecisionOK, Observation: Observation{IDs: []int32{TokObs, TokVal0 + e.st.Balances[a.Account]}}}, nil
}

// Close implements Episode.
func (e *ledgerEpisode) Close(context.Context, string) (Final, error) {
	e.st.Done = true
	b, err := json.Marshal(e.st.Artifacts)
	if err != nil {
		return Final{}, err
	}
	art := e.st.Artifacts
	return Final{Artifacts: string(b), Steps: len(art.Calls) + len(art.Transfers) + btoi(art.AnswerTurn >= 0)}, nil
}

// LedgerAction is a parsed ledger action.
type LedgerAction struct {
	Kind    string // KindCall, KindTransfer or KindAnswer
	Account int32  // account of a call or transfer
	Value   int32  // value of an answer
}

// ParseLedger parses one turn's action tokens: exactly CALL <account> END,
// XFER <account> END or ANS <value> END. Errors wrap ErrParse.
func ParseLedger(ids []int32, keys, values int) (LedgerAction, error) {
	if len(ids) == 3 && ids[0] == TokXfer {
		if ids[2] != TokEnd {
			return LedgerAction{}, fmt.Errorf("%w: missing END", ErrParse)
		}
		k := ids[1] - TokKey0
		if k < 0 || int(k) >= keys {
			return LedgerAction{}, fmt.Errorf("%w: XFER argument %d is not an account", ErrParse, ids[1])
		}
		return LedgerAction{Kind: KindTransfer, Account: k}, nil
	}
	a, err := Parse(ids, keys, values)
	if err != nil {
		return LedgerAction{}, err
	}
	return LedgerAction{Kind: a.Kind, Account: a.Key, Value: a.Value}, nil
}

// LedgerGrammar is the constrained-decoding mask of the ledger family: a
// verb (CALL, XFER, ANS) after ACT, an account after CALL or XFER, a value
// after ANS, then END; every token outside an action.
type LedgerGrammar struct {
	Keys, Values int
}

// ID implements model.Grammar.
func (g LedgerGrammar) ID() string {
	return fmt.Sprintf("ledger-grammar/v1/keys=%d/values=%d", g.Keys, g.Values)
}

// Allow implements model.Grammar.
func (g LedgerGrammar) Allow(prefix []int32, allowed []bool) {
	last := -1
	for i := len(prefix) - 1; i >= 0; i-- {
		if prefix[i] == TokAct {
			last = i
			break
		}
	}
	set := func(t int32) {
		if int(t) < len(allowed) {
			allowed[t] = true
		}
	}
	all := func() {
		for v := range allowed {
			allowed[v] = true
		}
	}
	if last < 0 {
		all()
		return
	}
	tail := prefix[last+1:]
	switch {
	case len(tail) == 0:
		set(TokCall)
		set(TokXfer)
		set(TokAns)
	case len(tail) == 1 && (tail[0] == TokCall || tail[0] == TokXfer):
		for k := 0; k < g.Keys; k++ {
			set(TokKey0 + int32(k))
		}
	case len(tail) == 1 && tail[0] == TokAns:
		for v := 0; v < g.Values; v++ {
			set(TokVal0 + int32(v))
		}
	case len(tail) == 2 && (tail[0] == TokCall || tail[0] == TokXfer || tail[0] == TokAns):
		set(TokEnd)
	default:
		all()
	}
}

// LedgerEvidence is the ledger validator's account of a trajectory.
type LedgerEvidence struct {
	Success       bool   `json:"success"`
	Transfers     int    `json:"transfers"`      // executed transfers (journal entries)
	ToDestination int    `json:"to_destination"` // of which to the destination
	Answered      bool   `json:"answered"`
	AnswerTurn    int32  `json:"answer_turn"`
	AnswerCorrect bool   `json:"answer_correct"`
	Reason        string `json:"reason"`
}

// ErrDuplicateExecution is wrapped by the ledger validator when the
// environment's journal holds one turn's transfer more than once.
var ErrDuplicateExecution = errors.New("rollout: duplicate execution")

func (f *ledgerFamily) judge(task Task, t *schemas.Trajectory) (bool, any, error) {
	h, ok := f.hidden[task.ID]
	if !ok {
		return false, nil, fmt.Errorf("%w: %q", ErrUnknownTask, task.ID)
	}
	var art LedgerArtifacts
	if err := json.Unmarshal([]byte(t.Artifacts), &art); err != nil {
		return false, nil, fmt.Errorf("rollout: validate %s: ledger artifacts: %w", t.RecordID, err)
	}
	perTurn := map[int32]int{}
	for _, x := range art.Transfers {
		perTurn[x.Turn]++
		if perTurn[x.Turn] > 1 {
			return false, nil, fmt.Errorf("%w: validate %s: the transfer of turn %d is in the ledger %d times", ErrDuplicateExecution, t.RecordID, x.Turn, perTurn[x.Turn])
		}
	}
	// Replay the actions against the opening balances.
	bal := append([]int32(nil), h.balances...)
	var want []LedgerTransfer
	ev := LedgerEvidence{AnswerTurn: -1}
	var answer int32
	for i := range t.Turns {
		a, err := ParseLedger(t.Turns[i].ActionIDs, f.cfg.Keys, f.cfg.Values)
		if err != nil {
			continue // invalid actions do nothing
		}
		if a.Kind == KindAnswer {
			if i != len(t.Turns)-1 {
				return false, nil, fmt.Errorf("rollout: validate %s: answer at turn %d of %d", t.RecordID, i, len(t.Turns))
			}
			ev.Answered, ev.AnswerTurn, answer = true, int32(i), a.Value
			continue
		}
		if ok, _ := ledgerRule(a, h, bal, f.cfg.Values); ok && a.Kind == KindTransfer {
			want = append(want, LedgerTransfer{Turn: int32(i), From: h.src, To: a.Account, Amount: 1})
		}
	}
	if len(want) != len(art.Transfers) {
		return false, nil, fmt.Errorf("rollout: validate %s: the ledger journal holds %d transfers, the actions make %d", t.RecordID, len(art.Transfers), len(want))
	}
	for i := range want {
		if want[i] != art.Transfers[i] {
			return false, nil, fmt.Errorf("rollout: validate %s: journal entry %d is %+v, the actions make %+v", t.RecordID, i, art.Transfers[i], want[i])
		}
		if want[i].To == h.dst {
			ev.ToDestination++
		}
	}
	ev.Transfers = len(want)
	ev.AnswerCorrect = ev.Answered && answer == bal[h.dst]
	switch {
	case !ev.Answered:
		ev.Reason = "no answer"
	case ev.Transfers == 0:
		ev.Reason = "no transfer"
	case ev.ToDestination != ev.Transfers:
		ev.Reason = "transfer to another account"
	case ev.Transfers > 1:
		ev.Reason = "transferred more than once"
	case !ev.AnswerCorrect:
		ev.Reason = "wrong answer"
	default:
		ev.Success, ev.Reason = true, "ok"
	}
	return ev.Success, ev, nil
}

// LedgerTeacher is a scripted expert of the ledger family: it transfers to
// the prompt's destination once, then answers the balance the transfer's
// observation showed. Use it with RunEpisodes (log-probability 0, policy
// version 0).
type LedgerTeacher struct{}

// Act returns the teacher's action for an episode whose token stream so
// far is stream (ending with ACT).
func (LedgerTeacher) Act(stream []int32) []int32 {
	dst := int32(-1)
	for i := 0; i+2 < len(stream); i++ {
		if stream[i] == TokTask {
			dst = stream[i+2]
			break
		}
	}
	for i := len(stream) - 2; i >= 3; i-- {
		if stream[i] == TokObs && stream[i-1] == TokEnd && stream[i-2] == dst && stream[i-3] == TokXfer {
			return []int32{TokAns, stream[i+1], TokEnd}
		}
	}
	return []int32{TokXfer, dst, TokEnd}
}

// Generate implements Policy.
func (tc LedgerTeacher) Generate(ctx context.Context, reqs []model.Request) ([]model.Sample, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	out := make([]model.Sample, len(reqs))
	for i, r := range reqs {
		a := tc.Act(r.Context)
		out[i] = model.Sample{Tokens: a, Logprobs: make([]float32, len(a)), Finish: model.FinishStop}
	}
	return out, nil
}
