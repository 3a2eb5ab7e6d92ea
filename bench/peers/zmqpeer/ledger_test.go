package zmqpeer

import (
	"testing"
	"time"

	"github.com/trajflow/trajflow/bench/peers"
)

// TestLedger follows three groups by hand: two acknowledged in one batch,
// a duplicate acknowledgement, one presumed lost at its timeout and then
// acknowledged late; the window's figures are computed by hand.
func TestLedger(t *testing.T) {
	cp := &peers.Corpus{Groups: []peers.CorpusGroup{
		{Tokens: 100, Action: 60, Bytes: 4000},
		{Tokens: 200, Action: 150, Bytes: 7000},
	}}
	clock := time.Unix(0, 0)
	l := newLedger(cp, 3, time.Second)
	l.now = func() time.Time { return clock }
	l.measuring = true
	var sent []groupHeader
	for l.free() > 0 {
		g, at := l.launch()
		sent = append(sent, groupHeader{group: g, sent: at})
	}
	if len(sent) != 3 || sent[2].group != 2 {
		t.Fatalf("launched %+v, want groups 0..2", sent)
	}
	ms := int64(time.Millisecond)
	l.batch(sent[:2], 1000, 10*ms)
	l.batch(sent[:1], 1000, 20*ms) // redelivered: a duplicate, no bytes of its group again
	if l.duplicates != 1 || len(l.inflight) != 1 || l.free() != 2 {
		t.Fatalf("duplicates %d in flight %d free %d, want 1 1 2", l.duplicates, len(l.inflight), l.free())
	}
	if n := l.expire(int64(500 * time.Millisecond)); n != 0 {
		t.Fatalf("expired %d groups before their timeout", n)
	}
	if n := l.expire(int64(2 * time.Second)); n != 1 || !l.presumedLost[2] || l.free() != 3 {
		t.Fatalf("expire: %d groups, presumed lost %v, free %d", n, l.presumedLost, l.free())
	}
	l.batch(sent[2:], 500, int64(2500*time.Millisecond)) // group 2 holds the corpus's group 0
	if l.late != 1 || len(l.presumedLost) != 0 || len(l.decided) != 3 {
		t.Fatalf("late %d presumed lost %d decided %d, want 1 0 3", l.late, len(l.presumedLost), len(l.decided))
	}
	var rep peers.PeerReport
	l.summarize(&rep, 2*time.Second, time.Second)
	// Bytes: batches 1000 + 1000 + 500, groups 4000 + 7000 + 4000 = 17500 over 2 s.
	// Tokens: 100 + 200 + 100 = 400; action 60 + 150 + 60 = 270.
	want := peers.PeerReport{WindowS: 2, Groups: 3, Batches: 3, TokensPerS: 200, ActionTokensPerS: 135,
		MBPerS: 17500 / 2 / 1e6, CPUS: 1, CPUCores: 0.5, MBPerCPUS: 17500 / 1e6,
		Latency: peers.PeerLatency{P50: 10, P90: 2500, P99: 2500, Max: 2500, Count: 3}}
	if rep.WindowS != want.WindowS || rep.Groups != want.Groups || rep.Batches != want.Batches || rep.TokensPerS != want.TokensPerS ||
		rep.ActionTokensPerS != want.ActionTokensPerS || rep.MBPerS != want.MBPerS || rep.CPUS != want.CPUS ||
		rep.CPUCores != want.CPUCores || rep.MBPerCPUS != want.MBPerCPUS || rep.Latency != want.Latency {
		t.Fatalf("summary\n got %+v\nwant %+v", rep, want)
	}
}

func TestReadHeaders(t *testing.T) {
	b := groupHeader{group: 7, sent: 42}.append(nil)
	b = groupHeader{group: 1 << 40, sent: -1}.append(b)
	hs, err := readHeaders(b, 2)
	if err != nil || len(hs) != 2 || hs[0] != (groupHeader{7, 42}) || hs[1] != (groupHeader{1 << 40, -1}) {
		t.Fatalf("readHeaders = %+v, %v", hs, err)
	}
	for _, c := range []struct {
		b     []byte
		count int
	}{{b[:20], 2}, {b, 3}, {b, -1}} {
		if _, err := readHeaders(c.b, c.count); err == nil {
			t.Fatalf("%d bytes read as %d headers without an error", len(c.b), c.count)
		}
	}
	if _, err := readHeader(b[:15]); err == nil {
		t.Fatal("a 15-byte header read without an error")
	}
}
