package stagekit

import (
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// ReasonBadAbsent refuses a message whose schemas.HeaderAbsent does not
// parse.
const ReasonBadAbsent = "bad_absent_members"

// Absent maps a group id to member slots refused upstream (the value of
// schemas.HeaderAbsent).
type Absent = schemas.AbsentMembers

// AbsentOf parses m's absent-members header (an empty Absent when there
// is none); a header that does not parse is refused with ReasonBadAbsent.
func AbsentOf(m *pipeline.Message) (Absent, error) {
	v := m.Header(schemas.HeaderAbsent)
	if v == nil {
		return Absent{}, nil
	}
	a, err := schemas.DecodeAbsent(v)
	if err != nil {
		return nil, pipeline.Refuse(ReasonBadAbsent, "%v", err)
	}
	return a, nil
}

// AbsentHeader returns the absent-members header of a, and false when a
// declares no member.
func AbsentHeader(a Absent) (pipeline.Header, bool) {
	for _, ms := range a {
		if len(ms) > 0 {
			return pipeline.Header{Key: schemas.HeaderAbsent, Value: schemas.EncodeAbsent(a)}, true
		}
	}
	return pipeline.Header{}, false
}

// WithAbsent appends a's header to out's headers when a is not empty.
func WithAbsent(out pipeline.Output, a Absent) pipeline.Output {
	if h, ok := AbsentHeader(a); ok {
		out.Headers = append(out.Headers, h)
	}
	return out
}
