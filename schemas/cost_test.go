package schemas

import (
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// TestEpisodeCostOf: tokens of every turn's prompt, action and
// observation; latencies summed, then converted to hours.
func TestEpisodeCostOf(t *testing.T) {
	turns := []Turn{
		{PromptIDs: []int32{1, 2, 3}, ActionIDs: []int32{4, 5}, ObservationIDs: []int32{6}, GenLatencyUS: 1_800_000, EnvLatencyUS: 3_600_000},
		{PromptIDs: []int32{7}, ActionIDs: []int32{8, 9, 10}, GenLatencyUS: 1_800_000, EnvLatencyUS: 7_200_000},
	}
	got := EpisodeCostOf(turns)
	// 3+2+1 + 1+3 tokens; 3.6 s of generation = 0.001 h; 10.8 s of environment = 0.003 h.
	want := EpisodeCost{Episodes: 1, RolloutTokens: 10, GenerationHours: 0.001, EnvironmentHours: 0.003}
	if got != want {
		t.Fatalf("EpisodeCostOf = %+v, want %+v", got, want)
	}
	var sum WindowCost
	sum.Add(WindowCost{Windows: 1, Admitted: want})
	sum.Add(WindowCost{Windows: 1, Admitted: want, Filtered: want})
	if sum.Windows != 2 || sum.Admitted.Episodes != 2 || sum.Admitted.RolloutTokens != 20 || sum.Filtered.RolloutTokens != 10 {
		t.Fatalf("sum %+v", sum)
	}
}

// TestDecodeWindowCost: a header that round-trips, and the refusals, each
// naming the header and what is wrong.
func TestDecodeWindowCost(t *testing.T) {
	c := WindowCost{Windows: 2, Admitted: EpisodeCost{Episodes: 3, RolloutTokens: 40, GenerationHours: 0.5, EnvironmentHours: 0.25},
		Failed: EpisodeCost{Episodes: 1, RolloutTokens: 7, EnvironmentHours: 0.125}}
	b, err := EncodeWindowCost(c)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := DecodeWindowCost(b); err != nil || got != c {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	for _, tc := range []struct{ name, in, want string }{
		{"empty", ``, "EOF"},
		{"not an object", `[1]`, "cannot unmarshal"},
		{"unknown field", `{"windows":1,"bogus":2}`, `unknown field "bogus"`},
		{"trailing data", `{"windows":1} {}`, "data after the object"},
		{"negative windows", `{"windows":-1}`, "windows -1 < 0"},
		{"negative episodes", `{"filtered":{"episodes":-2}}`, "filtered.episodes -2 < 0"},
		{"negative tokens", `{"admitted":{"rollout_tokens":-4}}`, "admitted.rollout_tokens -4 < 0"},
		{"negative hours", `{"admitted":{"environment_hours":-0.5}}`, "admitted.environment_hours -0.5"},
		{"huge number", `{"admitted":{"generation_hours":1e999}}`, "generation_hours"},
		{"negative failed", `{"failed":{"episodes":-1}}`, "failed.episodes -1 < 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeWindowCost([]byte(tc.in))
			if err == nil || !errors.Is(err, ErrDecode) || !strings.Contains(err.Error(), HeaderWindowCost) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("DecodeWindowCost(%q) = %v, want an ErrDecode naming %s and %q", tc.in, err, HeaderWindowCost, tc.want)
			}
		})
	}
}

func FuzzDecodeWindowCost(f *testing.F) {
	fuzzDoc(f, EncodeWindowCost, DecodeWindowCost,
		WindowCost{Windows: 1, Admitted: EpisodeCost{Episodes: 2, RolloutTokens: 9, GenerationHours: 0.1, EnvironmentHours: 0.2},
			Failed: EpisodeCost{Episodes: 1, RolloutTokens: 3, EnvironmentHours: 0.01}},
		WindowCost{})
}

