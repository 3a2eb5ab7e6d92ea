package zmqpeer

import (
	"slices"
	"time"

	"github.com/trajflow/trajflow/bench/peers"
	"github.com/trajflow/trajflow/internal/gate"
)

// ledger is the rollout side's record of every group it sent: the closed
// loop (at most window groups sent and not yet acknowledged), what reached
// the trainer, the latency, and what was lost. Groups are numbered from 0;
// group g carries the corpus's group g mod N.
type ledger struct {
	cp          *peers.Corpus
	window      int
	lossTimeout time.Duration
	now         func() time.Time

	next         int64
	inflight     map[int64]int64 // group -> sent at (Unix ns)
	presumedLost map[int64]bool  // timed out: slot freed
	decided      map[int64]bool
	late         int64 // acknowledged after their slot timed out
	duplicates   int64
	measuring    bool
	wGroups      int64
	wBatches     int64
	wTokens      int64
	wAction      int64
	wBytes       int64
	wLatencyMS   []float64
}

func newLedger(cp *peers.Corpus, window int, lossTimeout time.Duration) *ledger {
	return &ledger{cp: cp, window: window, lossTimeout: lossTimeout, now: time.Now,
		inflight: map[int64]int64{}, presumedLost: map[int64]bool{}, decided: map[int64]bool{}}
}

// resetWindow starts the measurement window's counts.
func (l *ledger) resetWindow() {
	l.wGroups, l.wBatches, l.wTokens, l.wAction, l.wBytes = 0, 0, 0, 0, 0
	l.wLatencyMS = l.wLatencyMS[:0]
}

// free is how many groups the closed loop may send now.
func (l *ledger) free() int { return l.window - len(l.inflight) }

// launch records the next group as sent now.
func (l *ledger) launch() (group, sentNS int64) {
	group, sentNS = l.next, l.now().UnixNano()
	l.next++
	l.inflight[group] = sentNS
	return group, sentNS
}

// batch records a batch of size bytes that reached the trainer at recvNS
// holding the groups hs.
func (l *ledger) batch(hs []groupHeader, size, recvNS int64) {
	if l.measuring {
		l.wBatches++
		l.wBytes += size
	}
	n := int64(len(l.cp.Groups))
	for _, h := range hs {
		if l.decided[h.group] {
			l.duplicates++
			continue
		}
		l.decided[h.group] = true
		if _, ok := l.inflight[h.group]; ok {
			delete(l.inflight, h.group)
		} else if l.presumedLost[h.group] {
			delete(l.presumedLost, h.group)
			l.late++
		}
		if l.measuring {
			g := &l.cp.Groups[h.group%n]
			l.wGroups++
			l.wTokens += g.Tokens
			l.wAction += g.Action
			l.wBytes += g.Bytes
			l.wLatencyMS = append(l.wLatencyMS, float64(recvNS-h.sent)/1e6)
		}
	}
}

// expire frees the slots of the groups in flight longer than lossTimeout:
// an in-memory pipeline never tells the rollout side it dropped them.
func (l *ledger) expire(nowNS int64) int {
	n := 0
	for g, sent := range l.inflight {
		if time.Duration(nowNS-sent) > l.lossTimeout {
			delete(l.inflight, g)
			l.presumedLost[g] = true
			n++
		}
	}
	return n
}

// summarize fills rep's window figures.
func (l *ledger) summarize(rep *peers.PeerReport, window, cpu time.Duration) {
	w, c := window.Seconds(), cpu.Seconds()
	rep.WindowS, rep.Groups, rep.Batches = w, l.wGroups, l.wBatches
	rep.TokensPerS = float64(l.wTokens) / w
	rep.ActionTokensPerS = float64(l.wAction) / w
	rep.MBPerS = float64(l.wBytes) / w / 1e6
	rep.CPUS, rep.CPUCores = c, c/w
	if c > 0 {
		rep.MBPerCPUS = float64(l.wBytes) / c / 1e6
	}
	rep.Latency = peers.PeerLatency{Count: len(l.wLatencyMS)}
	if len(l.wLatencyMS) > 0 {
		rep.Latency.P50, _ = gate.Quantile(l.wLatencyMS, 0.50)
		rep.Latency.P90, _ = gate.Quantile(l.wLatencyMS, 0.90)
		rep.Latency.P99, _ = gate.Quantile(l.wLatencyMS, 0.99)
		rep.Latency.Max = slices.Max(l.wLatencyMS)
	}
}
