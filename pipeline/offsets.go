package pipeline

import "sync"

// tracker follows, per partition, the offsets fetched and which of them are
// complete, and yields the highest offset below which everything is
// complete: the only offset that may be committed (a held or in-flight
// record blocks every later offset of its partition).
type tracker struct {
	mu    sync.Mutex
	parts map[partKey]*partState
}

type partKey struct {
	topic     string
	partition int
}

type partState struct {
	// pending holds fetched offsets in fetch order from head on; done marks
	// those complete. Entries before head are already committable.
	offsets   []int64
	done      []bool
	head      int
	lastSeen  int64
	committed int64 // next offset to consume as last committed (-1 unknown)
	ready     int64 // next offset to consume that may be committed (-1 none)
}

func newTracker() *tracker { return &tracker{parts: map[partKey]*partState{}} }

// seen registers a fetched offset. An offset at or below the last one seen
// means the partition was re-assigned and is being re-read from its
// committed offset: earlier bookkeeping for it is dropped.
func (t *tracker) seen(r Ref) {
	t.mu.Lock()
	defer t.mu.Unlock()
	k := partKey{r.Topic, r.Partition}
	p := t.parts[k]
	if p == nil {
		p = &partState{committed: -1, ready: -1, lastSeen: -1}
		t.parts[k] = p
	}
	if p.lastSeen >= 0 && r.Offset <= p.lastSeen {
		p.offsets, p.done, p.head = p.offsets[:0], p.done[:0], 0
		p.ready = -1
	}
	p.lastSeen = r.Offset
	p.offsets = append(p.offsets, r.Offset)
	p.done = append(p.done, false)
}

// complete marks r done. Unknown offsets (from before a re-assignment) are
// ignored: their outputs were acknowledged, and the re-read copy will be
// processed again.
func (t *tracker) complete(r Ref) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.parts[partKey{r.Topic, r.Partition}]
	if p == nil {
		return
	}
	// Offsets are increasing: binary search from head.
	lo, hi := p.head, len(p.offsets)
	for lo < hi {
		m := (lo + hi) / 2
		if p.offsets[m] < r.Offset {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if lo < len(p.offsets) && p.offsets[lo] == r.Offset {
		p.done[lo] = true
	}
	for p.head < len(p.offsets) && p.done[p.head] {
		p.ready = p.offsets[p.head] + 1
		p.head++
	}
	if p.head > 1024 && p.head*2 > len(p.offsets) {
		n := copy(p.offsets, p.offsets[p.head:])
		copy(p.done, p.done[p.head:])
		p.offsets, p.done, p.head = p.offsets[:n], p.done[:n], 0
	}
}

// commitPoint is a partition's next offset to consume, ready to commit.
type commitPoint struct {
	Ref // Offset is the next offset to consume
}

// committable returns the partitions whose ready offset advanced since the
// last markCommitted.
func (t *tracker) committable() []commitPoint {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []commitPoint
	for k, p := range t.parts {
		if p.ready > p.committed {
			out = append(out, commitPoint{Ref{k.topic, k.partition, p.ready}})
		}
	}
	return out
}

func (t *tracker) markCommitted(cs []commitPoint) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, c := range cs {
		if p := t.parts[partKey{c.Topic, c.Partition}]; p != nil && c.Offset > p.committed {
			p.committed = c.Offset
		}
	}
}

// pending returns the number of fetched records not yet complete.
func (t *tracker) pending() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, p := range t.parts {
		for i := p.head; i < len(p.offsets); i++ {
			if !p.done[i] {
				n++
			}
		}
	}
	return n
}
