package schemas

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"
)

func sampleRelease() PolicyRelease {
	return PolicyRelease{PolicyVersion: 7, TrainingStep: 700, CheckpointHash: "sha256:ab", CheckpointURI: "file:///ckpt/7",
		ModelConfigHash: "m", TokenizerHash: "t", ChatTemplateHash: "c", SamplerContract: `{"temperature":1}`,
		ContractHash: "h", CreatedAt: "2026-11-30T07:00:00Z", Ready: true}
}

func sampleCensus() CensusEvent {
	return CensusEvent{EventID: DerivedID("census/admitted", "a1"), RunID: "run", AttemptID: "a1", TaskID: "t", GroupID: "g",
		Kind: CensusAdmitted, Stage: "pack", Reason: "ünïcødé ✓", Infra: true, BatchID: "b", Update: 3, PolicyVersion: 2,
		Tokens: 1024, StaleTokens: 12, Reward: -0.25, LatencyUS: 17, At: 1700000000000000}
}

func TestJSONRoundTrip(t *testing.T) {
	rel, err := EncodeRelease(sampleRelease())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(rel), `{"kind":"policy_release","version":1,"data":{`) {
		t.Fatalf("document %s", rel)
	}
	gotRel, err := DecodeRelease(rel)
	if err != nil || gotRel != sampleRelease() {
		t.Fatalf("release round trip: %+v %v", gotRel, err)
	}
	for _, ev := range []CensusEvent{sampleCensus(), {EventID: "e", Kind: CensusDispatched, Stage: "dispatch"}} {
		b, err := EncodeCensus(ev)
		if err != nil {
			t.Fatal(err)
		}
		got, err := DecodeCensus(b)
		if err != nil || got != ev {
			t.Fatalf("census round trip: %+v %v", got, err)
		}
	}
	if _, err := EncodeCensus(CensusEvent{Reward: math.NaN()}); err == nil {
		t.Fatal("NaN reward encoded as JSON")
	}
}

func TestJSONErrors(t *testing.T) {
	tests := []struct {
		name    string
		doc     string
		decode  func([]byte) error
		version bool // want *VersionError, else ErrDecode
	}{
		{"release as census", `{"kind":"policy_release","version":1,"data":{}}`, decodeCensus, true},
		{"census as release", `{"kind":"census_event","version":1,"data":{}}`, decodeRelease, true},
		{"version 2", `{"kind":"policy_release","version":2,"data":{}}`, decodeRelease, true},
		{"version as string", `{"kind":"census_event","version":"1","data":{}}`, decodeCensus, true},
		{"no version", `{"kind":"census_event","data":{}}`, decodeCensus, true},
		{"no kind", `{"version":1,"data":{}}`, decodeRelease, true},
		{"empty", ``, decodeRelease, false},
		{"garbage", `not json`, decodeRelease, false},
		{"truncated", `{"kind":"policy_release","version":1,"data":{"ready":tr`, decodeRelease, false},
		{"unknown top-level field", `{"kind":"policy_release","version":1,"data":{},"extra":1}`, decodeRelease, false},
		{"unknown data field", `{"kind":"policy_release","version":1,"data":{"policy_version":1,"weights":"x"}}`, decodeRelease, false},
		{"wrong field type", `{"kind":"census_event","version":1,"data":{"tokens":"many"}}`, decodeCensus, false},
		{"no data", `{"kind":"census_event","version":1}`, decodeCensus, false},
		{"null data", `{"kind":"census_event","version":1,"data":null}`, decodeCensus, false},
		{"trailing document", `{"kind":"census_event","version":1,"data":{}} {}`, decodeCensus, false},
		{"array", `[]`, decodeCensus, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.decode([]byte(tt.doc))
			var ve *VersionError
			isVersion := errors.As(err, &ve)
			if isVersion != tt.version || (!tt.version && !errors.Is(err, ErrDecode)) || (tt.version && errors.Is(err, ErrDecode)) {
				t.Fatalf("got %v (version error %v), want version error %v", err, isVersion, tt.version)
			}
		})
	}
}

