package pipeline

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"
)

// DriveConfig configures Drive.
type DriveConfig struct {
	// QuarantineTopic names the topic of quarantine records in the outputs
	// (default "quarantine").
	QuarantineTopic string
	// MaxMessageBytes is the topics' record size limit (default 64 MiB).
	MaxMessageBytes int
	// Env is the stage's environment: its clock, state directory (""
	// keeps the state in memory), topic scanner (nil: every topic is
	// empty, as on a fresh cluster) and release store.
	Env EnvConfig
	// Side are side-input records (SideInputs), delivered in order before
	// the first input.
	Side []Message
	// TickAt, when not zero, ticks the stage (Ticker) once at that time
	// after the last input: what a live operator's clock would do later
	// (e.g. close groups past their partial-group timeout).
	TickAt time.Time
	// Flush calls the stage's Flush (Flusher) after the last input, as a
	// graceful stop of the live operator does.
	Flush bool
}

// Driven is what Drive produced.
type Driven struct {
	// Outputs are every output, quarantine records included, in the order
	// the stage returned them.
	Outputs []Output
	// Quarantined counts the inputs refused to quarantine.
	Quarantined int
	// Held lists the inputs still held when the drive ended (an open
	// window or group the live operator would keep uncommitted).
	Held []Ref
	// Released lists every ref a Result released, in order (a held input
	// must appear once).
	Released []Ref
	// Closed lists the inputs that were still held after the last input
	// and that the final Tick or Flush released (DriveConfig.TickAt,
	// Flush): what an offline run decided only because its input ended.
	Closed []Ref
}

// On returns the outputs produced to topic.
func (d *Driven) On(topic string) []Output {
	var out []Output
	for _, o := range d.Outputs {
		if o.Topic == topic {
			out = append(out, o)
		}
	}
	return out
}

// Messages returns the outputs produced to topic as the messages a
// consumer of the topic would read (partition 0, offsets 0, 1, ...): the
// input of the next stage offline.
func (d *Driven) Messages(topic string) []Message {
	return AsMessages(d.On(topic))
}

// AsMessages turns outputs of one topic into the messages a consumer would
// read (partition 0, offsets 0, 1, ...).
func AsMessages(outs []Output) []Message {
	msgs := make([]Message, len(outs))
	for i, o := range outs {
		msgs[i] = Message{Ref: Ref{Topic: o.Topic, Offset: int64(i)}, Key: o.Key, Value: o.Value, Headers: o.Headers}
	}
	return msgs
}

// Drive runs st over captured input messages through the same lifecycle
// and the same result handling as a live Operator — Start, side inputs,
// Process in order (a refusal becomes the quarantine record, an oversize
// output quarantines its input, held inputs stay held until released),
// the final Tick and Flush when asked, Close — with the outputs collected
// instead of produced. It is how `trajflow stage`, replay and tests run a
// stage offline: the decisions are the live stage's own. Output Release
// callbacks are not called (the values stay valid).
func Drive(ctx context.Context, st Stage, inputs []Message, cfg DriveConfig) (res *Driven, err error) {
	if cfg.QuarantineTopic == "" {
		cfg.QuarantineTopic = "quarantine"
	}
	oc := Config{QuarantineTopic: cfg.QuarantineTopic, MaxMessageBytes: cfg.MaxMessageBytes}
	oc.defaults()
	o := &Operator{cfg: oc, stage: st, m: oc.Metrics.forStage(st.Name(), "offline")}
	if cfg.Env.Scanner == nil {
		cfg.Env.Scanner = MemScanner{}
	}
	env := NewEnv(cfg.Env)
	defer func() {
		if cerr := closeStage(st, env); cerr != nil && err == nil {
			err = cerr
		}
	}()
	if s, ok := st.(Starter); ok {
		if err := s.Start(ctx, env); err != nil {
			return nil, fmt.Errorf("pipeline: start %s: %w", st.Name(), err)
		}
	}
	if si, ok := st.(SideInputs); ok {
		for _, m := range cfg.Side {
			if err := si.Side(ctx, m); err != nil {
				return nil, fmt.Errorf("pipeline: %s side input %s: %w", st.Name(), m.Ref, err)
			}
		}
	}
	d := &Driven{}
	held := map[Ref]bool{}
	apply := func(r Result, src *Message) error {
		outs, err := o.oversize(r.Outputs, src)
		if err != nil {
			return err
		}
		d.Outputs = append(d.Outputs, outs...)
		for _, ref := range r.Release {
			delete(held, ref)
		}
		d.Released = append(d.Released, r.Release...)
		return nil
	}
	for i := range inputs {
		m := inputs[i]
		r, perr := st.Process(ctx, m)
		if _, refused := AsRefusal(perr); refused {
			d.Quarantined++
		}
		r, _, err := o.outcome(&m, r, perr, nil)
		if err != nil {
			return nil, err
		}
		if r.Hold {
			held[m.Ref] = true
		}
		if err := apply(r, &m); err != nil {
			return nil, err
		}
	}
	atEnd := make(map[Ref]bool, len(held))
	for ref := range held {
		atEnd[ref] = true
	}
	if tk, ok := st.(Ticker); ok && !cfg.TickAt.IsZero() {
		r, err := tk.Tick(ctx, cfg.TickAt)
		if err != nil {
			return nil, fmt.Errorf("pipeline: tick %s: %w", st.Name(), err)
		}
		if err := apply(r, nil); err != nil {
			return nil, err
		}
	}
	if f, ok := st.(Flusher); ok && cfg.Flush {
		r, err := f.Flush(ctx)
		if err != nil {
			return nil, fmt.Errorf("pipeline: flush %s: %w", st.Name(), err)
		}
		if err := apply(r, nil); err != nil {
			return nil, err
		}
	}
	for ref := range held {
		d.Held = append(d.Held, ref)
	}
	for ref := range atEnd {
		if !held[ref] {
			d.Closed = append(d.Closed, ref)
		}
	}
	slices.SortFunc(d.Held, compareRefs)
	slices.SortFunc(d.Closed, compareRefs)
	return d, nil
}

// compareRefs orders refs by topic, partition and offset.
func compareRefs(a, b Ref) int {
	if a.Topic != b.Topic {
		if a.Topic < b.Topic {
			return -1
		}
		return 1
	}
	if a.Partition != b.Partition {
		return a.Partition - b.Partition
	}
	return cmp.Compare(a.Offset, b.Offset)
}

// MemScanner is a Scanner over messages held in memory (offline drives,
// tests): ScanTail returns the last `last` messages of each partition of
// the topic, in the order given.
type MemScanner map[string][]Message

// ScanTail implements Scanner.
func (s MemScanner) ScanTail(ctx context.Context, topic string, last int64, fn func(Message) error) error {
	byPart := map[int][]Message{}
	var parts []int
	for _, m := range s[topic] {
		if _, ok := byPart[m.Partition]; !ok {
			parts = append(parts, m.Partition)
		}
		byPart[m.Partition] = append(byPart[m.Partition], m)
	}
	slices.Sort(parts)
	for _, p := range parts {
		ms := byPart[p]
		if last > 0 && int64(len(ms)) > last {
			ms = ms[int64(len(ms))-last:]
		}
		for _, m := range ms {
			if err := ctx.Err(); err != nil {
				return err
			}
			if err := fn(m); err != nil {
				return err
			}
		}
	}
	return nil
}
