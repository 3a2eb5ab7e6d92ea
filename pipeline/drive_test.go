package pipeline

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/schemas"
)

// driveStage holds inputs whose value starts with "hold", releases every
// held input on "flush", refuses "bad", and counts its lifecycle.
type driveStage struct {
	held    []Ref
	started bool
	side    []string
	closed  int
	ticks   int
}

func (*driveStage) Name() string                        { return "drive" }
func (*driveStage) Topics() []string                    { return []string{"in"} }
func (*driveStage) SideTopics() []string                { return []string{"side"} }
func (d *driveStage) Close() error                      { d.closed++; return nil }
func (d *driveStage) Start(context.Context, *Env) error { d.started = true; return nil }
func (d *driveStage) Side(_ context.Context, m Message) error {
	d.side = append(d.side, string(m.Value))
	return nil
}
func (d *driveStage) Process(_ context.Context, m Message) (Result, error) {
	v := string(m.Value)
	switch {
	case v == "bad":
		return Result{}, Refuse("bad_input", "value %q", v)
	case strings.HasPrefix(v, "hold"):
		d.held = append(d.held, m.Ref)
		return Result{Hold: true}, nil
	case v == "flush":
		r := Result{Outputs: []Output{{Topic: "out", Value: []byte("released")}}, Release: d.held}
		d.held = nil
		return r, nil
	}
	return Result{Outputs: []Output{{Topic: "out", Value: []byte(strings.ToUpper(v))}}}, nil
}
func (d *driveStage) Tick(context.Context, time.Time) (Result, error) {
	d.ticks++
	return Result{Outputs: []Output{{Topic: "out", Value: []byte("tick")}}}, nil
}

func TestDriveIsTheRuntimeLifecycle(t *testing.T) {
	st := &driveStage{}
	in := func(off int64, v string) Message {
		return Message{Ref: Ref{Topic: "in", Offset: off}, Value: []byte(v)}
	}
	d, err := Drive(context.Background(), st, []Message{in(0, "a"), in(1, "hold1"), in(2, "bad"), in(3, "hold2"), in(4, "flush"), in(5, "hold3")},
		DriveConfig{QuarantineTopic: "q", Side: []Message{{Value: []byte("s1")}}, TickAt: time.Unix(1, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if !st.started || st.closed != 1 || st.ticks != 1 || len(st.side) != 1 {
		t.Fatalf("lifecycle: started %v closed %d ticks %d side %v", st.started, st.closed, st.ticks, st.side)
	}
	var outs []string
	for _, o := range d.On("out") {
		outs = append(outs, string(o.Value))
	}
	if strings.Join(outs, ",") != "A,released,tick" {
		t.Fatalf("outputs %v", outs)
	}
	q := d.On("q")
	if d.Quarantined != 1 || len(q) != 1 || string(q[0].Value) != "bad" {
		t.Fatalf("quarantine: %d refused, %v", d.Quarantined, q)
	}
	var reason string
	for _, h := range q[0].Headers {
		if h.Key == schemas.HeaderReason {
			reason = string(h.Value)
		}
	}
	if reason != "bad_input" {
		t.Fatalf("quarantine reason %q", reason)
	}
	if len(d.Held) != 1 || d.Held[0].Offset != 5 {
		t.Fatalf("held at the end %v, want only offset 5", d.Held)
	}
}

func TestDriveQuarantinesOversizeOutput(t *testing.T) {
	big := bigStage{}
	d, err := Drive(context.Background(), big, []Message{{Ref: Ref{Topic: "in"}, Value: []byte("x")}}, DriveConfig{MaxMessageBytes: 1 << 10})
	if err != nil {
		t.Fatal(err)
	}
	if d.Quarantined != 0 || len(d.On("out")) != 0 || len(d.On("quarantine")) != 1 {
		t.Fatalf("oversize output: %d out, %d quarantined", len(d.On("out")), len(d.On("quarantine")))
	}
}

type bigStage struct{}

func (bigStage) Name() string     { return "big" }
func (bigStage) Topics() []string { return []string{"in"} }
func (bigStage) Process(context.Context, Message) (Result, error) {
	return Result{Outputs: []Output{{Topic: "out", Value: make([]byte, 1<<20)}}}, nil
}

// flushStage is driveStage with a Flush that releases every held input.
type flushStage struct{ driveStage }

func (f *flushStage) Flush(context.Context) (Result, error) {
	r := Result{Outputs: []Output{{Topic: "out", Value: []byte("flushed")}}, Release: f.held}
	f.held = nil
	return r, nil
}

// TestDriveReportsWhatTheEndClosed: inputs still held after the last
// input and released by the final Flush are listed in Closed, not Held.
func TestDriveReportsWhatTheEndClosed(t *testing.T) {
	in := func(off int64, v string) Message {
		return Message{Ref: Ref{Topic: "in", Offset: off}, Value: []byte(v)}
	}
	inputs := []Message{in(0, "hold0"), in(1, "flush"), in(2, "hold2"), in(3, "a"), in(4, "hold4")}
	d, err := Drive(context.Background(), &flushStage{}, inputs, DriveConfig{Flush: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Held) != 0 || len(d.Closed) != 2 || d.Closed[0].Offset != 2 || d.Closed[1].Offset != 4 {
		t.Fatalf("held %v, closed %v: want nothing held, offsets 2 and 4 closed by the flush", d.Held, d.Closed)
	}
	d, err = Drive(context.Background(), &flushStage{}, inputs, DriveConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Closed) != 0 || len(d.Held) != 2 {
		t.Fatalf("without a flush: held %v, closed %v", d.Held, d.Closed)
	}
}
