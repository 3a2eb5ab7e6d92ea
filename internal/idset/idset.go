// Package idset holds large sets of record and group ids in memory the
// garbage collector does not scan.
//
// A deduplication memory of a million ids kept as Go strings costs the
// collector a million objects to mark on every cycle: in a long
// `trajflow bench` run the pack stage's memory of 2^20 decided ids cut the
// end-to-end rate by a fifth once it was full. Every id trajflow derives
// (schemas: 32 lowercase hex digits of a SHA-256) is kept here as its 16
// bytes, in maps and rings without pointers; any other id is kept by a
// 16-byte SHA-256 prefix next to its string, so membership is exact for
// derived ids and exact up to SHA-256 collisions for the rest.
package idset

import (
	"crypto/sha256"
)

// Key is an id as the set stores it; it holds no pointer.
type Key struct {
	b     [16]byte
	other bool // not a derived id: b is a SHA-256 prefix of the id
}

// KeyOf returns the key of id.
func KeyOf(id string) Key {
	if b, ok := decodeHex(id); ok {
		return Key{b: b}
	}
	sum := sha256.Sum256([]byte(id))
	var k Key
	copy(k.b[:], sum[:16])
	k.other = true
	return k
}

// decodeHex decodes 32 lowercase hex digits (the only spelling of a
// derived id, so distinct strings never share a key).
func decodeHex(id string) (b [16]byte, ok bool) {
	if len(id) != 32 {
		return b, false
	}
	for i := 0; i < 16; i++ {
		hi, ok1 := nibble(id[2*i])
		lo, ok2 := nibble(id[2*i+1])
		if !ok1 || !ok2 {
			return b, false
		}
		b[i] = hi<<4 | lo
	}
	return b, true
}

func nibble(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10, true
	}
	return 0, false
}

// Set is a set of ids, each with a uint64 value (0 unless Put gives one:
// a fingerprint of what the id was decided on, for example). The zero value
// is not usable; call New. A Set is not safe for concurrent use.
type Set struct {
	derived map[[16]byte]uint64
	other   map[[16]byte]otherID // SHA-256 prefix -> id
}

type otherID struct {
	id string
	v  uint64
}

// New returns an empty set.
func New() *Set {
	return &Set{derived: make(map[[16]byte]uint64), other: make(map[[16]byte]otherID)}
}

// Add adds id with value 0 and returns its key.
func (s *Set) Add(id string) Key { return s.Put(id, 0) }

// Put adds id with value v (replacing the value of an id already there)
// and returns its key.
func (s *Set) Put(id string, v uint64) Key {
	k := KeyOf(id)
	if k.other {
		s.other[k.b] = otherID{id: id, v: v}
	} else {
		s.derived[k.b] = v
	}
	return k
}

// Has reports whether id is in the set.
func (s *Set) Has(id string) bool { return s.HasKey(KeyOf(id), id) }

// HasKey is Has for a key computed once with KeyOf(id).
func (s *Set) HasKey(k Key, id string) bool {
	_, ok := s.get(k, id)
	return ok
}

// Get returns the value of id and whether id is in the set.
func (s *Set) Get(id string) (uint64, bool) { return s.get(KeyOf(id), id) }

func (s *Set) get(k Key, id string) (uint64, bool) {
	if k.other {
		got, ok := s.other[k.b]
		return got.v, ok && got.id == id
	}
	v, ok := s.derived[k.b]
	return v, ok
}

// Delete removes the id of key k.
func (s *Set) Delete(k Key) {
	if k.other {
		delete(s.other, k.b)
	} else {
		delete(s.derived, k.b)
	}
}

// Len is the number of ids in the set.
func (s *Set) Len() int { return len(s.derived) + len(s.other) }

// Ring is a FIFO of at most a fixed number of keys: the order in which a
// bounded memory forgets its oldest ids.
type Ring struct {
	keys []Key
	head int
	n    int
}

// NewRing returns an empty ring of capacity n (at least 1).
func NewRing(n int) *Ring { return &Ring{n: max(n, 1)} }

// Push appends k. When the ring was full it drops its oldest key and
// returns it with dropped = true.
func (r *Ring) Push(k Key) (oldest Key, dropped bool) {
	if len(r.keys) < r.n {
		r.keys = append(r.keys, k)
		return Key{}, false
	}
	oldest = r.keys[r.head]
	r.keys[r.head] = k
	r.head = (r.head + 1) % r.n
	return oldest, true
}
