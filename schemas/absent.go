package schemas

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
)

// AbsentMembers is the value of HeaderAbsent: group id -> member indices
// refused upstream (validate, reward) that will never reach the advantage
// stage. A group that lost a member to quarantine can never complete;
// with the declaration the advantage stage closes it (scored or filtered
// under the partial-group policy) as soon as every other member is
// present, instead of waiting for its partial-group timeout (docs/PIPELINE.md §9).
type AbsentMembers map[string][]int32

// Add records that member of groupID was refused. Rows without a group id
// or with a member index outside [0, size) name no slot and are skipped.
func (a AbsentMembers) Add(groupID string, member, size int32) {
	if groupID == "" || member < 0 || member >= size {
		return
	}
	ms := a[groupID]
	if i, found := slices.BinarySearch(ms, member); !found {
		a[groupID] = slices.Insert(ms, i, member)
	}
}

// EncodeAbsent returns the header value of a: a JSON object with sorted
// keys and ascending member indices, e.g. {"g-17":[2,5]}.
func EncodeAbsent(a AbsentMembers) []byte {
	b, err := json.Marshal(map[string][]int32(a)) // keys sorted
	if err != nil {
		panic(fmt.Sprintf("schemas: marshal absent members: %v", err)) // strings and int32s always marshal
	}
	return b
}

// DecodeAbsent parses a HeaderAbsent value: a JSON object of non-empty
// group ids to arrays of distinct non-negative member indices. Anything
// else wraps ErrDecode, naming what is wrong.
func DecodeAbsent(v []byte) (AbsentMembers, error) {
	var raw map[string][]int32
	d := json.NewDecoder(bytes.NewReader(v))
	if err := d.Decode(&raw); err != nil {
		return nil, fmt.Errorf("%w: header %s: %v", ErrDecode, HeaderAbsent, err)
	}
	if _, err := d.Token(); err != io.EOF {
		return nil, fmt.Errorf("%w: header %s: data after the object", ErrDecode, HeaderAbsent)
	}
	if raw == nil {
		return nil, fmt.Errorf("%w: header %s: not an object", ErrDecode, HeaderAbsent)
	}
	a := make(AbsentMembers, len(raw))
	for g, ms := range raw {
		if g == "" {
			return nil, fmt.Errorf("%w: header %s: empty group id", ErrDecode, HeaderAbsent)
		}
		for _, m := range ms {
			if m < 0 || m == math.MaxInt32 { // a range ends at m+1, which would wrap
				return nil, fmt.Errorf("%w: header %s: group %q: member %d", ErrDecode, HeaderAbsent, g, m)
			}
			if slices.Contains(a[g], m) {
				return nil, fmt.Errorf("%w: header %s: group %q: member %d twice", ErrDecode, HeaderAbsent, g, m)
			}
			a.Add(g, m, m+1)
		}
	}
	return a, nil
}
