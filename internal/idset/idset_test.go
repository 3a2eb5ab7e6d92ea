package idset

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"reflect"
	"runtime"
	"testing"
	"time"
)

func derived(i int) string {
	sum := sha256.Sum256([]byte(fmt.Sprint(i)))
	return hex.EncodeToString(sum[:16])
}

func TestKeyOf(t *testing.T) {
	id := derived(1)
	cases := []struct {
		name  string
		id    string
		other bool
	}{
		{"derived id", id, false},
		{"all digits", "01234567890123456789012345678901", false},
		{"upper case hex", "0123456789ABCDEF0123456789ABCDEF", true},
		{"31 digits", id[:31], true},
		{"33 digits", id + "0", true},
		{"not hex", "g" + id[1:], true},
		{"empty", "", true},
		{"free text", "task-7/member-3", true},
	}
	for _, tc := range cases {
		k := KeyOf(tc.id)
		if k.other != tc.other {
			t.Errorf("%s: other = %v, want %v", tc.name, k.other, tc.other)
		}
		if !tc.other && hex.EncodeToString(k.b[:]) != tc.id {
			t.Errorf("%s: key %x does not spell %s", tc.name, k.b, tc.id)
		}
	}
}

func TestSet(t *testing.T) {
	s := New()
	a, b := derived(1), derived(2)
	upper := "0123456789ABCDEF0123456789ABCDEF"
	lower := "0123456789abcdef0123456789abcdef"
	for _, id := range []string{a, "free text", upper} {
		s.Add(id)
	}
	for _, tc := range []struct {
		id   string
		want bool
	}{
		{a, true}, {b, false}, {"free text", true}, {"free text ", false}, {upper, true},
		{lower, false}, // same bytes as upper when decoded, a different id
	} {
		if got := s.Has(tc.id); got != tc.want {
			t.Errorf("Has(%q) = %v, want %v", tc.id, got, tc.want)
		}
	}
	if s.Len() != 3 {
		t.Errorf("Len = %d, want 3", s.Len())
	}
	s.Delete(KeyOf(a))
	s.Delete(KeyOf("free text"))
	s.Delete(KeyOf(b)) // absent: no effect
	if s.Has(a) || s.Has("free text") || !s.Has(upper) || s.Len() != 1 {
		t.Errorf("after deletes: Has(a)=%v Has(free text)=%v Has(upper)=%v Len=%d", s.Has(a), s.Has("free text"), s.Has(upper), s.Len())
	}
	if k := s.Add(b); !s.HasKey(k, b) {
		t.Error("HasKey with the key Add returned is false")
	}
	// Values: 0 from Add, replaced by Put, per id (a hashed id's value is
	// never read for another id of the same prefix).
	for _, id := range []string{b, "free text"} {
		if v, ok := s.Get(id); ok != (id == b) || v != 0 {
			t.Errorf("Get(%q) = %d, %v before Put", id, v, ok)
		}
		s.Put(id, 7)
		s.Put(id, 9)
		if v, ok := s.Get(id); !ok || v != 9 {
			t.Errorf("Get(%q) = %d, %v after Put 9", id, v, ok)
		}
	}
	if v, ok := s.Get("free text "); ok || v != 0 {
		t.Errorf("Get of an absent id = %d, %v", v, ok)
	}
}

// TestKeysHoldNoPointers: the point of the package is memory the garbage
// collector does not scan.
func TestKeysHoldNoPointers(t *testing.T) {
	m := reflect.TypeOf(New().derived)
	for _, typ := range []reflect.Type{reflect.TypeFor[Key](), m.Key(), m.Elem()} {
		if hasPointers(typ) {
			t.Errorf("%v holds pointers", typ)
		}
	}
}

func hasPointers(t reflect.Type) bool {
	switch t.Kind() {
	case reflect.Array:
		return hasPointers(t.Elem())
	case reflect.Struct:
		for i := range t.NumField() {
			if hasPointers(t.Field(i).Type) {
				return true
			}
		}
		return false
	case reflect.Bool, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr,
		reflect.Float32, reflect.Float64, reflect.Complex64, reflect.Complex128:
		return false
	}
	return true
}

// BenchmarkCollectWithIDs reports how long a full collection takes with a
// million derived ids remembered, kept as a set of strings with a FIFO of
// strings (as before) or as a Set with a FIFO of Keys.
func BenchmarkCollectWithIDs(b *testing.B) {
	const n = 1 << 20
	b.Run("strings", func(b *testing.B) {
		set := make(map[string]struct{}, n)
		ring := make([]string, n)
		for i := range n {
			id := derived(i)
			set[id] = struct{}{}
			ring[i] = id
		}
		benchCollect(b)
		runtime.KeepAlive(set)
		runtime.KeepAlive(ring)
	})
	b.Run("idset", func(b *testing.B) {
		set := New()
		ring := make([]Key, n)
		for i := range n {
			ring[i] = set.Add(derived(i))
		}
		benchCollect(b)
		runtime.KeepAlive(set)
		runtime.KeepAlive(ring)
	})
}

func benchCollect(b *testing.B) {
	runtime.GC()
	var total time.Duration
	for b.Loop() {
		t0 := time.Now()
		runtime.GC()
		total += time.Since(t0)
	}
	b.ReportMetric(float64(total.Microseconds())/float64(b.N), "µs/GC")
}

// TestRing: a full ring drops its oldest key for each new one, in order.
func TestRing(t *testing.T) {
	r := NewRing(3)
	keys := make([]Key, 6)
	for i := range keys {
		keys[i] = KeyOf(derived(i))
	}
	for i, k := range keys {
		oldest, dropped := r.Push(k)
		if want := i >= 3; dropped != want {
			t.Fatalf("push %d: dropped = %v, want %v", i, dropped, want)
		}
		if dropped && oldest != keys[i-3] {
			t.Fatalf("push %d dropped %x, want %x (the oldest)", i, oldest.b, keys[i-3].b)
		}
	}
	if _, dropped := NewRing(0).Push(keys[0]); dropped {
		t.Fatal("a ring of capacity 0 holds one key (capacity at least 1)")
	}
}
