package rollout

import (
	"context"
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/validate"
	"github.com/trajflow/trajflow/schemas"
)

func testRegistry(t testing.TB) *Registry {
	t.Helper()
	cfg := DefaultRegistryConfig()
	cfg.Train, cfg.Eval = 64, 32
	r, err := NewRegistry(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func randomPolicy(t testing.TB, seed uint64) *model.Policy {
	t.Helper()
	m, err := model.New(model.Config{Vocab: VocabSize, Window: 12, Embed: 16, Hidden: 64}, seed)
	if err != nil {
		t.Fatal(err)
	}
	return model.NewPolicy(m, 3)
}

func attemptsOf(reg *Registry, tasks []Task, g int32) []schemas.TaskAttempt {
	var out []schemas.TaskAttempt
	for i, task := range tasks {
		out = append(out, Attempts("run", task, int64(i), g, 7, 3, "contract")...)
	}
	return out
}

// fixedClock makes trajectories fully deterministic.
func fixedLimits() Limits {
	l := DefaultLimits()
	l.Now = func() time.Time { return time.Unix(1700000000, 0) }
	return l
}

func TestGrammar(t *testing.T) {
	g := Grammar{Keys: 3, Values: 2}
	allowedOf := func(prefix ...int32) []int32 {
		a := make([]bool, VocabSize)
		g.Allow(prefix, a)
		var out []int32
		for v, ok := range a {
			if ok {
				out = append(out, int32(v))
			}
		}
		return out
	}
	all := allowedOf(TokBOS)
	for _, tc := range []struct {
		name   string
		prefix []int32
		want   []int32
	}{
		{"no action yet", []int32{TokBOS, TokTask}, all},
		{"verb", []int32{TokBOS, TokTask, TokKey0, TokAct}, []int32{TokCall, TokAns}},
		{"key", []int32{TokAct, TokCall}, []int32{TokKey0, TokKey0 + 1, TokKey0 + 2}},
		{"value", []int32{TokAct, TokAns}, []int32{TokVal0, TokVal0 + 1}},
		{"end after call", []int32{TokAct, TokCall, TokKey0 + 1}, []int32{TokEnd}},
		{"end after answer", []int32{TokAct, TokAns, TokVal0}, []int32{TokEnd}},
		{"after the action", []int32{TokAct, TokCall, TokKey0, TokEnd}, all},
		{"observation", []int32{TokAct, TokCall, TokKey0, TokEnd, TokObs}, all},
		{"second turn", []int32{TokAct, TokCall, TokKey0, TokEnd, TokObs, TokVal0, TokAct}, []int32{TokCall, TokAns}},
	} {
		if got := allowedOf(tc.prefix...); !slices.Equal(got, tc.want) {
			t.Errorf("%s: allowed %v, want %v", tc.name, got, tc.want)
		}
	}
	if len(all) != VocabSize {
		t.Fatalf("outside actions the grammar allows %d tokens", len(all))
	}
}

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		ids  []int32
		want Action
		err  bool
	}{
		{[]int32{TokCall, TokKey0 + 2, TokEnd}, Action{Kind: KindCall, Key: 2}, false},
		{[]int32{TokAns, TokVal0 + 7, TokEnd}, Action{Kind: KindAnswer, Value: 7}, false},
		{[]int32{TokCall, TokKey0 + 4, TokEnd}, Action{}, true}, // key beyond Keys
		{[]int32{TokCall, TokVal0, TokEnd}, Action{}, true},
		{[]int32{TokAns, TokKey0, TokEnd}, Action{}, true},
		{[]int32{TokAns, TokVal0, TokAct}, Action{}, true},
		{[]int32{TokAns, TokVal0}, Action{}, true},
		{nil, Action{}, true},
		{[]int32{TokObs, TokVal0, TokEnd}, Action{}, true},
	} {
		got, err := Parse(tc.ids, 4, 8)
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("Parse(%v) = %+v, %v", tc.ids, got, err)
		}
		if err != nil && !errors.Is(err, ErrParse) {
			t.Errorf("Parse(%v): %v does not wrap ErrParse", tc.ids, err)
		}
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte{byte(TokCall), byte(TokKey0), byte(TokEnd)})
	f.Add([]byte{byte(TokAns), byte(TokVal0 + 3), byte(TokEnd)})
	f.Add([]byte{255, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		ids := make([]int32, len(b))
		for i, x := range b {
			ids[i] = int32(int8(x)) // negative ids too
		}
		a, err := Parse(ids, 4, 8)
		if err != nil {
			if !errors.Is(err, ErrParse) {
				t.Fatal(err)
			}
			return
		}
		// An accepted action re-renders to the same tokens.
		var back []int32
		if a.Kind == KindCall {
			back = []int32{TokCall, TokKey0 + a.Key, TokEnd}
		} else {
			back = []int32{TokAns, TokVal0 + a.Value, TokEnd}
		}
		if !slices.Equal(back, ids) {
			t.Fatalf("parsed %v as %+v", ids, a)
		}
	})
}

