package serve

import (
	"fmt"
	"strings"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/operators/rollout"
)

// The text form of the built-in vocabulary (operators/rollout/vocab.go),
// for the protocols' tokenizer endpoints: one word per id, words separated
// by single spaces.
//
//	0 <pad>  1 <bos>  2 TASK  3 ACT  4 OBS  5 DENY  6 ERR  7 CALL  8 ANS  9 END
//	10..17 K0..K7 (keys)   18..25 V0..V7 (values)   26.. <unusedN>
//
// Tokenize splits text on white space and maps each word to its id (an
// unknown word is an error); Detokenize joins the words of the ids. Every
// text Detokenize writes tokenizes back to the same ids.
const tokEnd = rollout.TokEnd

var namedTokens = func() map[int32]string {
	m := map[int32]string{
		rollout.TokPad: "<pad>", rollout.TokBOS: "<bos>", rollout.TokTask: "TASK", rollout.TokAct: "ACT",
		rollout.TokObs: "OBS", rollout.TokDeny: "DENY", rollout.TokErr: "ERR", rollout.TokCall: "CALL",
		rollout.TokAns: "ANS", rollout.TokEnd: "END",
	}
	for k := int32(0); k < rollout.MaxKeys; k++ {
		m[rollout.TokKey0+k] = fmt.Sprintf("K%d", k)
	}
	for v := int32(0); v < rollout.MaxValues; v++ {
		m[rollout.TokVal0+v] = fmt.Sprintf("V%d", v)
	}
	return m
}()

var tokenIDs = func() map[string]int32 {
	m := map[string]int32{}
	for id, w := range namedTokens {
		m[w] = id
	}
	return m
}()

// tokenText is the word of id (which must be in [0, vocab)).
func tokenText(id int32) string {
	if w, ok := namedTokens[id]; ok {
		return w
	}
	return fmt.Sprintf("<unused%d>", id)
}

func tokenize(text string, vocab int) ([]int32, error) {
	ids := []int32{}
	for _, w := range strings.Fields(text) {
		id, ok := tokenIDs[w]
		if !ok {
			var n int32
			if _, err := fmt.Sscanf(w, "<unused%d>", &n); err != nil || tokenText(n) != w {
				return nil, fmt.Errorf("word %q is not in the built-in vocabulary", w)
			}
			id = n
		}
		if id < 0 || int(id) >= vocab {
			return nil, fmt.Errorf("word %q is id %d, vocabulary %d", w, id, vocab)
		}
		ids = append(ids, id)
	}
	return ids, nil
}

// detokenize is the text of at most max ids.
func detokenize(ids []int64, vocab, max int) (string, error) {
	if len(ids) > max {
		return "", fmt.Errorf("tokens has %d ids, more than this server's limit of %d (trajflow serve policy --max-prompt-tokens)", len(ids), max)
	}
	words := make([]string, len(ids))
	for i, id := range ids {
		if id < 0 || id >= int64(vocab) {
			return "", fmt.Errorf("tokens[%d] = %d, vocabulary %d", i, id, vocab)
		}
		words[i] = tokenText(int32(id))
	}
	return strings.Join(words, " "), nil
}

// chatTemplate is the built-in chat template: the words of every message's
// content after <bos>, and ACT (the agent's turn marker) as the generation
// prompt; roles carry no tokens in the built-in vocabulary. A user message
// "TASK K2" renders "<bos> TASK K2 ACT", the built-in first prompt.
const chatTemplate = "trajflow kv chat template v1: <bos> {content of each message, space-separated} [ACT when add_generation_prompt]"

func applyTemplate(msgs []rollout.ChatMessage, addGenerationPrompt bool) string {
	parts := []string{tokenText(rollout.TokBOS)}
	for _, m := range msgs {
		if f := strings.Fields(m.Content); len(f) > 0 {
			parts = append(parts, strings.Join(f, " "))
		}
	}
	if addGenerationPrompt {
		parts = append(parts, tokenText(rollout.TokAct))
	}
	return strings.Join(parts, " ")
}

// chatTemplateHash is the template's hash the info endpoints report.
var chatTemplateHash = policy.HashText(chatTemplate)
