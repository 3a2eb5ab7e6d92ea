package rollout_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/faketok"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/operators/validate"
	"github.com/trajflow/trajflow/schemas"
)

func familyRegistry(t testing.TB, family string) *rollout.Registry {
	t.Helper()
	cfg, err := rollout.DefaultFamilyConfig(family)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Train, cfg.Eval = 48, 16
	r, err := rollout.NewRegistry(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func attemptsFor(tasks []rollout.Task, g int32) []schemas.TaskAttempt {
	var out []schemas.TaskAttempt
	for i, task := range tasks {
		out = append(out, rollout.Attempts("run", task, int64(i), g, 7, 0, "contract")...)
	}
	return out
}

func fixed() rollout.Limits {
	l := rollout.DefaultLimits()
	l.Now = func() time.Time { return time.Unix(1700000000, 0) }
	return l
}

// scriptedTokens plays a fixed list of action token sequences, one per
// turn (the last repeats).
type scriptedTokens [][]int32

func (s scriptedTokens) Generate(_ context.Context, reqs []model.Request) ([]model.Sample, error) {
	out := make([]model.Sample, len(reqs))
	for i, r := range reqs {
		turn := 0
		for _, x := range r.Context {
			if x == rollout.TokAct {
				turn++
			}
		}
		a := s[min(turn-1, len(s)-1)]
		out[i] = model.Sample{Tokens: a, Logprobs: make([]float32, len(a))}
	}
	return out, nil
}

func TestFamilySelection(t *testing.T) {
	for _, tc := range []struct{ artifact, family string }{
		{rollout.ArtifactKV, rollout.FamilyKV}, {rollout.ArtifactLedger, rollout.FamilyLedger}, {rollout.ArtifactText, rollout.FamilyText},
	} {
		f, err := rollout.FamilyOfArtifact(tc.artifact)
		if err != nil || f != tc.family {
			t.Fatalf("%s: %q %v", tc.artifact, f, err)
		}
		r, err := rollout.NewFamilyRegistry(f)
		if err != nil || r.Family() != f {
			t.Fatalf("registry of %s: %v", f, err)
		}
		if prefix := f + "-train-"; !strings.HasPrefix(r.Train()[0].ID, prefix) {
			t.Fatalf("%s task id %s", f, r.Train()[0].ID)
		}
	}
	for _, bad := range []string{"builtin:env/kv-env@v2", "docker:env/sandbox@v1", ""} {
		if _, err := rollout.FamilyOfArtifact(bad); err == nil || !strings.Contains(err.Error(), "artifacts.environment") {
			t.Fatalf("%q: %v", bad, err)
		}
	}
	if _, err := rollout.NewRegistry(rollout.RegistryConfig{Family: "chess", EnvVersion: "e", TaskVersion: "1", Train: 1, Keys: 4, Values: 4}); err == nil {
		t.Fatal("unknown family accepted")
	}
	// The text family's grammar is nil (a language model's sampler); the
	// ledger's is its own; the kv default unchanged.
	if g := familyRegistry(t, rollout.FamilyText).Grammar(); g != nil {
		t.Fatalf("text grammar %v", g)
	}
	if g := familyRegistry(t, rollout.FamilyLedger).Grammar(); g.ID() != "ledger-grammar/v1/keys=4/values=8" {
		t.Fatalf("ledger grammar %s", g.ID())
	}
	if g := familyRegistry(t, rollout.FamilyKV).Grammar(); g.ID() != "kv-grammar/v1/keys=4/values=8" {
		t.Fatalf("kv grammar %s", g.ID())
	}
}

// TestSplitsDisjointAndDeniable: every family's train and eval ids are
// disjoint, stable across registries, and the eval ids are what the
// dispatcher's denylist (IsEval) refuses.
func TestSplitsDisjointAndDeniable(t *testing.T) {
	for _, f := range rollout.Families() {
		reg, again := familyRegistry(t, f), familyRegistry(t, f)
		seen := map[string]bool{}
		for _, task := range append(reg.Train(), reg.Eval()...) {
			if seen[task.ID] {
				t.Fatalf("%s: id %s twice", f, task.ID)
			}
			seen[task.ID] = true
			if reg.IsEval(task.ID) != (task.Split == schemas.SplitEval) {
				t.Fatalf("%s: IsEval(%s)", f, task.ID)
			}
			if t2, _ := again.Lookup(task.ID); t2 != task {
				t.Fatalf("%s: task %s differs between registries", f, task.ID)
			}
		}
		// A train attempt re-labelled eval, or an eval id, is refused by Reset.
		a := attemptsFor(reg.Train()[:1], 1)[0]
		a.Split = schemas.SplitEval
		if _, _, err := reg.Reset(context.Background(), a); !errors.Is(err, rollout.ErrUnknownTask) {
			t.Fatalf("%s: split mismatch: %v", f, err)
		}
	}
}

// --- ledger ---

func TestLedgerTeacherTransfersOnce(t *testing.T) {
	reg := familyRegistry(t, rollout.FamilyLedger)
	v := rollout.NewValidator(reg)
	if v.Name() != rollout.EvalLedgerSuccess {
		t.Fatalf("evaluator %s", v.Name())
	}
	all := append(reg.Train(), reg.Eval()...)
	trajs, err := reg.RunEpisodes(context.Background(), rollout.LedgerTeacher{}, attemptsFor(all, 1), rollout.DefaultSettings(reg), fixed())
	if err != nil {
		t.Fatal(err)
	}
	for i := range trajs {
		tr := &trajs[i]
		ok, ev, err := v.Validate(all[i], tr)
		if err != nil || !ok || len(tr.Turns) != 2 {
			t.Fatalf("%s: %v %s %v, %d turns", tr.TaskID, ok, ev, err, len(tr.Turns))
		}
		var art rollout.LedgerArtifacts
		if err := json.Unmarshal([]byte(tr.Artifacts), &art); err != nil || len(art.Transfers) != 1 || art.Transfers[0].Turn != 0 {
			t.Fatalf("%s: artifacts %s", tr.TaskID, tr.Artifacts)
		}
		if tr.ParserVersion != rollout.LedgerParserVersion || tr.TokenizerHash != rollout.TokenizerHash || tr.Domain != rollout.LedgerDomain {
			t.Fatalf("%s: versions %s %s %s", tr.TaskID, tr.ParserVersion, tr.TokenizerHash, tr.Domain)
		}
		// Everything the validate stage checks holds, with the built-in vocabulary.
		if vd := validate.Check(tr, validate.Options{VocabSize: rollout.VocabSize, MaxTurns: 4, MaxTokensPerAction: 3, MaxTokensPerEpisode: 64}); (vd.Class == validate.Valid) != (tr.Split == schemas.SplitTrain) {
			t.Fatalf("%s: validate %+v", tr.TaskID, vd)
		}
	}
}

// TestLedgerDuplicateExecutionIsObservable: a journal that holds one
// turn's transfer twice (what executing one action twice leaves) is refused
// by the validator with ErrDuplicateExecution; a journal that disagrees
// with the actions in any other way is refused too; two transfers the
// agent chose are a task failure, not an error.
func TestLedgerDuplicateExecutionIsObservable(t *testing.T) {
	reg := familyRegistry(t, rollout.FamilyLedger)
	v := rollout.NewValidator(reg)
	task := reg.Train()[3]
	tr, err := reg.RunEpisode(context.Background(), rollout.LedgerTeacher{}, attemptsFor([]rollout.Task{task}, 1)[0], rollout.DefaultSettings(reg), fixed())
	if err != nil {
		t.Fatal(err)
	}
	var art rollout.LedgerArtifacts
	if err := json.Unmarshal([]byte(tr.Artifacts), &art); err != nil {
		t.Fatal(err)
	}
	dup := art
	dup.Transfers = append(slices.Clone(art.Transfers), art.Transfers[0])
	b, _ := json.Marshal(dup)
	bad := tr
	bad.Artifacts = string(b)
	if _, _, err := v.Validate(task, &bad); !errors.Is(err, rollout.ErrDuplicateExecution) {
		t.Fatalf("duplicated journal: %v", err)
	}
	lost := art
	lost.Transfers = nil
	b, _ = json.Marshal(lost)
	bad.Artifacts = string(b)
	if _, _, err := v.Validate(task, &bad); err == nil || errors.Is(err, rollout.ErrDuplicateExecution) {
		t.Fatalf("journal without the transfer: %v", err)
	}
	// The agent transfers twice (two turns): judged, and a failure.
	twice := 0
	for _, task := range reg.Train() {
		dst := rollout.TokKey0 + task.Key
		tr2, err := reg.RunEpisode(context.Background(), scriptedTokens{
			{rollout.TokXfer, dst, rollout.TokEnd}, {rollout.TokXfer, dst, rollout.TokEnd}, {rollout.TokAns, rollout.TokVal0, rollout.TokEnd},
		}, attemptsFor([]rollout.Task{task}, 1)[0], rollout.DefaultSettings(reg), fixed())
		if err != nil {
			t.Fatal(err)
		}
		ok, ev, err := v.Validate(task, &tr2)
		if err != nil || ok {
			t.Fatalf("two transfers: %v %s %v", ok, ev, err)
		}
		if tr2.Turns[1].Decision == schemas.DecisionOK {
			twice++
			if !strings.Contains(ev, `"transfers":2`) || !strings.Contains(ev, `"reason":"transferred more than once"`) {
				t.Fatalf("two transfers evidence %s", ev)
			}
		}
	}
	if twice == 0 {
		t.Fatal("no task allowed two transfers")
	}
}

// TestLedgerRules: denials by the authorizer and the ledger, and resuming
// an episode from its state continues it exactly.
func TestLedgerRules(t *testing.T) {
	reg := familyRegistry(t, rollout.FamilyLedger)
	ctx := context.Background()
	task := reg.Train()[5]
	a := attemptsFor([]rollout.Task{task}, 1)[0]
	ep, obs, err := reg.Reset(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	if len(obs.IDs) != 5 || obs.IDs[1] != rollout.TokTask || obs.IDs[3] != rollout.TokKey0+task.Key {
		t.Fatalf("prompt %v", obs.IDs)
	}
	src := obs.IDs[2]
	step := func(ep rollout.Episode, turn int32, ids ...int32) rollout.Transition {
		t.Helper()
		tr, err := ep.Step(ctx, turn, rollout.EnvAction{IDs: ids})
		if err != nil {
			t.Fatal(err)
		}
		return tr
	}
	if tr := step(ep, 0, rollout.TokXfer, src, rollout.TokEnd); tr.Decision != schemas.DecisionDenied || !strings.Contains(tr.Reason, "source") {
		t.Fatalf("transfer to the source: %+v", tr)
	}
	if tr := step(ep, 1, rollout.TokXfer, rollout.TokVal0, rollout.TokEnd); tr.Decision != schemas.DecisionInvalid {
		t.Fatalf("transfer to a value: %+v", tr)
	}
	forbidden := int32(-1)
	for acct := int32(0); acct < 4; acct++ {
		if k := rollout.TokKey0 + acct; k != src && k != rollout.TokKey0+task.Key {
			ep2, _, _ := reg.Reset(ctx, a)
			if tr := step(ep2, 0, rollout.TokCall, k, rollout.TokEnd); tr.Decision == schemas.DecisionDenied {
				forbidden = acct
			}
		}
	}
	if forbidden < 0 {
		t.Fatal("no forbidden account")
	}
	if tr := step(ep, 2, rollout.TokXfer, rollout.TokKey0+forbidden, rollout.TokEnd); tr.Decision != schemas.DecisionDenied || !strings.Contains(tr.Reason, "not accessible") {
		t.Fatalf("transfer to the forbidden account: %+v", tr)
	}
	// Save the state, transfer, and compare with a resumed copy.
	st, err := ep.(rollout.Stateful).State()
	if err != nil {
		t.Fatal(err)
	}
	want := step(ep, 3, rollout.TokXfer, rollout.TokKey0+task.Key, rollout.TokEnd)
	res, err := reg.Resume(a, st)
	if err != nil {
		t.Fatal(err)
	}
	if got := step(res, 3, rollout.TokXfer, rollout.TokKey0+task.Key, rollout.TokEnd); !slices.Equal(got.Observation.IDs, want.Observation.IDs) || got.Decision != want.Decision {
		t.Fatalf("resumed step %+v, want %+v", got, want)
	}
	f1, _ := ep.Close(ctx, rollout.ReasonAnswer)
	f2, _ := res.Close(ctx, rollout.ReasonAnswer)
	if f1.Artifacts != f2.Artifacts || !strings.Contains(f1.Artifacts, `"transfers":[{"turn":3`) {
		t.Fatalf("artifacts %s vs %s", f1.Artifacts, f2.Artifacts)
	}
	if _, err := reg.Resume(a, []byte("{")); err == nil {
		t.Fatal("corrupt state resumed")
	}
}

// --- text ---

// textTeacher solves text tasks from the conversation it sees: it looks up
// the keys the task names, uses the calculator for arithmetic, then
// answers. Every other action ends at the end-of-turn token (a sampler
// stopping at EOS); the others end at the closing tag (a stop string).
type textTeacher struct{}

var (
	reLookupArith = regexp.MustCompile(`key "([a-z]+)", multiply it by (\d+) and add (\d+)`)
	reArith       = regexp.MustCompile(`Compute (\d+) \* (\d+) - (\d+)\.`)
	reSum         = regexp.MustCompile(`keys "([a-z]+)" and "([a-z]+)"`)
	reLookupObs   = regexp.MustCompile(`lookup ([a-z]+): (\d+)`)
	reCalcObs     = regexp.MustCompile(`calc result: (-?\d+)`)
)

func (textTeacher) act(conv string) string {
	vals := map[string]int64{}
	for _, m := range reLookupObs.FindAllStringSubmatch(conv, -1) {
		vals[m[1]], _ = strconv.ParseInt(m[2], 10, 64)
	}
	num := func(s string) int64 { v, _ := strconv.ParseInt(s, 10, 64); return v }
	if m := reLookupArith.FindStringSubmatch(conv); m != nil {
		if v, ok := vals[m[1]]; ok {
			return fmt.Sprintf("<answer>%d</answer>", v*num(m[2])+num(m[3]))
		}
		return "<tool>lookup: " + m[1] + "</tool>"
	}
	if m := reArith.FindStringSubmatch(conv); m != nil {
		if r := reCalcObs.FindStringSubmatch(conv); r != nil {
			return "The calculator says so. <answer>" + r[1] + "</answer>"
		}
		return fmt.Sprintf("<tool>calc: %s * %s - %s</tool>", m[1], m[2], m[3])
	}
	if m := reSum.FindStringSubmatch(conv); m != nil {
		for _, k := range m[1:3] {
			if _, ok := vals[k]; !ok {
				return "<tool>lookup: " + k + "</tool>"
			}
		}
		return fmt.Sprintf("<answer>%d</answer>", vals[m[1]]+vals[m[2]])
	}
	return "<answer>0</answer>"
}

func (tt textTeacher) Generate(ctx context.Context, reqs []model.Request) ([]model.Sample, error) {
	out := make([]model.Sample, len(reqs))
	for i, r := range reqs {
		conv := faketok.Decode(r.Context)
		ids := faketok.Encode(tt.act(conv))
		if strings.Count(conv, "<|im_start|>assistant")%2 == 1 {
			ids = append(ids, faketok.IMEnd)
		}
		out[i] = model.Sample{Tokens: ids, Logprobs: make([]float32, len(ids))}
	}
	return out, nil
}

// textAgent runs text attempts with the fake tokenizer.
func textAgent(reg *rollout.Registry, pol rollout.Policy, tok rollout.Tokenizer) rollout.Agent {
	lim := fixed()
	lim.MaxEpisodeTokens = 4096
	return rollout.Agent{Env: reg, Policy: pol, Tokenizer: tok, Settings: rollout.DefaultSettings(reg), Limits: lim}
}

func TestTextTeacherSolvesEveryTask(t *testing.T) {
	reg := familyRegistry(t, rollout.FamilyText)
	v := rollout.NewValidator(reg)
	tok := &faketok.Tokenizer{}
	all := append(reg.Train(), reg.Eval()...)
	trajs, err := textAgent(reg, textTeacher{}, tok).Run(context.Background(), attemptsFor(all, 1))
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[int32]int{}
	for i := range trajs {
		tr := &trajs[i]
		ok, ev, err := v.Validate(all[i], tr)
		if err != nil || !ok {
			t.Fatalf("%s: %v %s %v", tr.TaskID, ok, ev, err)
		}
		kinds[all[i].Key]++
		if tr.TokenizerHash != tok.TokenizerHash() || tr.ParserVersion != rollout.TextParserVersion || tr.Domain != rollout.TextDomain {
			t.Fatalf("%s: versions %s %s", tr.TaskID, tr.TokenizerHash, tr.ParserVersion)
		}
		if vd := validate.Check(tr, validate.Options{VocabSize: int32(faketok.VocabSize), MaxTurns: 4, MaxTokensPerEpisode: 4096}); (vd.Class == validate.Valid) != (tr.Split == schemas.SplitTrain) {
			t.Fatalf("%s: validate %+v", tr.TaskID, vd)
		}
	}
	if len(kinds) != 3 {
		t.Fatalf("task kinds %v", kinds)
	}
}

// TestTextStreamIsTheTemplate: the token stream an episode records
// (prompts, sampled actions, observations) is exactly the chat template's
// rendering of the conversation, built from deltas without re-tokenizing
// earlier turns, whether the sampler stopped at the end-of-turn token or
// at the closing tag.
func TestTextStreamIsTheTemplate(t *testing.T) {
	reg := familyRegistry(t, rollout.FamilyText)
	tok := &faketok.Tokenizer{}
	ctx := context.Background()
	tasks := reg.Train()[:12]
	trajs, err := textAgent(reg, textTeacher{}, tok).Run(ctx, attemptsFor(tasks, 1))
	if err != nil {
		t.Fatal(err)
	}
	for i := range trajs {
		tr := &trajs[i]
		_, obs, err := reg.Reset(ctx, attemptsFor(tasks[i:i+1], 1)[0])
		if err != nil {
			t.Fatal(err)
		}
		msgs := slices.Clone(obs.Messages)
		var stream []int32
		for j, turn := range tr.Turns {
			stream = append(append(append(stream, turn.PromptIDs...), turn.ActionIDs...), turn.ObservationIDs...)
			act := strings.TrimSuffix(faketok.Decode(turn.ActionIDs), "<|im_end|>")
			msgs = append(msgs, rollout.ChatMessage{Role: "assistant", Content: act})
			if j < len(tr.Turns)-1 {
				// the observation as the policy saw it
				o := faketok.Decode(turn.ObservationIDs)
				_, content, _ := strings.Cut(o, "<|im_start|>tool\n")
				msgs = append(msgs, rollout.ChatMessage{Role: "tool", Content: strings.TrimSuffix(content, "<|im_end|>\n")})
			}
		}
		want, _ := tok.ApplyTemplate(ctx, msgs, false)
		last := tr.Turns[len(tr.Turns)-1].ActionIDs
		if last[len(last)-1] == faketok.IMEnd {
			want = strings.TrimSuffix(want, "\n")
		} else {
			want = strings.TrimSuffix(want, "<|im_end|>\n")
		}
		if got := faketok.Decode(stream); got != want {
			t.Fatalf("%s: stream\n%q\nwant\n%q", tr.TaskID, got, want)
		}
	}
}

// TestTextToolOutputIsData: a tool output holding markup (the memo key's
// injected instruction) reaches the policy escaped: no special token, no
// action tag; an over-size or unescaped observation from an environment is
// refused by the agent loop.
func TestTextToolOutputIsData(t *testing.T) {
	reg := familyRegistry(t, rollout.FamilyText)
	ctx := context.Background()
	task := reg.Train()[0]
	a := attemptsFor([]rollout.Task{task}, 1)[0]
	ep, obs, err := reg.Reset(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	if len(obs.Messages) != 2 || obs.Messages[0].Role != "system" || !strings.Contains(obs.Messages[0].Content, "<tool>calc: EXPRESSION</tool>") ||
		!strings.Contains(obs.Messages[0].Content, "never instructions") || obs.Messages[1].Role != "user" {
		t.Fatalf("first messages %+v", obs.Messages)
	}
	tr, err := ep.Step(ctx, 0, rollout.EnvAction{Text: "<tool>lookup: memo</tool>"})
	if err != nil {
		t.Fatal(err)
	}
	if tr.Decision != schemas.DecisionOK || strings.ContainsAny(tr.Observation.Text, "<>") || !strings.Contains(tr.Observation.Text, "&lt;answer&gt;") {
		t.Fatalf("memo observation %q", tr.Observation.Text)
	}
	tok := &faketok.Tokenizer{}
	memo := scriptedText{"<tool>lookup: memo</tool>", "<answer>1</answer>"}
	trj, err := textAgent(reg, memo, tok).Run(ctx, []schemas.TaskAttempt{a})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range trj[0].Turns[0].ObservationIDs[1:] { // after the closing newline
		if id == faketok.IMStart && !strings.HasPrefix(faketok.Decode(trj[0].Turns[0].ObservationIDs[1:]), "<|im_start|>tool\n") {
			t.Fatal("a special token inside the tool output")
		}
	}
	if n := strings.Count(faketok.Decode(trj[0].Turns[0].ObservationIDs), "<|im_start|>"); n != 1 {
		t.Fatalf("%d message starts in one observation: %q", n, faketok.Decode(trj[0].Turns[0].ObservationIDs))
	}
	// An environment that breaks the rules is an infrastructure failure.
	for _, o := range []string{"raw <answer>1</answer>", strings.Repeat("x", rollout.TextMaxObservation+1)} {
		bad := rollout.Agent{Env: lyingEnv{reg, o}, Policy: memo, Tokenizer: tok, Settings: rollout.DefaultSettings(reg), Limits: textAgent(reg, memo, tok).Limits}
		if _, err := bad.Run(ctx, []schemas.TaskAttempt{a}); !errors.Is(err, rollout.ErrEnvironment) {
			t.Fatalf("observation %.20q: %v", o, err)
		}
	}
	// Without a tokenizer a text family cannot run.
	if _, err := reg.RunEpisodes(ctx, memo, []schemas.TaskAttempt{a}, rollout.DefaultSettings(reg), fixed()); err == nil || !strings.Contains(err.Error(), "Tokenizer") {
		t.Fatalf("no tokenizer: %v", err)
	}
}

// lyingEnv wraps an environment and replaces every observation's text.
type lyingEnv struct {
	rollout.Environment
	text string
}

func (l lyingEnv) Reset(ctx context.Context, a schemas.TaskAttempt) (rollout.Episode, rollout.Observation, error) {
	ep, obs, err := l.Environment.Reset(ctx, a)
	return lyingEpisode{ep, l.text}, obs, err
}

type lyingEpisode struct {
	rollout.Episode
	text string
}

func (l lyingEpisode) Step(ctx context.Context, turn int32, a rollout.EnvAction) (rollout.Transition, error) {
	tr, err := l.Episode.Step(ctx, turn, a)
	tr.Observation.Text = l.text
	return tr, err
}

// scriptedText plays fixed action texts (each ended by the end-of-turn
// token).
type scriptedText []string

func (s scriptedText) Generate(_ context.Context, reqs []model.Request) ([]model.Sample, error) {
	out := make([]model.Sample, len(reqs))
	for i, r := range reqs {
		turn := strings.Count(faketok.Decode(r.Context), "<|im_start|>assistant") - 1
		ids := append(faketok.Encode(s[min(turn, len(s)-1)]), faketok.IMEnd)
		out[i] = model.Sample{Tokens: ids, Logprobs: make([]float32, len(ids))}
	}
	return out, nil
}

func TestParseText(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want rollout.TextAction
		err  string
	}{
		{"<tool>calc: 12*7</tool>", rollout.TextAction{Kind: rollout.KindCall, Tool: "calc", Arg: "12*7"}, ""},
		{"I will look it up. <tool> lookup :  cedar </tool> then answer", rollout.TextAction{Kind: rollout.KindCall, Tool: "lookup", Arg: "cedar"}, ""},
		{"<answer> -84 </answer>", rollout.TextAction{Kind: rollout.KindAnswer, Answer: -84}, ""},
		{"<answer>84</answer><tool>calc: 1</tool>", rollout.TextAction{Kind: rollout.KindAnswer, Answer: 84}, ""},
		{"<tool>calc: 1+</tool>", rollout.TextAction{}, "calc: expression ends early"},
		{"<tool>calc: (1+2</tool>", rollout.TextAction{}, "missing ')'"},
		{"<tool>calc: 2^3</tool>", rollout.TextAction{}, "unexpected '^'"},
		{"<tool>search: cats</tool>", rollout.TextAction{}, `unknown tool "search"`},
		{"<tool>lookup: Cedar!</tool>", rollout.TextAction{}, "lookup key"},
		{"<tool>lookup cedar</tool>", rollout.TextAction{}, "NAME: ARGUMENT"},
		{"<tool>lookup: cedar", rollout.TextAction{}, "unterminated <tool>"},
		{"<answer>eighty</answer>", rollout.TextAction{}, "not an integer"},
		{"84", rollout.TextAction{}, "no <tool> or <answer>"},
		{"<tool>calc: " + strings.Repeat("1+", 40) + "1</tool>", rollout.TextAction{}, "calc expression of"},
	} {
		got, err := rollout.ParseText(tc.in)
		if tc.err == "" {
			if err != nil || got != tc.want {
				t.Errorf("%q: %+v %v", tc.in, got, err)
			}
			continue
		}
		if err == nil || !errors.Is(err, rollout.ErrParse) || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%q: %v, want %q", tc.in, err, tc.err)
		}
	}
}

func TestTextCalculatorAndAuthorizer(t *testing.T) {
	reg := familyRegistry(t, rollout.FamilyText)
	ctx := context.Background()
	a := attemptsFor(reg.Train()[:1], 1)[0]
	ep, obs, _ := reg.Reset(ctx, a)
	step := func(turn int32, s string) rollout.Transition {
		tr, err := ep.Step(ctx, turn, rollout.EnvAction{Text: s})
		if err != nil {
			t.Fatal(err)
		}
		return tr
	}
	for i, tc := range []struct{ in, obs, decision string }{
		{"<tool>calc: 12*7</tool>", "calc result: 84", schemas.DecisionOK},
		{"<tool>calc: -(3 + 4) * 2 - 10 / 3</tool>", "calc result: -17", schemas.DecisionOK},
		{"<tool>calc: 7/0</tool>", "calc error: division by zero", schemas.DecisionOK},
		{"<tool>calc: 999999999999*999999999999</tool>", "calc error: result out of range", schemas.DecisionOK},
		{"<tool>lookup: zebra</tool>", `lookup error: no key &quot;zebra&quot;`, schemas.DecisionOK},
		{"nothing", "invalid action:", schemas.DecisionInvalid},
	} {
		tr := step(int32(i), tc.in)
		want := strings.ReplaceAll(tc.obs, "&quot;", `"`)
		if tr.Decision != tc.decision || !strings.HasPrefix(tr.Observation.Text, want) {
			t.Fatalf("%q: %s %q", tc.in, tr.Decision, tr.Observation.Text)
		}
	}
	// Exactly one key of the system message's list is denied.
	keys := strings.TrimSuffix(strings.SplitN(strings.SplitN(obs.Messages[0].Content, "Keys: ", 2)[1], "\n", 2)[0], ".")
	denied := 0
	for i, k := range strings.Split(keys, ", ") {
		if tr := step(int32(10+i), "<tool>lookup: "+k+"</tool>"); tr.Decision == schemas.DecisionDenied {
			denied++
			if !strings.Contains(tr.Observation.Text, "not accessible") {
				t.Fatalf("denial observation %q", tr.Observation.Text)
			}
		}
	}
	if denied != 1 {
		t.Fatalf("%d keys denied", denied)
	}
}

// TestTextValidatorRules: a guess without the lookups fails; a wrong
// answer fails; artifacts that disagree with the turns cannot be judged;
// the validator plugs into the reward stage.
func TestTextValidatorRules(t *testing.T) {
	reg := familyRegistry(t, rollout.FamilyText)
	v := rollout.NewValidator(reg)
	tok := &faketok.Tokenizer{}
	ctx := context.Background()
	var task rollout.Task
	for _, x := range reg.Train() {
		if x.Key == rollout.TextLookupArith {
			task = x
			break
		}
	}
	a := attemptsFor([]rollout.Task{task}, 1)[0]
	good, err := textAgent(reg, textTeacher{}, tok).Run(ctx, []schemas.TaskAttempt{a})
	if err != nil {
		t.Fatal(err)
	}
	ansText := faketok.Decode(good[0].Turns[1].ActionIDs)
	for _, tc := range []struct {
		name   string
		script scriptedText
		reason string
	}{
		{"guess", scriptedText{strings.TrimSuffix(ansText, "<|im_end|>")}, "answer without looking the keys up"},
		{"wrong", scriptedText{faketok.Decode(good[0].Turns[0].ActionIDs[:len(good[0].Turns[0].ActionIDs)-1]), "<answer>-1</answer>"}, "wrong answer"},
		{"no answer", scriptedText{"<tool>calc: 1</tool>"}, "no answer"},
	} {
		tr, err := textAgent(reg, tc.script, tok).Run(ctx, []schemas.TaskAttempt{a})
		if err != nil {
			t.Fatal(err)
		}
		ok, ev, err := v.Validate(task, &tr[0])
		if err != nil || ok || !strings.Contains(ev, `"reason":"`+tc.reason+`"`) {
			t.Fatalf("%s: %v %s %v", tc.name, ok, ev, err)
		}
	}
	tampered := good[0]
	tampered.Turns = append(slices.Clone(tampered.Turns), tampered.Turns[0])
	if _, _, err := v.Validate(task, &tampered); err == nil {
		t.Fatal("artifacts of another length judged")
	}
	tampered = good[0]
	tampered.Turns = slices.Clone(tampered.Turns)
	tampered.Turns[0].Decision = schemas.DecisionDenied
	if _, _, err := v.Validate(task, &tampered); err == nil {
		t.Fatal("artifacts with another decision judged")
	}
	rr, err := reward.NewRegistry(append(reward.Builtins(), v)...)
	if err != nil {
		t.Fatal(err)
	}
	r, err := reward.Score(ctx, &good[0], []reward.Component{{Name: rollout.EvalTextSuccess, Version: rollout.ValidatorVersion, Weight: 1}}, rr)
	if err != nil || r.RewardTotal != 1 {
		t.Fatalf("reward %+v %v", r, err)
	}
}