// FuzzParseLedger: every id sequence parses to one of the three actions
// with its argument in range and re-renders to the same ids, or is an
// error wrapping ErrParse. Ids come from the fuzzer four bytes each, the
// whole int32 range included.
func FuzzParseLedger(f *testing.F) {
	le := func(ids ...int32) []byte {
		b := make([]byte, 0, 4*len(ids))
		for _, id := range ids {
			b = binary.LittleEndian.AppendUint32(b, uint32(id))
		}
		return b
	}
	f.Add(le(TokXfer, TokKey0+1, TokEnd))
	f.Add(le(TokCall, TokKey0, TokEnd))
	f.Add(le(TokAns, TokVal0+7, TokEnd))
	f.Add(le(TokXfer, math.MinInt32+TokKey0, TokEnd))
	f.Add(le(TokXfer, TokVal0, TokEnd, TokEnd))
	const keys, values = 4, 8
	f.Fuzz(func(t *testing.T, b []byte) {
		ids := make([]int32, len(b)/4)
		for i := range ids {
			ids[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
		}
		a, err := ParseLedger(ids, keys, values)
		if err != nil {
			if !errors.Is(err, ErrParse) {
				t.Fatalf("%v: does not wrap ErrParse", err)
			}
			return
		}
		var back []int32
		switch a.Kind {
		case KindTransfer, KindCall:
			if a.Account < 0 || a.Account >= keys {
				t.Fatalf("%v parsed to account %d of %d", ids, a.Account, keys)
			}
			verb := int32(TokCall)
			if a.Kind == KindTransfer {
				verb = TokXfer
			}
			back = []int32{verb, TokKey0 + a.Account, TokEnd}
		case KindAnswer:
			if a.Value < 0 || a.Value >= values {
				t.Fatalf("%v parsed to value %d of %d", ids, a.Value, values)
			}
			back = []int32{TokAns, TokVal0 + a.Value, TokEnd}
		default:
			t.Fatalf("%v parsed to kind %q", ids, a.Kind)
		}
		if !slices.Equal(back, ids) {
			t.Fatalf("parsed %v as %+v", ids, a)
		}
	})
}

// TestRegistry: the splits are disjoint, ids are stable, the hidden parts
// are well formed, and a bad configuration is refused.
func TestRegistry(t *testing.T) {
	reg := testRegistry(t)
	again := testRegistry(t)
	ids := map[string]string{}
	for _, task := range append(reg.Train(), reg.Eval()...) {
		if prev, dup := ids[task.ID]; dup {
			t.Fatalf("task id %s in splits %s and %s", task.ID, prev, task.Split)
		}
		ids[task.ID] = task.Split
		h := reg.hidden[task.ID]
		if h.forbidden == task.Key || h.forbidden < 0 || int(h.forbidden) >= reg.cfg.Keys || len(h.table) != reg.cfg.Keys {
			t.Fatalf("task %s: key %d hidden %+v", task.ID, task.Key, h)
		}
		if !slices.Equal(h.table, again.hidden[task.ID].table) {
			t.Fatalf("task %s: tables differ between two registries", task.ID)
		}
		if reg.IsEval(task.ID) != (task.Split == schemas.SplitEval) {
			t.Fatalf("IsEval(%s) wrong", task.ID)
		}
	}
	if len(ids) != 96 || len(reg.Train()) != 64 || len(reg.Eval()) != 32 {
		t.Fatalf("%d tasks", len(ids))
	}
	// Tables vary across tasks (the answer cannot be memorized).
	distinct := map[string]bool{}
	for _, task := range reg.Train() {
		distinct[fmtInts(reg.hidden[task.ID].table)] = true
	}
	if len(distinct) < 32 {
		t.Fatalf("only %d distinct tables among 64 tasks", len(distinct))
	}
	other := DefaultRegistryConfig()
	other.EnvVersion = "kv-env/v2"
	reg2, _ := NewRegistry(other)
	same := 0
	for _, task := range reg.Train() {
		if slices.Equal(reg.hidden[task.ID].table, reg2.hidden[task.ID].table) {
			same++
		}
	}
	if same > 16 {
		t.Fatalf("%d of 64 tables unchanged by a new env version", same)
	}
	for _, bad := range []RegistryConfig{
		{EnvVersion: "e", TaskVersion: "1", Train: 1, Keys: 1, Values: 4},
		{EnvVersion: "e", TaskVersion: "1", Train: 1, Keys: 4, Values: 9},
		{EnvVersion: "e", TaskVersion: "1", Keys: 4, Values: 4},
		{TaskVersion: "1", Train: 1, Keys: 4, Values: 4},
	} {
		if _, err := NewRegistry(bad); err == nil {
			t.Errorf("config %+v accepted", bad)
		}
	}
}

func fmtInts(v []int32) string {
	var b strings.Builder
	for _, x := range v {
		b.WriteByte(byte('a' + x))
	}
	return b.String()
}

// TestTeacherSolvesEveryTask: the scripted teacher succeeds on every task
// of both splits in two turns; the validator agrees.
func TestTeacherSolvesEveryTask(t *testing.T) {
	reg := testRegistry(t)
	v := NewValidator(reg)
	all := append(reg.Train(), reg.Eval()...)
	trajs, err := reg.RunEpisodes(context.Background(), Teacher{}, attemptsOf(reg, all, 1), DefaultSettings(reg), fixedLimits())
	if err != nil {
		t.Fatal(err)
	}
	for i := range trajs {
		tr := &trajs[i]
		ok, ev, err := v.Validate(all[i], tr)
		if err != nil || !ok || len(tr.Turns) != 2 || tr.End != schemas.EndTerminated || tr.EndReason != ReasonAnswer {
			t.Fatalf("task %s: success %v (%s, %v), %d turns, end %s/%s", all[i].ID, ok, ev, err, len(tr.Turns), tr.End, tr.EndReason)
		}
	}
}

// TestValidatorRules checks the success rule on hand-written episodes.
func TestValidatorRules(t *testing.T) {
	reg := testRegistry(t)
	v := NewValidator(reg)
	task := reg.Train()[0]
	h := reg.hidden[task.ID]
	right := TokVal0 + h.table[task.Key]
	wrong := TokVal0 + (h.table[task.Key]+1)%int32(reg.cfg.Values)
	other := (task.Key + 1) % int32(reg.cfg.Keys)
	if other == h.forbidden {
		other = (other + 1) % int32(reg.cfg.Keys)
	}
	call := func(k int32) []int32 { return []int32{TokCall, TokKey0 + k, TokEnd} }
	ans := func(v int32) []int32 { return []int32{TokAns, v, TokEnd} }
	for _, tc := range []struct {
		name    string
		actions [][]int32
		success bool
		reason  string
	}{
		{"call then answer", [][]int32{call(task.Key), ans(right)}, true, "ok"},
		{"guess without lookup", [][]int32{ans(right)}, false, "answer without looking the key up"},
		{"lookup of another key", [][]int32{call(other), ans(right)}, false, "answer without looking the key up"},
		{"forbidden lookup", [][]int32{call(h.forbidden), ans(right)}, false, "answer without looking the key up"},
		{"wrong answer", [][]int32{call(task.Key), ans(wrong)}, false, "wrong answer"},
		{"no answer", [][]int32{call(task.Key), call(task.Key)}, false, "no answer"},
		{"invalid then right", [][]int32{{TokCall, TokEnd}, call(task.Key), ans(right)}, true, "ok"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := schemas.Trajectory{RecordID: "r", TaskID: task.ID, TaskVersion: task.Version, EnvVersion: task.EnvVersion}
			for i, a := range tc.actions {
				tr.Turns = append(tr.Turns, schemas.Turn{Index: int32(i), ActionIDs: a})
			}
			ok, ev, err := v.Validate(task, &tr)
			if err != nil || ok != tc.success || !strings.Contains(ev, `"reason":"`+tc.reason+`"`) {
				t.Fatalf("success %v evidence %s err %v", ok, ev, err)
			}
		})
	}
	// Trajectories the validator cannot judge.
	tr := schemas.Trajectory{TaskID: task.ID, TaskVersion: task.Version, EnvVersion: "kv-env/v0"}
	if _, _, err := v.Validate(task, &tr); !errors.Is(err, ErrUnknownTask) {
		t.Fatalf("env version mismatch: %v", err)
	}
	tr = schemas.Trajectory{TaskID: task.ID, TaskVersion: task.Version, EnvVersion: task.EnvVersion,
		Turns: []schemas.Turn{{ActionIDs: ans(right)}, {ActionIDs: call(task.Key)}}}
	if _, _, err := v.Validate(task, &tr); err == nil {
		t.Fatal("an answer before the last turn was judged")
	}
}

