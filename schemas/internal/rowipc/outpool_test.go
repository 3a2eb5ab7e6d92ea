package rowipc

import "testing"

func TestOutClass(t *testing.T) {
	for _, c := range []struct{ n, want int }{
		{0, 0}, {1000, 0}, {64<<10 - 1, 0}, {64 << 10, 64 << 10}, {64<<10 + 1, 80 << 10},
		{100 << 10, 112 << 10}, {128 << 10, 128 << 10}, {17825792, 20 << 20}, {(20 << 20) + 1, 24 << 20},
	} {
		got := outClass(c.n)
		if got != c.want {
			t.Errorf("outClass(%d) = %d, want %d", c.n, got, c.want)
		}
		if got != 0 && (got < c.n || outClass(got) != got || got > c.n+c.n/4+1) {
			t.Errorf("outClass(%d) = %d: not a class covering n within 25%%", c.n, got)
		}
	}
}

func TestOutPoolReusesWithinItsLimit(t *testing.T) {
	p := &outPool{free: map[int][][]byte{}, limit: 200 << 10}
	a := p.get(70 << 10)
	if cap(a) != 80<<10 || len(a) != 0 {
		t.Fatalf("get: len %d cap %d", len(a), cap(a))
	}
	a = append(a, "payload"...)
	p.put(a)
	b := p.get(65 << 10)
	if cap(b) != 80<<10 || &b[:1][0] != &a[:1][0] {
		t.Fatal("a freed buffer of the class was not reused")
	}
	p.put(b)
	p.put(make([]byte, 0, 96<<10))
	p.put(make([]byte, 0, 112<<10)) // over the limit: dropped
	if p.bytes != 176<<10 {
		t.Fatalf("pool holds %d bytes, want %d", p.bytes, 176<<10)
	}
	p.put(make([]byte, 0, 100<<10)) // not a class size: dropped
	if small := p.get(10); cap(small) != 10 {
		t.Fatalf("small get: cap %d", cap(small))
	}
	if len(p.free[112<<10]) != 0 || len(p.free[96<<10]) != 1 {
		t.Fatalf("free lists %v", p.free)
	}
}
