package validate

import (
	"math"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/schemas"
)

const testVocab = 1000

// validTrajectory returns a three-turn trajectory that passes Check under
// testOptions. Every call returns fresh slices, so cases may mutate freely.
func validTrajectory() *schemas.Trajectory {
	run, task := "run-1", "task-7"
	group := schemas.GroupID(run, task, 0)
	id := schemas.AttemptID(run, task, group, 1, 0)
	return &schemas.Trajectory{
		RecordID: id, RunID: run, TaskID: task, TaskVersion: "v1", Domain: "tools",
		Split: schemas.SplitTrain, EnvVersion: "env-3", GroupID: group, GroupSize: 4, Member: 1,
		Attempt: 0, Seed: 42, ContractHash: "c0ffee", SamplerID: "s1", ParserVersion: "p2",
		TokenizerHash: "tok9", Status: schemas.StatusCompleted, End: schemas.EndTerminated,
		EndReason: "answer", BootstrapValue: float32(math.NaN()), StartedAt: 100, FinishedAt: 200,
		Turns: []schemas.Turn{
			{Index: 0, PromptIDs: []int32{1, 2, 3}, ActionIDs: []int32{10, 11}, ActionLogprobs: []float32{-0.5, -1.25},
				PolicyVersion: 3, Decision: schemas.DecisionOK, ObservationIDs: []int32{20, 21}, Value: float32(math.NaN())},
			{Index: 1, PromptIDs: []int32{4}, ActionIDs: []int32{12, 13, 14}, ActionLogprobs: []float32{-0.1, 0, -2},
				PolicyVersion: 3, Decision: schemas.DecisionInvalid, DecisionReason: "parse", ObservationIDs: []int32{22}, Value: float32(math.NaN())},
			{Index: 2, PromptIDs: []int32{5}, ActionIDs: []int32{999}, ActionLogprobs: []float32{-3},
				PolicyVersion: 4, Decision: schemas.DecisionDenied, Value: float32(math.NaN())},
		},
	}
}

func testOptions() Options {
	return Options{
		VocabSize: testVocab, ContractHash: "c0ffee", TokenizerHash: "tok9",
		ParserVersions: []string{"p1", "p2"}, EnvVersions: []string{"env-3"},
		EvalDenylist: DenySet("eval-1", "eval-2"),
		MaxTurns:     3, MaxTokensPerAction: 3, MaxTokensPerEpisode: 20,
		BootstrapReasons:   []string{"max_turns"},
		IncidentEndReasons: []string{"sandbox_escape"},
	}
}

type checkCase struct {
	name   string
	mutate func(t *schemas.Trajectory, o *Options)
	reason string // "" = valid
	detail string // substring the detail must contain
}