// TestFailureCost: which census events are failed generation, and what
// each costs (times in hours: 3.6e9 µs = 1 h).
func TestFailureCost(t *testing.T) {
	for _, tc := range []struct {
		name string
		ev   CensusEvent
		want EpisodeCost
		ok   bool
	}{
		{"refused by validate", CensusEvent{Kind: CensusQuarantined, Stage: "validate", Tokens: 12, LatencyUS: 36_000_000},
			EpisodeCost{Episodes: 1, RolloutTokens: 12, EnvironmentHours: 0.01}, true},
		{"refused by reward", CensusEvent{Kind: CensusQuarantined, Stage: "reward", Tokens: 5}, EpisodeCost{Episodes: 1, RolloutTokens: 5}, true},
		{"refused by advantage", CensusEvent{Kind: CensusQuarantined, Stage: "advantage"}, EpisodeCost{Episodes: 1}, true},
		{"refused by pack", CensusEvent{Kind: CensusQuarantined, Stage: "pack", Tokens: 1}, EpisodeCost{Episodes: 1, RolloutTokens: 1}, true},
		{"tries exhausted", CensusEvent{Kind: CensusQuarantined, Stage: "rollout", Infra: true}, EpisodeCost{Episodes: 1}, true},
		{"infrastructure try", CensusEvent{Kind: CensusFailed, Stage: "rollout", Infra: true, LatencyUS: 1_800_000},
			EpisodeCost{EnvironmentHours: 0.0005}, true},
		{"timed out", CensusEvent{Kind: CensusTimedOut, Stage: "rollout", Infra: true, LatencyUS: 3_600_000},
			EpisodeCost{EnvironmentHours: 0.001}, true},
		{"negative values", CensusEvent{Kind: CensusQuarantined, Stage: "validate", Tokens: -3, LatencyUS: -9}, EpisodeCost{Episodes: 1}, true},
		{"refused before it ran", CensusEvent{Kind: CensusQuarantined, Stage: "dispatch"}, EpisodeCost{}, false},
		{"refused batch member", CensusEvent{Kind: CensusQuarantined, Stage: "train"}, EpisodeCost{}, false},
		{"agent failure", CensusEvent{Kind: CensusFailed, Stage: "rollout", LatencyUS: 5}, EpisodeCost{}, false},
		{"completed", CensusEvent{Kind: CensusCompleted, Stage: "rollout", Tokens: 9, LatencyUS: 5}, EpisodeCost{}, false},
		{"filtered", CensusEvent{Kind: CensusFiltered, Stage: "pack", Tokens: 9}, EpisodeCost{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := FailureCost(tc.ev)
			if ok != tc.ok || got != tc.want {
				t.Fatalf("FailureCost = %+v, %v; want %+v, %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}

// TestRefusedCost: a batch the trainer refused whole keeps its filtered
// cost as rejected; what it admitted becomes failed, with its own failed.
func TestRefusedCost(t *testing.T) {
	c := WindowCost{Windows: 2,
		Admitted: EpisodeCost{Episodes: 4, RolloutTokens: 100, GenerationHours: 0.5, EnvironmentHours: 0.25},
		Filtered: EpisodeCost{Episodes: 2, RolloutTokens: 30},
		Failed:   EpisodeCost{Episodes: 1, RolloutTokens: 10, EnvironmentHours: 0.125}}
	want := WindowCost{Windows: 2, Filtered: c.Filtered,
		Failed: EpisodeCost{Episodes: 5, RolloutTokens: 110, GenerationHours: 0.5, EnvironmentHours: 0.375}}
	if got := c.Refused(); got != want {
		t.Fatalf("Refused = %+v, want %+v", got, want)
	}
	u := UpdateCostOf(&c, TrainingCost{OptimizerTokens: 8})
	if u.Rollout != c.Admitted || u.Rejected != c.Filtered || u.Failed != c.Failed || u.Windows != 2 {
		t.Fatalf("UpdateCostOf = %+v", u)
	}
}

// TestDecodeWindowPerAdmitted: the per-admitted token lists round-trip,
// may be absent (records written before them), and are refused when
// their length is not the admitted list's, naming the field.
func TestDecodeWindowPerAdmitted(t *testing.T) {
	w := WindowRecord{BatchID: "b", RunID: "r", Admitted: []string{"a1", "a2"}, AdmittedTokens: []int64{6, 7}, AdmittedStaleTokens: []int64{0, 2},
		Filtered: []WindowDecision{{RecordID: "f1", GroupID: "g", Filter: "stale", StaleTokens: 3}}, Groups: []string{"g"}}
	for _, tc := range []struct {
		name string
		edit func(*WindowRecord)
		want string // "" decodes
	}{
		{"both lists", func(*WindowRecord) {}, ""},
		{"no lists", func(w *WindowRecord) { w.AdmittedTokens, w.AdmittedStaleTokens = nil, nil }, ""},
		{"short tokens", func(w *WindowRecord) { w.AdmittedTokens = w.AdmittedTokens[:1] }, "admitted_tokens has 1 entries for 2 admitted records"},
		{"long stale", func(w *WindowRecord) { w.AdmittedStaleTokens = append(w.AdmittedStaleTokens, 1) }, "admitted_stale_tokens has 3 entries for 2 admitted records"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := w
			in.Admitted = slices.Clone(w.Admitted)
			in.AdmittedTokens, in.AdmittedStaleTokens = slices.Clone(w.AdmittedTokens), slices.Clone(w.AdmittedStaleTokens)
			tc.edit(&in)
			b, err := EncodeWindow(in)
			if err != nil {
				t.Fatal(err)
			}
			got, err := DecodeWindow(b)
			if tc.want == "" {
				if err != nil || !reflect.DeepEqual(got, in) {
					t.Fatalf("DecodeWindow = %+v, %v; want %+v", got, err, in)
				}
				return
			}
			if !errors.Is(err, ErrDecode) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("DecodeWindow: %v, want an ErrDecode saying %q", err, tc.want)
			}
		})
	}
}

func FuzzDecodeWindow(f *testing.F) {
	fuzzDoc(f, EncodeWindow, DecodeWindow,
		WindowRecord{BatchID: "b", RunID: "r", Admitted: []string{"a1"}, AdmittedTokens: []int64{6}, AdmittedStaleTokens: []int64{1},
			Filtered: []WindowDecision{{RecordID: "f1", GroupID: "g", Filter: "stale", StaleTokens: 3}}, Groups: []string{"g"}},
		WindowRecord{})
}