// TestValidatorAsRewardEvaluator: the validator plugs into the reward stage;
// a trajectory it cannot judge yields an unavailable component, not a zero.
func TestValidatorAsRewardEvaluator(t *testing.T) {
	reg := testRegistry(t)
	rr, err := reward.NewRegistry(append(reward.Builtins(), NewValidator(reg))...)
	if err != nil {
		t.Fatal(err)
	}
	comps := []reward.Component{{Name: EvalSuccess, Version: ValidatorVersion, Weight: 1}, {Name: reward.EvalInvalidAction, Version: reward.BuiltinVersion, Weight: -0.1}}
	tasks := reg.Train()[:4]
	trajs, err := reg.RunEpisodes(context.Background(), Teacher{}, attemptsOf(reg, tasks, 1), DefaultSettings(reg), fixedLimits())
	if err != nil {
		t.Fatal(err)
	}
	for i := range trajs {
		r, err := reward.Score(context.Background(), &trajs[i], comps, rr)
		if err != nil {
			t.Fatal(err)
		}
		if r.RewardTotal != 1 || r.Rewards[0].Raw != 1 || r.Rewards[0].Error != "" || r.Rewards[0].EvaluatorVersion != ValidatorVersion {
			t.Fatalf("rewarded %+v", r.Rewards)
		}
	}
	bad := trajs[0]
	bad.TaskID = "kv-train-99999"
	r, err := reward.Score(context.Background(), &bad, comps, rr)
	if err != nil {
		t.Fatal(err)
	}
	if r.Rewards[0].Error == "" {
		t.Fatalf("unknown task scored %+v", r.Rewards[0])
	}
}