var checkCases = []checkCase{
	{"valid", func(*schemas.Trajectory, *Options) {}, "", ""},
	{"valid failed status", func(t *schemas.Trajectory, _ *Options) { t.Status = schemas.StatusFailed }, "", ""},
	{"valid zero options", func(_ *schemas.Trajectory, o *Options) { *o = Options{} }, "", ""},
	{"valid timeout declared truncation", func(t *schemas.Trajectory, o *Options) {
		t.Status, t.End, t.EndReason, o.TimeoutIsTruncation = schemas.StatusTimedOut, schemas.EndTruncated, "timeout", true
	}, "", ""},
	{"valid truncation without bootstrap", func(t *schemas.Trajectory, _ *Options) {
		t.End, t.EndReason = schemas.EndTruncated, "token_budget" // not a bootstrap reason: NaN is fine
	}, "", ""},
	{"valid bootstrap", func(t *schemas.Trajectory, _ *Options) {
		t.End, t.EndReason, t.BootstrapValue = schemas.EndTruncated, "max_turns", 0.25
	}, "", ""},
	{"valid logprob within tolerance", func(t *schemas.Trajectory, o *Options) {
		t.Turns[0].ActionLogprobs[0], o.LogprobTolerance = 1e-7, 1e-6
	}, "", ""},
	{"valid empty observation", func(t *schemas.Trajectory, _ *Options) { t.Turns[1].ObservationIDs = nil }, "", ""},

	{"eval split", func(t *schemas.Trajectory, _ *Options) { t.Split = schemas.SplitEval }, ReasonEvalTaskID, `split "eval"`},
	{"eval denylist", func(t *schemas.Trajectory, _ *Options) { t.TaskID = "eval-2" }, ReasonEvalTaskID, "denylist"},
	{"eval beats infra", func(t *schemas.Trajectory, _ *Options) {
		t.TaskID, t.Status, t.Turns = "eval-1", schemas.StatusInfra, nil
	}, ReasonEvalTaskID, "eval-1"},
	{"safety incident", func(t *schemas.Trajectory, _ *Options) {
		t.End, t.EndReason = schemas.EndTruncated, "sandbox_escape"
	}, ReasonSafetyIncident, "sandbox_escape"},

	{"missing record id", func(t *schemas.Trajectory, _ *Options) { t.RecordID = "" }, ReasonMissingID, "record_id"},
	{"missing run id", func(t *schemas.Trajectory, _ *Options) { t.RunID = "" }, ReasonMissingID, "run_id"},
	{"missing task id", func(t *schemas.Trajectory, _ *Options) { t.TaskID = "" }, ReasonMissingID, "task_id"},
	{"missing group id", func(t *schemas.Trajectory, _ *Options) { t.GroupID = "" }, ReasonMissingID, "group_id"},
	{"group size zero", func(t *schemas.Trajectory, _ *Options) { t.GroupSize = 0 }, ReasonGroupMember, "group size 0"},
	{"member outside group", func(t *schemas.Trajectory, _ *Options) { t.Member = 4 }, ReasonGroupMember, "member 4"},
	{"negative member", func(t *schemas.Trajectory, _ *Options) { t.Member = -1 }, ReasonGroupMember, "member -1"},
	{"negative attempt", func(t *schemas.Trajectory, _ *Options) { t.Attempt = -1 }, ReasonGroupMember, "attempt -1"},

	{"status infra", func(t *schemas.Trajectory, _ *Options) { t.Status = schemas.StatusInfra }, ReasonInfraFailure, "infrastructure"},
	{"status timed out", func(t *schemas.Trajectory, _ *Options) {
		t.Status, t.End, t.EndReason = schemas.StatusTimedOut, schemas.EndTruncated, "timeout"
	}, ReasonTimedOut, "timed out"},
	{"status unknown", func(t *schemas.Trajectory, _ *Options) { t.Status = "done" }, ReasonUnknownStatus, `"done"`},
	{"status empty", func(t *schemas.Trajectory, _ *Options) { t.Status = "" }, ReasonUnknownStatus, `""`},

	{"contract hash", func(t *schemas.Trajectory, _ *Options) { t.ContractHash = "other" }, ReasonVersionMismatch, "contract hash"},
	{"tokenizer hash", func(t *schemas.Trajectory, _ *Options) { t.TokenizerHash = "tok8" }, ReasonVersionMismatch, "tokenizer"},
	{"parser version", func(t *schemas.Trajectory, _ *Options) { t.ParserVersion = "p3" }, ReasonVersionMismatch, "parser"},
	{"env version", func(t *schemas.Trajectory, _ *Options) { t.EnvVersion = "env-2" }, ReasonVersionMismatch, "environment"},
	{"timestamps", func(t *schemas.Trajectory, _ *Options) { t.FinishedAt = 99 }, ReasonTimestampOrder, "99"},

	{"no turns", func(t *schemas.Trajectory, _ *Options) { t.Turns = nil }, ReasonNoTurns, "no turns"},
	{"duplicate turn", func(t *schemas.Trajectory, _ *Options) { t.Turns[2].Index = 1 }, ReasonDuplicateTurn, "turn index 1 at positions 1 and 2"},
	{"duplicate before order", func(t *schemas.Trajectory, _ *Options) { t.Turns[0].Index, t.Turns[1].Index = 2, 2 }, ReasonDuplicateTurn, "turn index 2"},
	{"turn order swapped", func(t *schemas.Trajectory, _ *Options) { t.Turns[1].Index, t.Turns[2].Index = 2, 1 }, ReasonTurnOrder, "position 1 holds turn index 2"},
	{"turn order gap", func(t *schemas.Trajectory, _ *Options) { t.Turns[2].Index = 3 }, ReasonTurnOrder, "position 2"},
	{"turns start at one", func(t *schemas.Trajectory, _ *Options) {
		t.Turns[0].Index, t.Turns[1].Index, t.Turns[2].Index = 1, 2, 3
	}, ReasonTurnOrder, "position 0"},

	{"empty prompt", func(t *schemas.Trajectory, _ *Options) { t.Turns[0].PromptIDs = nil }, ReasonEmptyPrompt, "turn 0"},
	{"empty action", func(t *schemas.Trajectory, _ *Options) {
		t.Turns[1].ActionIDs, t.Turns[1].ActionLogprobs = nil, nil
	}, ReasonEmptyAction, "turn 1"},
	{"logprob short", func(t *schemas.Trajectory, _ *Options) {
		t.Turns[1].ActionLogprobs = t.Turns[1].ActionLogprobs[:2]
	}, ReasonLogprobLengthMismatch, "turn 1: 3 action ids, 2 log-probs"},
	{"logprob long", func(t *schemas.Trajectory, _ *Options) {
		t.Turns[2].ActionLogprobs = append(t.Turns[2].ActionLogprobs, -1)
	}, ReasonLogprobLengthMismatch, "turn 2: 1 action ids, 2 log-probs"},
	{"logprob nan", func(t *schemas.Trajectory, _ *Options) { t.Turns[1].ActionLogprobs[2] = float32(math.NaN()) }, ReasonNonFiniteLogprob, "turn 1: log-prob 2 is NaN"},
	{"logprob -inf", func(t *schemas.Trajectory, _ *Options) { t.Turns[0].ActionLogprobs[1] = float32(math.Inf(-1)) }, ReasonNonFiniteLogprob, "-Inf"},
	{"logprob +inf", func(t *schemas.Trajectory, _ *Options) { t.Turns[0].ActionLogprobs[1] = float32(math.Inf(1)) }, ReasonNonFiniteLogprob, "+Inf"},
	{"logprob positive", func(t *schemas.Trajectory, _ *Options) { t.Turns[2].ActionLogprobs[0] = 0.5 }, ReasonPositiveLogprob, "turn 2: log-prob 0 is 0.5"},
	{"logprob tiny positive strict", func(t *schemas.Trajectory, _ *Options) { t.Turns[0].ActionLogprobs[0] = 1e-7 }, ReasonPositiveLogprob, "turn 0"},

	{"prompt id negative", func(t *schemas.Trajectory, _ *Options) { t.Turns[0].PromptIDs[1] = -1 }, ReasonTokenIDRange, "turn 0: prompt token 1 is id -1"},
	{"action id at vocab", func(t *schemas.Trajectory, _ *Options) { t.Turns[2].ActionIDs[0] = testVocab }, ReasonTokenIDRange, "turn 2: action token 0 is id 1000"},
	{"observation id over vocab", func(t *schemas.Trajectory, _ *Options) { t.Turns[1].ObservationIDs[0] = 5000 }, ReasonTokenIDRange, "observation"},
	{"negative id without vocab", func(t *schemas.Trajectory, o *Options) {
		o.VocabSize = 0
		t.Turns[1].ActionIDs[0] = -7
	}, ReasonTokenIDRange, "id -7"},

	{"policy version decreasing", func(t *schemas.Trajectory, _ *Options) { t.Turns[2].PolicyVersion = 2 }, ReasonPolicyVersionOrder, "turn 2: policy version 2 after 3"},
	{"policy version negative", func(t *schemas.Trajectory, _ *Options) { t.Turns[0].PolicyVersion = -1 }, ReasonPolicyVersionOrder, "negative"},
	{"decision unknown", func(t *schemas.Trajectory, _ *Options) { t.Turns[1].Decision = "maybe" }, ReasonUnknownDecision, `turn 1: decision "maybe"`},
	{"decision empty", func(t *schemas.Trajectory, _ *Options) { t.Turns[0].Decision = "" }, ReasonUnknownDecision, "turn 0"},
	{"critic value inf", func(t *schemas.Trajectory, _ *Options) { t.Turns[1].Value = float32(math.Inf(1)) }, ReasonNonFiniteValue, "turn 1"},

	{"end empty", func(t *schemas.Trajectory, _ *Options) { t.End = "" }, ReasonEndState, "neither"},
	{"end unknown", func(t *schemas.Trajectory, _ *Options) { t.End = "stopped" }, ReasonEndState, `"stopped"`},
	{"truncated without reason", func(t *schemas.Trajectory, _ *Options) { t.End, t.EndReason = schemas.EndTruncated, "" }, ReasonEndState, "without an end reason"},
	{"timeout terminated", func(t *schemas.Trajectory, o *Options) {
		t.Status, o.TimeoutIsTruncation = schemas.StatusTimedOut, true
	}, ReasonEndState, "timeout is a truncation"},
	{"bootstrap nan", func(t *schemas.Trajectory, _ *Options) { t.End, t.EndReason = schemas.EndTruncated, "max_turns" }, ReasonNonFiniteBootstrap, "max_turns"},
	{"bootstrap inf", func(t *schemas.Trajectory, _ *Options) {
		t.End, t.EndReason, t.BootstrapValue = schemas.EndTruncated, "max_turns", float32(math.Inf(-1))
	}, ReasonNonFiniteBootstrap, "-Inf"},

	{"over turns", func(t *schemas.Trajectory, o *Options) { o.MaxTurns = 2 }, ReasonOverBudget, "3 turns, budget 2"},
	{"over action tokens", func(t *schemas.Trajectory, o *Options) { o.MaxTokensPerAction = 2 }, ReasonOverBudget, "turn 1: 3 action tokens, budget 2"},
	{"over episode tokens", func(t *schemas.Trajectory, o *Options) { o.MaxTokensPerEpisode = 13 }, ReasonOverBudget, "14 episode tokens, budget 13"},
	{"at episode budget", func(t *schemas.Trajectory, o *Options) { o.MaxTokensPerEpisode = 14 }, "", ""},
}

