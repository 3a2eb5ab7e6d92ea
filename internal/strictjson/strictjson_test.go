package strictjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
)

type inner struct {
	Text string  `json:"text,omitempty"`
	IDs  []int32 `json:"ids"`
}

type common struct {
	Protocol int    `json:"protocol"`
	Outcome  string `json:"outcome"`
}

type request struct {
	common
	Seq      uint64            `json:"seq"`
	Action   inner             `json:"action"`
	Items    []inner           `json:"items"`
	Labels   map[string]inner  `json:"labels"`
	Raw      json.RawMessage   `json:"raw"`
	Any      any               `json:"any"`
	Ptr      *inner            `json:"ptr"`
	Untagged string            //nolint: the Go name is the JSON name
	Skipped  string            `json:"-"`
	Extra    map[string]string `json:"extra"`
}

func TestCheckKeys(t *testing.T) {
	for _, tc := range []struct {
		name, doc string
		key, path string // "" key: accepted
		want      string // the field of a wrong-case key
	}{
		{"exact keys", `{"protocol":1,"seq":2,"action":{"text":"a"},"Untagged":"x"}`, "", "", ""},
		{"unknown keys are the decoder's", `{"seq":2,"novel":{"a":1}}`, "", "", ""},
		{"a key of another case", `{"seq":1,"Seq":2}`, "Seq", "", "seq"},
		{"wrong case alone", `{"ACTION":{"text":"b"}}`, "ACTION", "", "action"},
		{"the long s folds to s", `{"\u017Feq":2}`, "\u017feq", "", "seq"},
		{"the Kelvin sign is no t", `{"labels":{"x":{"te\u212At":"b"}}}`, "", "", ""},
		{"a promoted field's case", `{"Protocol":1}`, "Protocol", "", "protocol"},
		{"the Go name's case", `{"untagged":"x"}`, "untagged", "", "Untagged"},
		{"duplicate at the top", `{"seq":1,"seq":2}`, "seq", "", ""},
		{"duplicate in a struct", `{"action":{"text":"a","text":"b"}}`, "text", "action", ""},
		{"wrong case in a slice element", `{"items":[{"text":"a"},{"IDs":[1]}]}`, "IDs", "items[1]", "ids"},
		{"wrong case through a pointer", `{"ptr":{"Text":"a"}}`, "Text", "ptr", "text"},
		{"map values are structs", `{"labels":{"x":{"TEXT":"a"}}}`, "TEXT", "labels.x", "text"},
		{"map keys are data: any case", `{"extra":{"a":"1","A":"2"}}`, "", "", ""},
		{"duplicate map key", `{"extra":{"a":"1","a":"2"}}`, "a", "extra", ""},
		{"raw JSON: duplicates only", `{"raw":{"Seq":1,"x":[{"k":1,"k":2}]}}`, "k", "raw.x[0]", ""},
		{"raw JSON of any case", `{"raw":{"Seq":1}}`, "", "", ""},
		{"any: duplicates only", `{"any":{"b":1,"b":2}}`, "b", "any", ""},
		{"a skipped field is unknown", `{"Skipped":"x","skipped":"y"}`, "", "", ""},
		{"not JSON: the decoder's error", `{"seq":`, "", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckKeys([]byte(tc.doc), reflect.TypeFor[*request]())
			var ke *KeyError
			switch {
			case tc.key == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.key == "":
				return
			case !errors.As(err, &ke):
				t.Fatalf("accepted (%v), want key %q refused", err, tc.key)
			case ke.Key != tc.key || ke.Path != tc.path || ke.Want != tc.want:
				t.Fatalf("%+v, want key %q at %q (field %q)", *ke, tc.key, tc.path, tc.want)
			}
		})
	}
}

// TestUnmarshalRefusesWhatEncodingJSONMerges: the bodies on which
// encoding/json's reading differs from an exact one (last of two keys,
// a key of another case) are refused before anything is decoded.
func TestUnmarshalRefusesWhatEncodingJSONMerges(t *testing.T) {
	doc := []byte(`{"action":{"text":"signed"},"seq":1,"Action":{"text":"other"}}`)
	var lenient request
	if err := json.Unmarshal(doc, &lenient); err != nil || lenient.Action.Text != "other" {
		t.Fatalf("encoding/json read %q (%v): the case this package exists for is gone", lenient.Action.Text, err)
	}
	var strict request
	err := Unmarshal(doc, &strict)
	if err == nil || !strings.Contains(err.Error(), `key "Action": keys are case-sensitive, the field is "action"`) {
		t.Fatalf("Unmarshal: %v", err)
	}
	if strict.Action.Text != "" || strict.Seq != 0 {
		t.Fatalf("decoded %+v before refusing", strict)
	}
	if err := Unmarshal([]byte(`{"action":{"text":"a"},"seq":3}`), &strict); err != nil || strict.Seq != 3 || strict.Action.Text != "a" {
		t.Fatalf("a plain body: %+v %v", strict, err)
	}
	err = Unmarshal([]byte(`{"seq":1} {"seq":2}`), &strict)
	if err == nil {
		t.Fatal("two documents accepted")
	}
}

func TestKeyErrorText(t *testing.T) {
	for _, tc := range []struct {
		err  KeyError
		want string
	}{
		{KeyError{Key: "seq"}, `key "seq" given twice`},
		{KeyError{Path: "action", Key: "text"}, `key "text" in action given twice`},
		{KeyError{Path: "items[1]", Key: "IDs", Want: "ids"}, `key "IDs" in items[1]: keys are case-sensitive, the field is "ids"`},
	} {
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("%q, want %q", got, tc.want)
		}
	}
}

// FuzzCheckKeys: any input is answered without a panic, and a key
// reported given twice is read at least twice from the document. The
// count is of decoded strings, not of raw bytes: "s\u0065q" and "seq"
// are one key, and so are two different invalid UTF-8 keys, which both
// decode to U+FFFD.
func FuzzCheckKeys(f *testing.F) {
	for _, s := range []string{`{"seq":1,"seq":2}`, `{"items":[{"IDs":[1]}]}`, `{"raw":{"a":{"b":1,"b":2}}}`, `[`, `{"labels":{"x":{}}}`, "{\"\xac\":0,\"\xad\":1}", `{"s\u0065q":1,"seq":2}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, doc []byte) {
		err := CheckKeys(doc, reflect.TypeFor[request]())
		var ke *KeyError
		if errors.As(err, &ke) && ke.Want == "" {
			if n := stringsRead(doc, ke.Key); n < 2 {
				t.Fatalf("key %q reported twice, read %d times from %q", ke.Key, n, doc)
			}
		}
	})
}

// stringsRead counts the strings equal to s that a json.Decoder reads
// from doc before its first syntax error.
func stringsRead(doc []byte, s string) int {
	dec := json.NewDecoder(bytes.NewReader(doc))
	n := 0
	for {
		tok, err := dec.Token()
		if err != nil {
			return n
		}
		if str, ok := tok.(string); ok && str == s {
			n++
		}
	}
}