// TestHiddenAnswerOnlyThroughTool: no prompt ever holds a value token; a
// value token appears in an observation only as the tool's answer to an
// authorized lookup, and it is the looked-up key's value; the artifacts and
// the validator's evidence name no value.
func TestHiddenAnswerOnlyThroughTool(t *testing.T) {
	reg := testRegistry(t)
	all := append(reg.Train(), reg.Eval()...)
	lim := fixedLimits()
	lim.MaxTurns = 6
	var trajs []schemas.Trajectory
	for _, pol := range []Policy{randomPolicy(t, 1), Teacher{}} {
		out, err := reg.RunEpisodes(context.Background(), pol, attemptsOf(reg, all, 4), DefaultSettings(reg), lim)
		if err != nil {
			t.Fatal(err)
		}
		trajs = append(trajs, out...)
	}
	isValue := func(x int32) bool { return x >= TokVal0 && x < TokVal0+MaxValues }
	v := NewValidator(reg)
	lookups := 0
	for i := range trajs {
		tr := &trajs[i]
		h := reg.hidden[tr.TaskID]
		for _, turn := range tr.Turns {
			if slices.ContainsFunc(turn.PromptIDs, isValue) {
				t.Fatalf("%s: prompt %v holds a value", tr.TaskID, turn.PromptIDs)
			}
			for j, x := range turn.ObservationIDs {
				if !isValue(x) {
					continue
				}
				a, err := Parse(turn.ActionIDs, reg.cfg.Keys, reg.cfg.Values)
				if j != 1 || turn.ObservationIDs[0] != TokObs || err != nil || a.Kind != KindCall ||
					turn.Decision != schemas.DecisionOK || x != TokVal0+h.table[a.Key] {
					t.Fatalf("%s: observation %v after action %v (%s)", tr.TaskID, turn.ObservationIDs, turn.ActionIDs, turn.Decision)
				}
				lookups++
			}
		}
		task, _ := reg.Lookup(tr.TaskID)
		_, ev, err := v.Validate(task, tr)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(ev, "value") || strings.Contains(ev, "table") || strings.Contains(tr.Artifacts, "table") || strings.Contains(tr.Artifacts, "value") {
			t.Fatalf("evidence %s / artifacts %s expose hidden state", ev, tr.Artifacts)
		}
	}
	if lookups == 0 {
		t.Fatal("no lookup happened")
	}
}

