package bench

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/trajflow/trajflow/pipeline"
)

// instance is one operator instance of a stage; its wrapper counts what
// passes through the stage's pure function.
type instance struct {
	stage  string
	id     string
	groups *sync.Map // group id -> *groupInfo, the source's record of what it produced
	// policyTopic, when set, is the policy topic: policySeen closes once
	// the stage has processed a message from it.
	policyTopic string
	policySeen  chan struct{}
	policyOnce  sync.Once

	msgs, rows, tokens, bytesIn, bytesOut, procNanos atomic.Int64

	// wait is the time from a message's production (its Kafka timestamp)
	// to the stage's Process call: the hop's latency.
	waitMu sync.Mutex
	wait   *histogram
}

type instanceStats struct {
	msgs, rows, tokens, bytesIn, bytesOut, procNanos int64
	// cpuNanos is the CPU time of the instance's process (operators in
	// processes only: in process they share one).
	cpuNanos int64
}

func (in *instance) load() instanceStats {
	return instanceStats{
		msgs: in.msgs.Load(), rows: in.rows.Load(), tokens: in.tokens.Load(),
		bytesIn: in.bytesIn.Load(), bytesOut: in.bytesOut.Load(), procNanos: in.procNanos.Load(),
	}
}

func (s instanceStats) sub(o instanceStats) instanceStats {
	return instanceStats{s.msgs - o.msgs, s.rows - o.rows, s.tokens - o.tokens, s.bytesIn - o.bytesIn, s.bytesOut - o.bytesOut, s.procNanos - o.procNanos, s.cpuNanos - o.cpuNanos}
}

func (s instanceStats) add(o instanceStats) instanceStats {
	return instanceStats{s.msgs + o.msgs, s.rows + o.rows, s.tokens + o.tokens, s.bytesIn + o.bytesIn, s.bytesOut + o.bytesOut, s.procNanos + o.procNanos, s.cpuNanos + o.cpuNanos}
}

// hook returns the instance as the operator's process hook (pipeline.Hook).
func (in *instance) hook() pipeline.Hook {
	in.wait = newHistogram()
	return in
}

// resetWait starts a new hop-latency histogram and returns the old one.
func (in *instance) resetWait() *histogram {
	in.waitMu.Lock()
	defer in.waitMu.Unlock()
	h := in.wait
	in.wait = newHistogram()
	return h
}

// OnProcess implements pipeline.ProcessHook: every message's size, the
// tokens and rows of the group it carries (messages of every data topic
// are keyed by group id), the bytes of the outputs and the time spent in
// the stage (Process, Tick and Flush).
func (in *instance) OnProcess(_ string, m *pipeline.Message, res *pipeline.Result, _ error, took time.Duration) {
	in.procNanos.Add(int64(took))
	var out int64
	for i := range res.Outputs {
		out += int64(len(res.Outputs[i].Value) + len(res.Outputs[i].Key))
	}
	in.bytesOut.Add(out)
	if m == nil {
		return
	}
	in.msgs.Add(1)
	if !m.Time.IsZero() {
		start := time.Now().Add(-took)
		in.waitMu.Lock()
		in.wait.add(float64(start.Sub(m.Time).Microseconds()) / 1e3)
		in.waitMu.Unlock()
	}
	if in.policyTopic != "" && m.Topic == in.policyTopic {
		in.policyOnce.Do(func() { close(in.policySeen) })
	}
	in.bytesIn.Add(int64(len(m.Value) + len(m.Key)))
	if v, ok := in.groups.Load(string(m.Key)); ok {
		gi := v.(*groupInfo)
		in.rows.Add(int64(gi.rows))
		in.tokens.Add(gi.tokens)
	}
}