func TestCheck(t *testing.T) {
	for _, tc := range checkCases {
		t.Run(tc.name, func(t *testing.T) {
			tr, o := validTrajectory(), testOptions()
			tc.mutate(tr, &o)
			got := Check(tr, o)
			if got.Reason != tc.reason {
				t.Fatalf("Check = %v, want reason %q", got, tc.reason)
			}
			if want := ClassOf(tc.reason); got.Class != want {
				t.Fatalf("class %q, want %q", got.Class, want)
			}
			if got.OK() != (tc.reason == "") {
				t.Fatalf("OK() = %v for %v", got.OK(), got)
			}
			if !strings.Contains(got.Detail, tc.detail) {
				t.Fatalf("detail %q does not contain %q", got.Detail, tc.detail)
			}
			if tc.reason == "" && got.Detail != "" {
				t.Fatalf("valid verdict with detail %q", got.Detail)
			}
		})
	}
}

// TestReasonsCovered makes sure every reason code has a test case that
// produces it, so a new check cannot be added without one.
func TestReasonsCovered(t *testing.T) {
	hit := map[string]bool{}
	for _, tc := range checkCases {
		hit[tc.reason] = true
	}
	for _, tc := range rewardCases {
		hit[tc.reason] = true
	}
	for _, r := range Reasons() {
		if !hit[r] {
			t.Errorf("reason %q has no test case", r)
		}
	}
	for r := range hit {
		if r != "" && ClassOf(r) == InfraInvalid && !contains(Reasons(), r) {
			t.Errorf("test case reason %q is not a known reason", r)
		}
	}
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func TestClassOf(t *testing.T) {
	for _, tc := range []struct {
		reason string
		want   Class
	}{
		{"", Valid},
		{ReasonEvalTaskID, Incident},
		{ReasonSafetyIncident, Incident},
		{ReasonTimedOut, InfraInvalid},
		{ReasonRewardUnavailable, InfraInvalid},
		{"not_a_reason", InfraInvalid},
	} {
		if got := ClassOf(tc.reason); got != tc.want {
			t.Errorf("ClassOf(%q) = %q, want %q", tc.reason, got, tc.want)
		}
	}
	incidents := 0
	for _, r := range Reasons() {
		if ClassOf(r) == Incident {
			incidents++
		}
	}
	if incidents != 2 {
		t.Errorf("%d incident reasons, want 2", incidents)
	}
}

func TestVerdictString(t *testing.T) {
	for _, tc := range []struct {
		v    Verdict
		want string
	}{
		{Verdict{Class: Valid}, "valid"},
		{Verdict{Class: InfraInvalid, Reason: ReasonNoTurns}, "infra_invalid: no_turns"},
		{Verdict{Class: Incident, Reason: ReasonEvalTaskID, Detail: "x"}, "incident: eval_task_id: x"},
	} {
		if got := tc.v.String(); got != tc.want {
			t.Errorf("String() = %q, want %q", got, tc.want)
		}
	}
	if !(Verdict{Class: InfraInvalid}).Infra() || (Verdict{Class: Incident}).Infra() {
		t.Error("Infra() wrong")
	}
}

func TestCheckNil(t *testing.T) {
	if v := Check(nil, Options{}); v.Reason != ReasonMissingID {
		t.Fatalf("Check(nil) = %v", v)
	}
	if v := CheckRewarded(nil, RewardOptions{}); v.Reason != ReasonMissingID {
		t.Fatalf("CheckRewarded(nil) = %v", v)
	}
}

// TestCheckDoesNotMutate guards the purity contract.
func TestCheckDoesNotMutate(t *testing.T) {
	a, b := validTrajectory(), validTrajectory()
	a.Turns[1].ActionLogprobs[0] = float32(math.NaN())
	b.Turns[1].ActionLogprobs[0] = float32(math.NaN())
	Check(a, testOptions())
	if a.RecordID != b.RecordID || len(a.Turns) != len(b.Turns) || a.Turns[2].ActionIDs[0] != b.Turns[2].ActionIDs[0] {
		t.Fatal("Check modified its input")
	}
}

func TestDenySet(t *testing.T) {
	d := DenySet("a", "b")
	if !d("a") || !d("b") || d("c") || d("") {
		t.Fatal("DenySet membership wrong")
	}
}

// FuzzCheck feeds arbitrary token/log-prob/index data through Check: it
// must never panic, and a trajectory it accepts must satisfy the invariants
// the later stages rely on.
func FuzzCheck(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, int8(0), float32(-0.5))
	f.Add([]byte{}, int8(-1), float32(0.5))
	f.Add([]byte{255, 255, 0, 0, 3}, int8(3), float32(math.NaN()))
	f.Fuzz(func(t *testing.T, data []byte, shift int8, lp float32) {
		tr := validTrajectory()
		o := testOptions()
		o.MaxTokensPerAction = 0
		// Reshape the turns from the bytes: each byte sets a length or an id.
		for i := range tr.Turns {
			turn := &tr.Turns[i]
			if len(data) > i {
				n := int(data[i] % 5)
				turn.ActionIDs = turn.ActionIDs[:0]
				turn.ActionLogprobs = turn.ActionLogprobs[:0]
				for j := 0; j < n; j++ {
					turn.ActionIDs = append(turn.ActionIDs, int32(data[i])*4-int32(j))
					turn.ActionLogprobs = append(turn.ActionLogprobs, lp)
				}
				if data[i]%7 == 0 {
					turn.ActionLogprobs = turn.ActionLogprobs[:len(turn.ActionLogprobs)/2]
				}
			}
			turn.Index += int32(shift) * int32(i%2)
		}
		if len(data) > 3 {
			tr.Turns = tr.Turns[:int(data[3])%(len(tr.Turns)+1)]
		}
		v := Check(tr, o)
		if v.Class != ClassOf(v.Reason) {
			t.Fatalf("class %q does not match reason %q", v.Class, v.Reason)
		}
		if !v.OK() {
			return
		}
		for i, turn := range tr.Turns {
			if turn.Index != int32(i) || len(turn.ActionIDs) == 0 || len(turn.ActionIDs) != len(turn.ActionLogprobs) {
				t.Fatalf("accepted a malformed turn %d: %+v", i, turn)
			}
			for _, l := range turn.ActionLogprobs {
				if !(l <= 0) {
					t.Fatalf("accepted log-prob %v", l)
				}
			}
			for _, id := range turn.ActionIDs {
				if id < 0 || id >= testVocab {
					t.Fatalf("accepted id %d", id)
				}
			}
		}
	})
}

