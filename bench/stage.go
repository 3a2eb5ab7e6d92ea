package bench

import (
	"context"
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
}

func (in *instance) load() instanceStats {
	return instanceStats{
		msgs: in.msgs.Load(), rows: in.rows.Load(), tokens: in.tokens.Load(),
		bytesIn: in.bytesIn.Load(), bytesOut: in.bytesOut.Load(), procNanos: in.procNanos.Load(),
	}
}

func (s instanceStats) sub(o instanceStats) instanceStats {
	return instanceStats{s.msgs - o.msgs, s.rows - o.rows, s.tokens - o.tokens, s.bytesIn - o.bytesIn, s.bytesOut - o.bytesOut, s.procNanos - o.procNanos}
}

func (s instanceStats) add(o instanceStats) instanceStats {
	return instanceStats{s.msgs + o.msgs, s.rows + o.rows, s.tokens + o.tokens, s.bytesIn + o.bytesIn, s.bytesOut + o.bytesOut, s.procNanos + o.procNanos}
}

func (in *instance) wrap(st pipeline.Stage) pipeline.Stage {
	in.wait = newHistogram()
	return &counted{Stage: st, in: in}
}

// resetWait starts a new hop-latency histogram and returns the old one.
func (in *instance) resetWait() *histogram {
	in.waitMu.Lock()
	defer in.waitMu.Unlock()
	h := in.wait
	in.wait = newHistogram()
	return h
}

// counted wraps a stage: every message's size, the tokens and rows of the
// group it carries (messages of every data topic are keyed by group id),
// the bytes of its outputs and the time spent in Process. Start, Tick and
// Flush are forwarded when the stage has them.
type counted struct {
	pipeline.Stage
	in *instance
}

func (c *counted) Process(ctx context.Context, m pipeline.Message) (pipeline.Result, error) {
	t0 := time.Now()
	res, err := c.Stage.Process(ctx, m)
	c.in.procNanos.Add(int64(time.Since(t0)))
	c.in.msgs.Add(1)
	if !m.Time.IsZero() {
		c.in.waitMu.Lock()
		c.in.wait.add(float64(t0.Sub(m.Time).Microseconds()) / 1e3)
		c.in.waitMu.Unlock()
	}
	if c.in.policyTopic != "" && m.Topic == c.in.policyTopic {
		c.in.policyOnce.Do(func() { close(c.in.policySeen) })
	}
	c.in.bytesIn.Add(int64(len(m.Value) + len(m.Key)))
	if v, ok := c.in.groups.Load(string(m.Key)); ok {
		gi := v.(*groupInfo)
		c.in.rows.Add(int64(gi.rows))
		c.in.tokens.Add(gi.tokens)
	}
	var out int64
	for i := range res.Outputs {
		out += int64(len(res.Outputs[i].Value) + len(res.Outputs[i].Key))
	}
	c.in.bytesOut.Add(out)
	return res, err
}

func (c *counted) Start(ctx context.Context, env *pipeline.Env) error {
	if s, ok := c.Stage.(pipeline.Starter); ok {
		return s.Start(ctx, env)
	}
	return nil
}

func (c *counted) Tick(ctx context.Context, now time.Time) (pipeline.Result, error) {
	if t, ok := c.Stage.(pipeline.Ticker); ok {
		t0 := time.Now()
		res, err := t.Tick(ctx, now)
		c.in.procNanos.Add(int64(time.Since(t0)))
		c.countOut(res)
		return res, err
	}
	return pipeline.Result{}, nil
}

func (c *counted) Flush(ctx context.Context) (pipeline.Result, error) {
	if f, ok := c.Stage.(pipeline.Flusher); ok {
		return f.Flush(ctx)
	}
	return pipeline.Result{}, nil
}

func (c *counted) countOut(res pipeline.Result) {
	var out int64
	for i := range res.Outputs {
		out += int64(len(res.Outputs[i].Value) + len(res.Outputs[i].Key))
	}
	c.in.bytesOut.Add(out)
}
