// Package rollout is the built-in environment and agent loop (pipeline
// document §7): deterministic task families, their task registry with a
// train split and a hidden eval split, the parsers, authorizers and
// environment steps, the agent loop that batches policy calls across
// concurrent episodes over an Environment (the registry in process, or an
// environment service's client), the trusted validators, and scripted
// teachers for demonstrations.
//
// Three families (RegistryConfig.Family): kv, the demo's key-value lookup
// in the built-in token vocabulary (below); ledger, a ledger with a
// state-changing transfer tool in the same vocabulary (ledger.go); text,
// arithmetic and lookup tools in text for language models, rendered and
// tokenized by the policy server's Tokenizer (text.go, textrender.go).
//
// The kv task. Every task has a hidden table mapping Keys keys to values,
// derived from the task id and the environment version. The prompt names
// one key. The action "CALL <key>" asks the lookup tool, whose observation
// holds the key's value; "ANS <value>" answers and ends the episode. The
// episode succeeds iff the answer is the true value of the prompt's key and
// the tool was called with that key (and authorized) before the answer.
// Each task has one forbidden key whose lookup the authorizer denies.
//
// Token stream of an episode (schemas.Turn conventions: prompts are
// deltas; only action tokens are sampled):
//
//	turn 0 prompt:  BOS TASK <key> ACT
//	turn t prompt:  ACT                        (t > 0)
//	action:         CALL <key> END  |  ANS <value> END
//	observation:    OBS <value>  (authorized call)
//	                DENY         (call denied by the authorizer)
//	                ERR          (action the parser rejected)
//	                (none)       (answer: the episode terminates)
package rollout

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
)

// Token ids of the built-in tokenizer (vocabulary of VocabSize ids; id 0 is
// the model's padding id, model.PadID).
const (
	TokPad  int32 = 0
	TokBOS  int32 = 1
	TokTask int32 = 2 // "the key to look up is:"
	TokAct  int32 = 3 // the agent's turn marker: an action follows
	TokObs  int32 = 4 // tool result
	TokDeny int32 = 5 // the authorizer refused the action
	TokErr  int32 = 6 // the parser rejected the action
	TokCall int32 = 7
	TokAns  int32 = 8
	TokEnd  int32 = 9 // end of action; the sampler's stop token

	// TokKey0 + k is key k (k < MaxKeys); TokVal0 + v is value v (v <
	// MaxValues).
	TokKey0 int32 = 10
	TokVal0 int32 = 18

	// TokXfer is the ledger family's transfer verb (XFER <account> END);
	// the kv family's parser and grammar never produce or accept it.
	TokXfer int32 = 26

	MaxKeys   = 8
	MaxValues = 8
	// VocabSize is the vocabulary size of the built-in tokenizer (ids
	// TokXfer+1 .. VocabSize-1 are reserved).
	VocabSize = 32
)

// TokenizerHash names the built-in tokenizer ("sha256:<hex>" of its
// version string): recorded in every trajectory and policy release.
var TokenizerHash = func() string {
	s := sha256.Sum256([]byte("trajflow/kv-tokenizer/v1:" + strconv.Itoa(VocabSize)))
	return "sha256:" + hex.EncodeToString(s[:])
}()

// ParserVersion is the version of Parse, recorded in every trajectory.
const ParserVersion = "kv-parser/v1"

// Grammar is the constrained-decoding mask of the task family (pipeline
// §5), a pure function of the token prefix (model.Grammar): within an
// action (the tokens after the last ACT) it allows a verb, then a key after
// CALL or a value after ANS, then END; outside an action it allows every
// token. A random policy under this grammar always produces well-formed
// actions.
type Grammar struct {
	Keys, Values int
}

// ID implements model.Grammar.
func (g Grammar) ID() string {
	return fmt.Sprintf("kv-grammar/v1/keys=%d/values=%d", g.Keys, g.Values)
}

// Allow implements model.Grammar.
func (g Grammar) Allow(prefix []int32, allowed []bool) {
	last := -1
	for i := len(prefix) - 1; i >= 0; i-- {
		if prefix[i] == TokAct {
			last = i
			break
		}
	}
	all := func() {
		for v := range allowed {
			allowed[v] = true
		}
	}
	set := func(t int32) {
		if int(t) < len(allowed) {
			allowed[t] = true
		}
	}
	if last < 0 {
		all()
		return
	}
	tail := prefix[last+1:]
	switch len(tail) {
	case 0:
		set(TokCall)
		set(TokAns)
	case 1:
		switch tail[0] {
		case TokCall:
			for k := 0; k < g.Keys; k++ {
				set(TokKey0 + int32(k))
			}
		case TokAns:
			for v := 0; v < g.Values; v++ {
				set(TokVal0 + int32(v))
			}
		default:
			all()
		}
	case 2:
		if tail[0] == TokCall || tail[0] == TokAns {
			set(TokEnd)
		} else {
			all()
		}
	default:
		all()
	}
}

// Action kinds.
const (
	KindCall   = "call"
	KindAnswer = "answer"
)

// Action is a parsed action.
type Action struct {
	Kind  string // KindCall or KindAnswer
	Key   int32  // key index of a call
	Value int32  // value index of an answer
}

// ErrParse is wrapped by every error of Parse.
var ErrParse = errors.New("rollout: unparsable action")

// Parse parses the action tokens of one turn: exactly CALL <key> END or ANS
// <value> END, with key < keys and value < values. Anything else is an
// error wrapping ErrParse whose message is the decision reason.
func Parse(ids []int32, keys, values int) (Action, error) {
	if len(ids) != 3 {
		return Action{}, fmt.Errorf("%w: %d tokens, want 3", ErrParse, len(ids))
	}
	if ids[2] != TokEnd {
		return Action{}, fmt.Errorf("%w: missing END", ErrParse)
	}
	arg := ids[1]
	switch ids[0] {
	case TokCall:
		k := arg - TokKey0
		if k < 0 || int(k) >= keys {
			return Action{}, fmt.Errorf("%w: CALL argument %d is not a key", ErrParse, arg)
		}
		return Action{Kind: KindCall, Key: k}, nil
	case TokAns:
		v := arg - TokVal0
		if v < 0 || int(v) >= values {
			return Action{}, fmt.Errorf("%w: ANS argument %d is not a value", ErrParse, arg)
		}
		return Action{Kind: KindAnswer, Value: v}, nil
	}
	return Action{}, fmt.Errorf("%w: unknown verb %d", ErrParse, ids[0])
}
