package stagekit_test

import (
	"errors"
	"reflect"
	"testing"

	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

func withHeader(v string) *pipeline.Message {
	return &pipeline.Message{Headers: []pipeline.Header{{Key: schemas.HeaderAbsent, Value: []byte(v)}}}
}

func TestAbsentRoundTrip(t *testing.T) {
	a := stagekit.Absent{}
	a.Add("g-2", 5, 8)
	a.Add("g-1", 3, 8)
	a.Add("g-1", 0, 8)
	a.Add("g-1", 3, 8) // twice: once
	a.Add("", 1, 8)    // no group: no slot
	a.Add("g-3", 8, 8) // out of range
	a.Add("g-3", -1, 8)
	h, ok := stagekit.AbsentHeader(a)
	if !ok || h.Key != schemas.HeaderAbsent || string(h.Value) != `{"g-1":[0,3],"g-2":[5]}` {
		t.Fatalf("header %q %v", h.Value, ok)
	}
	got, err := stagekit.AbsentOf(&pipeline.Message{Headers: []pipeline.Header{h}})
	if err != nil || !reflect.DeepEqual(got, a) {
		t.Fatalf("parsed %v %v, want %v", got, err, a)
	}
	if _, ok := stagekit.AbsentHeader(stagekit.Absent{}); ok {
		t.Fatal("empty declaration made a header")
	}
	none, err := stagekit.AbsentOf(&pipeline.Message{})
	if err != nil || len(none) != 0 {
		t.Fatalf("no header: %v %v", none, err)
	}
	out := stagekit.WithAbsent(pipeline.Output{Topic: "t"}, stagekit.Absent{})
	if len(out.Headers) != 0 {
		t.Fatalf("empty declaration added headers %v", out.Headers)
	}
}

func TestAbsentOfRefusesBadHeaders(t *testing.T) {
	for _, v := range []string{
		``, `null`, `[]`, `{"g":[1.5]}`, `{"g":[-1]}`, `{"g":[1,1]}`, `{"":[1]}`,
		`{"g":[1]} {}`, `{"g":[1]}]`, `{"g":[1]}}`, `{"g":[4294967296]}`, `{"g":[2147483647]}`, `{"g":"1"}`, `not json`,
	} {
		_, err := stagekit.AbsentOf(withHeader(v))
		var r *pipeline.Refusal
		if !errors.As(err, &r) || r.Reason != stagekit.ReasonBadAbsent {
			t.Errorf("%q: %v, want refusal %s", v, err, stagekit.ReasonBadAbsent)
		}
	}
}

// FuzzAbsentOf: whatever parses re-encodes to a header that parses to the
// same declaration.
func FuzzAbsentOf(f *testing.F) {
	for _, s := range []string{`{"g-1":[0,3],"g-2":[5]}`, `{}`, `{"a":[]}`, `{"g":[1,1]}`, `[`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, v []byte) {
		a, err := stagekit.AbsentOf(withHeader(string(v)))
		if err != nil {
			return
		}
		h, ok := stagekit.AbsentHeader(a)
		if !ok {
			for g, ms := range a {
				if len(ms) > 0 {
					t.Fatalf("group %q with members %v made no header", g, ms)
				}
			}
			return
		}
		b, err := stagekit.AbsentOf(&pipeline.Message{Headers: []pipeline.Header{h}})
		if err != nil {
			t.Fatalf("re-encoded header %q: %v", h.Value, err)
		}
		for g, ms := range a {
			if len(ms) > 0 && !reflect.DeepEqual(b[g], ms) {
				t.Fatalf("group %q: %v after a round trip, want %v", g, b[g], ms)
			}
		}
	})
}
