package schemas

import (
	"bytes"
	"math"
	"reflect"
	"strings"
	"testing"
)

// TestCensusFieldTable fails when CensusEvent and the fast path's field
// table disagree: a field added to the struct and not to censusFields (or
// the reverse), a renamed json key, a changed omitempty or Go type, or a
// different order (the fast path writes and reads fields in table order,
// encoding/json in declaration order).
func TestCensusFieldTable(t *testing.T) {
	typ := reflect.TypeFor[CensusEvent]()
	kindOf := map[reflect.Kind]byte{reflect.String: 's', reflect.Int64: 'i', reflect.Bool: 'b', reflect.Float64: 'f'}
	for i := range max(typ.NumField(), len(censusFields)) {
		if i >= typ.NumField() {
			t.Errorf("censusFields[%d] %q: CensusEvent has no field %d", i, censusFields[i].key, i)
			continue
		}
		f := typ.Field(i)
		name, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
		omit := opts == "omitempty"
		kind, ok := kindOf[f.Type.Kind()]
		if !ok || f.Anonymous || (opts != "" && !omit) {
			t.Errorf("CensusEvent.%s (%s, json %q): the census fast path writes only plain string, int64, bool and float64 fields",
				f.Name, f.Type, f.Tag.Get("json"))
			continue
		}
		if i >= len(censusFields) {
			t.Errorf("CensusEvent.%s (json %q) is not in censusFields (censusjson.go): add it there", f.Name, name)
			continue
		}
		c := censusFields[i]
		if c.key != name || c.omit != omit || c.kind != kind {
			t.Errorf("censusFields[%d] = {key %q, omit %v, kind %c}, CensusEvent.%s is {json %q, omitempty %v, kind %c}",
				i, c.key, c.omit, c.kind, f.Name, name, omit, kind)
		}
	}
}

// censusValues are values of each Go type the fast path writes: plain,
// escaped, non-ASCII, extremes, zero.
var censusValues = map[reflect.Kind][]any{
	reflect.String:  {"", "a", "attempt-0123456789abcdef", "ünïcødé ✓", `q"uote`, `back\slash`, "<&>", "tab\tnl\n", "\x01"},
	reflect.Int64:   {int64(0), int64(1), int64(-1), int64(math.MaxInt64), int64(math.MinInt64), int64(1700000000000000)},
	reflect.Bool:    {false, true},
	reflect.Float64: {0.0, -0.25, 1.0, 1e-300, math.MaxFloat64, math.Copysign(0, -1), 123456789.125},
}

// TestCensusEveryField round-trips, for every field of CensusEvent and
// every value of its type, an event with that field set (alone, and over
// an event with every other field set): EncodeCensus writes the bytes
// encoding/json writes, and DecodeCensus and the encoding/json decoder
// read them back to the same event.
func TestCensusEveryField(t *testing.T) {
	typ := reflect.TypeFor[CensusEvent]()
	full := sampleCensus()
	for i := range typ.NumField() {
		f := typ.Field(i)
		vals := censusValues[f.Type.Kind()]
		if len(vals) == 0 {
			t.Fatalf("CensusEvent.%s: no test values for %s", f.Name, f.Type)
		}
		for _, over := range []CensusEvent{{}, full} {
			for _, v := range vals {
				e := over
				reflect.ValueOf(&e).Elem().Field(i).Set(reflect.ValueOf(v))
				got, err := EncodeCensus(e)
				if err != nil {
					t.Fatalf("%s = %#v: %v", f.Name, v, err)
				}
				want, err := encodeDoc(KindCensusEvent, &e)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("%s = %#v: EncodeCensus wrote\n%s\nencoding/json\n%s", f.Name, v, got, want)
				}
				back, err := DecodeCensus(got)
				if err != nil || !reflect.DeepEqual(back, e) {
					t.Fatalf("%s = %#v: DecodeCensus read %+v (%v), want %+v", f.Name, v, back, err, e)
				}
				slow, err := decodeDoc[CensusEvent](KindCensusEvent, got)
				if err != nil || !reflect.DeepEqual(slow, e) {
					t.Fatalf("%s = %#v: encoding/json read %+v (%v), want %+v", f.Name, v, slow, err, e)
				}
			}
		}
	}
}

// BenchmarkCensus compares the fast path with encoding/json in one run, on
// the event most stages write (plain ids, a few numbers, no reward) and on
// one with every field set (a reward and escaped text: the decoder's
// fallback to encoding/json).
func BenchmarkCensus(b *testing.B) {
	typical := CensusEvent{EventID: DerivedID("census/admitted", "a1"), RunID: "run-7", AttemptID: "0123456789abcdef0123456789abcdef",
		TaskID: "task-17", GroupID: "fedcba9876543210fedcba9876543210", Kind: CensusAdmitted, Stage: "pack",
		BatchID: "batch-3", PolicyVersion: 12, Tokens: 2048, LatencyUS: 1500, At: 1700000000000000}
	for _, ev := range []struct {
		name string
		e    CensusEvent
	}{{"typical", typical}, {"all-fields", sampleCensus()}} {
		doc, err := EncodeCensus(ev.e)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(ev.name+"/encode/fast", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := EncodeCensus(ev.e); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(ev.name+"/encode/encoding-json", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := encodeDoc(KindCensusEvent, &ev.e); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(ev.name+"/decode/fast", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := DecodeCensus(doc); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(ev.name+"/decode/encoding-json", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := decodeDoc[CensusEvent](KindCensusEvent, doc); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