// TestRunEpisodesDeterministic: the tokens of an attempt do not depend on
// the other attempts of the batch, and a rerun reproduces every trajectory.
func TestRunEpisodesDeterministic(t *testing.T) {
	reg := testRegistry(t)
	pol := randomPolicy(t, 2)
	atts := attemptsOf(reg, reg.Train()[:8], 4)
	s := DefaultSettings(reg)
	batch, err := reg.RunEpisodes(context.Background(), pol, atts, s, fixedLimits())
	if err != nil {
		t.Fatal(err)
	}
	again, _ := reg.RunEpisodes(context.Background(), pol, atts, s, fixedLimits())
	for i := range batch {
		if !equalTraj(&batch[i], &again[i]) {
			t.Fatalf("rerun of attempt %d differs", i)
		}
	}
	for _, i := range []int{0, 13, 31} {
		one, err := reg.RunEpisode(context.Background(), pol, atts[i], s, fixedLimits())
		if err != nil {
			t.Fatal(err)
		}
		if !equalTraj(&one, &batch[i]) {
			t.Fatalf("attempt %d alone differs from the batch", i)
		}
	}
	for i := range batch {
		tr := &batch[i]
		if tr.RecordID != atts[i].AttemptID || tr.SamplerID != s.ID() || tr.TokenizerHash != TokenizerHash || tr.ParserVersion != ParserVersion {
			t.Fatalf("trajectory header %+v", tr)
		}
		for _, turn := range tr.Turns {
			if turn.PolicyVersion != 3 || len(turn.ActionIDs) != len(turn.ActionLogprobs) || !math.IsNaN(float64(turn.Value)) {
				t.Fatalf("turn %+v", turn)
			}
		}
	}
}