func BenchmarkCheck(b *testing.B) {
	tr := validTrajectory()
	const turns, actionLen = 32, 256
	tr.Turns = tr.Turns[:0]
	tokens := 0
	for i := 0; i < turns; i++ {
		turn := schemas.Turn{Index: int32(i), PromptIDs: make([]int32, 64), ActionIDs: make([]int32, actionLen),
			ActionLogprobs: make([]float32, actionLen), ObservationIDs: make([]int32, 128),
			PolicyVersion: 3, Decision: schemas.DecisionOK}
		for j := range turn.ActionLogprobs {
			turn.ActionLogprobs[j] = -0.25
		}
		tokens += 64 + actionLen + 128
		tr.Turns = append(tr.Turns, turn)
	}
	o := testOptions()
	o.MaxTurns, o.MaxTokensPerAction, o.MaxTokensPerEpisode = 0, 0, 0
	if v := Check(tr, o); !v.OK() {
		b.Fatalf("benchmark trajectory rejected: %v", v)
	}
	b.ReportAllocs()
	b.SetBytes(int64(tokens * 4))
	b.ResetTimer()
	for b.Loop() {
		Check(tr, o)
	}
	b.ReportMetric(float64(b.N*tokens)/b.Elapsed().Seconds(), "tokens/s")
}

// TestIsFinite32 checks the bit test against math.IsNaN and math.IsInf on
// the edge values and on every exponent with a few mantissas.
func TestIsFinite32(t *testing.T) {
	vals := []float32{0, float32(math.Copysign(0, -1)), 1, -1, math.MaxFloat32, -math.MaxFloat32, math.SmallestNonzeroFloat32,
		float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN()), math.Float32frombits(0x7fc00001), math.Float32frombits(0xff800001)}
	for exp := uint32(0); exp < 256; exp++ {
		for _, mant := range []uint32{0, 1, 0x400000, 0x7fffff} {
			vals = append(vals, math.Float32frombits(exp<<23|mant), math.Float32frombits(1<<31|exp<<23|mant))
		}
	}
	for _, v := range vals {
		want := !math.IsNaN(float64(v)) && !math.IsInf(float64(v), 0)
		if got := isFinite32(v); got != want {
			t.Errorf("isFinite32(%v, bits %#x) = %v, want %v", v, math.Float32bits(v), got, want)
		}
	}
}
