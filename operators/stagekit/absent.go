package stagekit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/trajflow/trajflow/pipeline"
)

// HeaderAbsent declares group members that were refused upstream and will
// never reach the advantage stage. Pipeline §9 asks validation for "group
// completeness or declared partial-group policy": a group that lost a
// member to quarantine can never complete, and without the declaration the
// advantage stage could only find that out by waiting for its
// partial-group timeout. With it, the group is closed (and scored or
// filtered under the partial-group policy) as soon as every other member
// is present.
//
// The value is a JSON object from group id to the refused member indices,
// e.g. {"g-17":[2,5]}; keys sorted, indices ascending and distinct.
const HeaderAbsent = "trajflow-absent-members"

// ReasonBadAbsent refuses a message whose HeaderAbsent does not parse.
const ReasonBadAbsent = "bad_absent_members"

// Absent maps a group id to member slots refused upstream.
type Absent map[string][]int32

// Add records that member of groupID was refused. Rows without a group id
// or with a member index outside [0, size) name no slot and are skipped.
func (a Absent) Add(groupID string, member, size int32) {
	if groupID == "" || member < 0 || member >= size {
		return
	}
	ms := a[groupID]
	if i, found := slices.BinarySearch(ms, member); !found {
		a[groupID] = slices.Insert(ms, i, member)
	}
}

// Header returns the HeaderAbsent header for a, and false when a is empty.
func (a Absent) Header() (pipeline.Header, bool) {
	if len(a) == 0 {
		return pipeline.Header{}, false
	}
	b, err := json.Marshal(map[string][]int32(a)) // keys sorted
	if err != nil {
		panic(fmt.Sprintf("stagekit: marshal absent members: %v", err)) // strings and int32s always marshal
	}
	return pipeline.Header{Key: HeaderAbsent, Value: b}, true
}

// AbsentOf parses m's HeaderAbsent (an empty Absent when there is none).
// A header that is not a JSON object of group ids to arrays of distinct
// non-negative member indices is refused with ReasonBadAbsent.
func AbsentOf(m *pipeline.Message) (Absent, error) {
	v := m.Header(HeaderAbsent)
	if v == nil {
		return Absent{}, nil
	}
	var raw map[string][]int32
	d := json.NewDecoder(bytes.NewReader(v))
	if err := d.Decode(&raw); err != nil {
		return nil, pipeline.Refuse(ReasonBadAbsent, "header %s: %v", HeaderAbsent, err)
	}
	if d.More() {
		return nil, pipeline.Refuse(ReasonBadAbsent, "header %s: data after the object", HeaderAbsent)
	}
	if raw == nil {
		return nil, pipeline.Refuse(ReasonBadAbsent, "header %s: not an object", HeaderAbsent)
	}
	a := make(Absent, len(raw))
	for g, ms := range raw {
		if g == "" {
			return nil, pipeline.Refuse(ReasonBadAbsent, "header %s: empty group id", HeaderAbsent)
		}
		for _, m := range ms {
			if m < 0 {
				return nil, pipeline.Refuse(ReasonBadAbsent, "header %s: group %q: member %d", HeaderAbsent, g, m)
			}
			if slices.Contains(a[g], m) {
				return nil, pipeline.Refuse(ReasonBadAbsent, "header %s: group %q: member %d twice", HeaderAbsent, g, m)
			}
			a.Add(g, m, m+1)
		}
	}
	return a, nil
}

// WithAbsent appends a's header to out's headers when a is not empty.
func WithAbsent(out pipeline.Output, a Absent) pipeline.Output {
	if h, ok := a.Header(); ok {
		out.Headers = append(out.Headers, h)
	}
	return out
}