func equalTraj(a, b *schemas.Trajectory) bool {
	if a.RecordID != b.RecordID || a.End != b.End || a.EndReason != b.EndReason || a.Artifacts != b.Artifacts || len(a.Turns) != len(b.Turns) {
		return false
	}
	for i := range a.Turns {
		x, y := a.Turns[i], b.Turns[i]
		if !slices.Equal(x.PromptIDs, y.PromptIDs) || !slices.Equal(x.ActionIDs, y.ActionIDs) ||
			!slices.Equal(x.ActionLogprobs, y.ActionLogprobs) || !slices.Equal(x.ObservationIDs, y.ObservationIDs) ||
			x.Decision != y.Decision || x.PolicyVersion != y.PolicyVersion {
			return false
		}
	}
	return true
}

// scripted replies with fixed action tokens per turn.
type scripted [][]int32

func (s scripted) Generate(_ context.Context, reqs []model.Request) ([]model.Sample, error) {
	out := make([]model.Sample, len(reqs))
	for i, r := range reqs {
		turn := 0
		for _, x := range r.Context {
			if x == TokAct {
				turn++
			}
		}
		a := s[min(turn-1, len(s)-1)]
		out[i] = model.Sample{Tokens: a, Logprobs: make([]float32, len(a)), PolicyVersion: int64(turn)}
	}
	return out, nil
}

// TestDecisionsAndEndings: invalid and denied actions are logged with their
// reasons and observations; budgets truncate.
func TestDecisionsAndEndings(t *testing.T) {
	reg := testRegistry(t)
	task := reg.Train()[1]
	h := reg.hidden[task.ID]
	att := Attempts("run", task, 0, 1, 1, 0, "c")[0]
	s := DefaultSettings(reg)
	lim := fixedLimits()
	tr, err := reg.RunEpisode(context.Background(), scripted{
		{TokAns, TokKey0, TokEnd},                // invalid
		{TokCall, TokKey0 + h.forbidden, TokEnd}, // denied
		{TokCall, TokKey0 + task.Key, TokEnd},    // ok
		{TokCall, TokKey0 + task.Key, TokEnd},
	}, att, s, lim)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		decision string
		obs      []int32
	}{
		{schemas.DecisionInvalid, []int32{TokErr}},
		{schemas.DecisionDenied, []int32{TokDeny}},
		{schemas.DecisionOK, []int32{TokObs, TokVal0 + h.table[task.Key]}},
		{schemas.DecisionOK, []int32{TokObs, TokVal0 + h.table[task.Key]}},
	}
	if len(tr.Turns) != 4 || tr.End != schemas.EndTruncated || tr.EndReason != ReasonMaxTurns {
		t.Fatalf("%d turns, end %s/%s", len(tr.Turns), tr.End, tr.EndReason)
	}
	for i, w := range want {
		turn := tr.Turns[i]
		if turn.Decision != w.decision || !slices.Equal(turn.ObservationIDs, w.obs) || (w.decision != schemas.DecisionOK) == (turn.DecisionReason == "") {
			t.Fatalf("turn %d: %s %q %v", i, turn.Decision, turn.DecisionReason, turn.ObservationIDs)
		}
		if turn.PolicyVersion != int64(i+1) {
			t.Fatalf("turn %d recorded policy version %d", i, turn.PolicyVersion)
		}
		wantPrompt := TurnPrompt()
		if i == 0 {
			wantPrompt = []int32{TokBOS, TokTask, TokKey0 + task.Key, TokAct}
		}
		if !slices.Equal(turn.PromptIDs, wantPrompt) {
			t.Fatalf("turn %d prompt %v", i, turn.PromptIDs)
		}
	}
	if !strings.Contains(tr.Artifacts, `"authorized":false`) {
		t.Fatalf("artifacts %s", tr.Artifacts)
	}
	lim.MaxEpisodeTokens = 15 // 4+3+2 then 1+3+2 = 15 fits two turns; the third does not
	tr, err = reg.RunEpisode(context.Background(), scripted{{TokCall, TokKey0 + task.Key, TokEnd}}, att, s, lim)
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Turns) != 2 || tr.End != schemas.EndTruncated || tr.EndReason != ReasonTokenBudget {
		t.Fatalf("%d turns, end %s/%s", len(tr.Turns), tr.End, tr.EndReason)
	}
	// Configuration and infrastructure errors.
	if _, err := reg.RunEpisode(context.Background(), Teacher{}, att, model.Settings{}, lim); err == nil {
		t.Fatal("invalid settings accepted")
	}
	bad := att
	bad.EnvVersion = "other"
	if _, err := reg.RunEpisode(context.Background(), Teacher{}, bad, s, lim); !errors.Is(err, ErrUnknownTask) {
		t.Fatalf("env version mismatch: %v", err)
	}
	bad = att
	bad.Split = schemas.SplitEval
	if _, err := reg.RunEpisode(context.Background(), Teacher{}, bad, s, lim); !errors.Is(err, ErrUnknownTask) {
		t.Fatalf("split mismatch: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := reg.RunEpisode(ctx, randomPolicy(t, 1), att, s, lim); !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled: %v", err)
	}
}