func decodeRelease(b []byte) error { _, err := DecodeRelease(b); return err }
func decodeCensus(b []byte) error  { _, err := DecodeCensus(b); return err }

// TestCensusFastPathMatchesEncodingJSON checks, over random events, that
// EncodeCensus writes the bytes encoding/json writes and that the
// canonical decoder reads them back (or defers to encoding/json).
func TestCensusFastPathMatchesEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	strs := []string{"", "a", "run-1", "ünï", "a\"b", `back\slash`, "<&>", "tab\there", "\x01", "\xff", "plain id 0123456789abcdef"}
	nums := []int64{0, 1, -1, 7, 1 << 40, -(1 << 62), 9223372036854775807}
	plain := []string{"", "a", "run-1", "plain id 0123456789abcdef"}
	var pick func() string
	num := func() int64 { return nums[r.IntN(len(nums))] }
	fast := 0
	for i := range 5000 {
		// Half the events use plain strings only: the canonical decoder's case.
		pick = func() string { return strs[r.IntN(len(strs))] }
		if i%2 == 0 {
			pick = func() string { return plain[r.IntN(len(plain))] }
		}
		e := CensusEvent{EventID: pick(), RunID: pick(), AttemptID: pick(), TaskID: pick(), GroupID: pick(), Kind: pick(),
			Stage: pick(), Reason: pick(), Infra: r.IntN(2) == 0, BatchID: pick(), Update: num(), PolicyVersion: num(),
			Tokens: num(), StaleTokens: num(), LatencyUS: num(), At: num()}
		if i%2 == 1 && r.IntN(2) == 0 {
			e.Reward = r.NormFloat64()
		}
		got, err := EncodeCensus(e)
		if err != nil {
			t.Fatal(err)
		}
		want, err := encodeDoc(KindCensusEvent, &e)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("event %d: EncodeCensus wrote\n%s\nencoding/json\n%s", i, got, want)
		}
		back, err := DecodeCensus(got)
		valid := utf8.ValidString(fmt.Sprint(e)) // JSON replaces invalid UTF-8 with U+FFFD
		if err != nil || (valid && back != e) {
			t.Fatalf("event %d: decoded %+v (%v), want %+v", i, back, err, e)
		}
		if _, ok := decodeCensusCanonical(got); ok {
			fast++
		}
	}
	if fast < 2000 {
		t.Fatalf("the canonical decoder read only %d of 5000 events", fast)
	}
	if _, err := EncodeCensus(CensusEvent{Reward: math.NaN()}); err == nil {
		t.Fatal("NaN reward encoded")
	}
}

// TestCensusRetriedFastPath: the rollout stage's retry events (kind
// retried, a client reason, Infra set) take the canonical path both ways
// and read back as written.
func TestCensusRetriedFastPath(t *testing.T) {
	for _, reason := range []string{"timeout", "connection", "http_502", "status_connection", "allocate_capacity", "terminate_timeout", "step_timeout"} {
		e := CensusEvent{EventID: DerivedID("census/retried/rollout/"+reason+"/1", "a1"), RunID: "run", AttemptID: "a1", TaskID: "ledger-train-00001",
			GroupID: "g", Kind: CensusRetried, Stage: "rollout", Reason: reason, Infra: true, PolicyVersion: 3, At: 1700000000000000}
		b, err := EncodeCensus(e)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := encodeDoc(KindCensusEvent, &e)
		if !bytes.Equal(b, want) {
			t.Fatalf("%s: EncodeCensus wrote\n%s\nencoding/json\n%s", reason, b, want)
		}
		got, ok := decodeCensusCanonical(b)
		if !ok || got != e {
			t.Fatalf("%s: canonical decode %v: %+v", reason, ok, got)
		}
	}
}
