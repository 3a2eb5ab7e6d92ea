package schemas

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
)

// Census events are the most frequent control-plane documents (one or more
// per attempt), so they have a fast path on both sides. EncodeCensus writes
// the bytes encoding/json writes for the same document (compact, fields in
// declaration order, omitempty); DecodeCensus reads that canonical form
// directly and hands anything else (escapes, non-ASCII, other spacing or
// order, a reward value, errors) to the strict encoding/json decoder, so
// what it accepts and returns never differs from the general path.

// censusField is one field of CensusEvent in declaration order.
type censusField struct {
	key  string
	kind byte // 's' string, 'i' int64, 'b' bool, 'f' float64
	str  func(e *CensusEvent) *string
	num  func(e *CensusEvent) *int64
	omit bool // omitempty
}

var censusFields = []censusField{
	{key: "event_id", kind: 's', str: func(e *CensusEvent) *string { return &e.EventID }},
	{key: "run_id", kind: 's', str: func(e *CensusEvent) *string { return &e.RunID }},
	{key: "attempt_id", kind: 's', str: func(e *CensusEvent) *string { return &e.AttemptID }},
	{key: "task_id", kind: 's', str: func(e *CensusEvent) *string { return &e.TaskID }, omit: true},
	{key: "group_id", kind: 's', str: func(e *CensusEvent) *string { return &e.GroupID }, omit: true},
	{key: "kind", kind: 's', str: func(e *CensusEvent) *string { return &e.Kind }},
	{key: "stage", kind: 's', str: func(e *CensusEvent) *string { return &e.Stage }},
	{key: "reason", kind: 's', str: func(e *CensusEvent) *string { return &e.Reason }, omit: true},
	{key: "infra", kind: 'b', omit: true},
	{key: "batch_id", kind: 's', str: func(e *CensusEvent) *string { return &e.BatchID }, omit: true},
	{key: "update", kind: 'i', num: func(e *CensusEvent) *int64 { return &e.Update }, omit: true},
	{key: "policy_version", kind: 'i', num: func(e *CensusEvent) *int64 { return &e.PolicyVersion }, omit: true},
	{key: "tokens", kind: 'i', num: func(e *CensusEvent) *int64 { return &e.Tokens }, omit: true},
	{key: "stale_tokens", kind: 'i', num: func(e *CensusEvent) *int64 { return &e.StaleTokens }, omit: true},
	{key: "reward", kind: 'f', omit: true},
	{key: "latency_us", kind: 'i', num: func(e *CensusEvent) *int64 { return &e.LatencyUS }, omit: true},
	{key: "at_us", kind: 'i', num: func(e *CensusEvent) *int64 { return &e.At }},
}

// censusPrefix opens the document of the current census version.
var censusPrefix = []byte(`{"kind":"` + string(KindCensusEvent) + `","version":` + strconv.Itoa(Versions[KindCensusEvent]) + `,"data":{`)

// plainJSON reports whether encoding/json writes s between quotes as is:
// printable ASCII other than the quote, the backslash and the HTML
// characters it escapes.
func plainJSON(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			return false
		}
	}
	return true
}

// EncodeCensus returns the JSON document of a census event. A NaN or
// infinite Reward cannot be written as JSON and is an error.
func EncodeCensus(e CensusEvent) ([]byte, error) {
	if math.IsNaN(e.Reward) || math.IsInf(e.Reward, 0) {
		return encodeDoc(KindCensusEvent, &e) // its error: not representable in JSON
	}
	b := make([]byte, 0, 320)
	b = append(b, censusPrefix...)
	first := true
	for i := range censusFields {
		f := &censusFields[i]
		if f.omit && f.empty(&e) {
			continue
		}
		if !first {
			b = append(b, ',')
		}
		first = false
		b = append(append(append(b, '"'), f.key...), `":`...)
		b = f.appendValue(b, &e)
	}
	return append(b, "}}"...), nil
}

// empty reports whether the field holds its zero value (omitted).
func (f *censusField) empty(e *CensusEvent) bool {
	switch f.kind {
	case 's':
		return *f.str(e) == ""
	case 'i':
		return *f.num(e) == 0
	case 'b':
		return !e.Infra
	default:
		return e.Reward == 0
	}
}

// appendValue appends the field's value as encoding/json writes it.
func (f *censusField) appendValue(b []byte, e *CensusEvent) []byte {
	switch f.kind {
	case 's':
		if s := *f.str(e); plainJSON(s) {
			return append(append(append(b, '"'), s...), '"')
		}
		q, _ := json.Marshal(*f.str(e)) // a string always encodes
		return append(b, q...)
	case 'i':
		return strconv.AppendInt(b, *f.num(e), 10)
	case 'b':
		return strconv.AppendBool(b, e.Infra)
	default:
		q, _ := json.Marshal(e.Reward) // finite: checked by EncodeCensus
		return append(b, q...)
	}
}

// DecodeCensus reads a document written by EncodeCensus.
func DecodeCensus(b []byte) (CensusEvent, error) {
	if e, ok := decodeCensusCanonical(b); ok {
		return e, nil
	}
	return decodeDoc[CensusEvent](KindCensusEvent, b)
}

// decodeCensusCanonical reads the exact form EncodeCensus writes for an
// event without a reward and with plain strings; ok is false for anything
// else.
func decodeCensusCanonical(b []byte) (e CensusEvent, ok bool) {
	if !bytes.HasPrefix(b, censusPrefix) {
		return e, false
	}
	p := len(censusPrefix)
	first := true
	for i := range censusFields {
		f := &censusFields[i]
		q := p
		if !first {
			if q >= len(b) || b[q] != ',' {
				if f.omit {
					continue
				}
				return e, false
			}
			q++
		}
		if q+len(f.key)+3 > len(b) || b[q] != '"' || string(b[q+1:q+1+len(f.key)]) != f.key || b[q+1+len(f.key)] != '"' || b[q+2+len(f.key)] != ':' {
			if f.omit {
				continue
			}
			return e, false
		}
		q += len(f.key) + 3
		switch f.kind {
		case 's':
			if q >= len(b) || b[q] != '"' {
				return e, false
			}
			end := q + 1
			for end < len(b) && b[end] != '"' {
				end++
			}
			if end >= len(b) {
				return e, false
			}
			s := string(b[q+1 : end])
			if (f.omit && s == "") || !plainJSON(s) {
				return e, false
			}
			*f.str(&e) = s
			q = end + 1
		case 'i':
			end := q
			if end < len(b) && b[end] == '-' {
				end++
			}
			digits := end
			for end < len(b) && b[end] >= '0' && b[end] <= '9' {
				end++
			}
			if end == digits || (b[digits] == '0' && end-digits > 1) {
				return e, false
			}
			n, err := strconv.ParseInt(string(b[q:end]), 10, 64)
			if err != nil || (f.omit && n == 0) || (n == 0 && b[q] == '-') {
				return e, false
			}
			*f.num(&e) = n
			q = end
		case 'b':
			if !bytes.HasPrefix(b[q:], []byte("true")) {
				return e, false
			}
			e.Infra = true
			q += 4
		case 'f':
			return e, false // rare: left to encoding/json
		}
		p, first = q, false
	}
	if string(b[p:]) != "}}" {
		return CensusEvent{}, false
	}
	return e, true
}