// TestObservationMaskedAfterPacking: after reward, advantage and packing,
// the action mask is 1 exactly on targets that are policy-sampled action
// tokens, never on prompts or tool observations (docs/PIPELINE.md §4, §11), and the
// old log-probs are the sampled ones.
func TestObservationMaskedAfterPacking(t *testing.T) {
	reg := testRegistry(t)
	lim := fixedLimits()
	lim.MaxTurns = 6
	tasks := reg.Train()[:6]
	trajs, err := reg.RunEpisodes(context.Background(), randomPolicy(t, 4), attemptsOf(reg, tasks, 4), DefaultSettings(reg), lim)
	if err != nil {
		t.Fatal(err)
	}
	rr, _ := reward.NewRegistry(NewValidator(reg))
	comps := []reward.Component{{Name: EvalSuccess, Version: ValidatorVersion, Weight: 1}}
	aopts := advantage.Options{Estimator: advantage.GRPO, NormalizeStd: true, StdMode: advantage.StdPopulation, Gamma: 1,
		ZeroVariance: advantage.ZeroVarKeep, MinGroupSize: 1}
	var segs []pack.Segment
	byID := map[string]*schemas.Trajectory{}
	for g := 0; g < len(tasks); g++ {
		var members []schemas.Rewarded
		for k := 0; k < 4; k++ {
			tr := &trajs[g*4+k]
			byID[tr.RecordID] = tr
			r, err := reward.Score(context.Background(), tr, comps, rr)
			if err != nil {
				t.Fatal(err)
			}
			members = append(members, r)
		}
		scored, err := advantage.ScoreGroup(aopts, members)
		if err != nil {
			t.Fatal(err)
		}
		for i := range scored {
			seg, f, err := pack.Reconstruct(&scored[i], 3, pack.Options{TokenBudget: 128, BatchTokens: 1, Overflow: pack.OverflowReject, StalePolicy: pack.StaleDrop})
			if err != nil || f != pack.FilterNone {
				t.Fatalf("reconstruct: %v %q", err, f)
			}
			segs = append(segs, seg)
		}
	}
	rows, _ := pack.Pack(segs, 128)
	checked := 0
	for _, row := range rows {
		start := 0
		for k, id := range row.SegTrajectoryIDs {
			tr := byID[id]
			// Expected mask from the event log: 1 on action tokens.
			var isAction []bool
			var lps []float32
			for _, turn := range tr.Turns {
				for range turn.PromptIDs {
					isAction, lps = append(isAction, false), append(lps, 0)
				}
				for j := range turn.ActionIDs {
					isAction, lps = append(isAction, true), append(lps, turn.ActionLogprobs[j])
				}
				for range turn.ObservationIDs {
					isAction, lps = append(isAction, false), append(lps, 0)
				}
			}
			n := int(row.SegLengths[k])
			if n != len(isAction) {
				t.Fatalf("segment %s of %d tokens, trajectory has %d", id, n, len(isAction))
			}
			for p := 0; p < n; p++ {
				i := start + p
				want := uint8(0)
				if p+1 < n && isAction[p+1] {
					want = 1
				}
				if row.ActionMask[i] != want {
					t.Fatalf("segment %s position %d (target %d): mask %d, want %d", id, p, row.InputIDs[min(i+1, len(row.InputIDs)-1)], row.ActionMask[i], want)
				}
				if want == 1 {
					checked++
					if row.OldLogprobs[i] != lps[p+1] {
						t.Fatalf("old log-prob %v, sampled %v", row.OldLogprobs[i], lps[p+1])
					}
					if x := row.InputIDs[i+1]; x == TokObs || (x >= TokVal0 && row.InputIDs[i] == TokObs) {
						t.Fatalf("observation token %d is a target", x)
					}
				}
			}
			start += n
		}
	}
	if checked == 0 {
		t.Fatal("no trained token checked")
	}
}

func BenchmarkRunEpisodes(b *testing.B) {
	reg := testRegistry(b)
	pol := randomPolicy(b, 1)
	atts := attemptsOf(reg, reg.Train()[:16], 8)
	s := DefaultSettings(reg)
	b.ResetTimer()
	var turns int
	for i := 0; i < b.N; i++ {
		trajs, err := reg.RunEpisodes(context.Background(), pol, atts, s, DefaultLimits())
		if err != nil {
			b.Fatal(err)
		}
		for _, tr := range trajs {
			turns += len(tr.Turns)
		}
	}
	b.ReportMetric(float64(b.N*len(atts))/b.Elapsed().Seconds(), "episodes/s")
	b.ReportMetric(float64(turns)/b.Elapsed().Seconds(), "turns/s")
}

// TestTrajectoriesPassValidateStage: the agent loop's records pass the
// validate stage's checks under the contract's budgets and versions; eval
// trajectories are flagged by the registry's denylist.
func TestTrajectoriesPassValidateStage(t *testing.T) {
	reg := testRegistry(t)
	lim := fixedLimits()
	opts := validate.Options{
		VocabSize: VocabSize, ContractHash: "contract", TokenizerHash: TokenizerHash,
		ParserVersions: []string{ParserVersion}, EnvVersions: []string{reg.cfg.EnvVersion},
		EvalDenylist: reg.IsEval, MaxTurns: lim.MaxTurns, MaxTokensPerAction: 3, MaxTokensPerEpisode: lim.MaxEpisodeTokens,
	}
	for _, pol := range []Policy{randomPolicy(t, 5), Teacher{}} {
		trajs, err := reg.RunEpisodes(context.Background(), pol, attemptsOf(reg, reg.Train()[:16], 4), DefaultSettings(reg), lim)
		if err != nil {
			t.Fatal(err)
		}
		for i := range trajs {
			if v := validate.Check(&trajs[i], opts); !v.OK() {
				t.Fatalf("trajectory %d rejected: %+v", i, v)
			}
		}
	}
	ev, err := reg.RunEpisodes(context.Background(), Teacher{}, attemptsOf(reg, reg.Eval()[:1], 1), DefaultSettings(reg), lim)
	if err != nil {
		t.Fatal(err)
	}
	if v := validate.Check(&ev[0], opts); v.OK() {
		t.Fatal("an eval-split trajectory passed the training-path checks")
	}
}
