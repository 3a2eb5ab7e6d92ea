package operators_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"slices"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/internal/gate"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// FuzzStages drives every registered stage over one real input of the
// conformance chain with bytes of it changed (flips at fuzzed offsets,
// then a cut, and flips in its headers' values): flips inside the Arrow buffers make records that still
// decode but carry out-of-range ids, NaN or huge floats, wrong lengths.
// Whatever the record, the stage must not panic or fail the drive — but
// two errors stop a stage uncommitted by design: a policy release whose
// checkpoint does not match its manifest (an infrastructure failure; a
// release is never skipped), and a first evaluation without a metric the
// contract's gate names (the contract's error, naming its key) — must
// refuse it (its quarantine record) or take it, every quarantine record
// must name a reason, and everything it
// emits on an Arrow topic must be a stream of that topic's kind at its
// current version.
func FuzzStages(f *testing.F) { fuzzStages(f, buildChain(f, false)) }

// FuzzStagesServed is FuzzStages over the chain whose policy runs on a
// policy server (TestConformanceServed): weight sync loads the releases
// into it, and rollout generates there.
func FuzzStagesServed(f *testing.F) { fuzzStages(f, buildChain(f, true)) }

func fuzzStages(f *testing.F, ch *chain) {
	specs := operators.Specs()
	type target struct {
		stage string
		short string
	}
	var targets []target
	for _, s := range specs {
		if s.Name == pipeline.SnapshotStage {
			continue // keeps records as they are; the conformance suite checks it takes them
		}
		st, err := operators.New(s.Name, ch.deps)
		if errors.Is(err, operators.ErrNoPolicyServer) || errors.Is(err, operators.ErrServedPolicy) {
			continue // not a stage of this chain's policy (see conformance)
		}
		if err != nil {
			f.Fatal(err)
		}
		if c, ok := st.(io.Closer); ok {
			c.Close()
		}
		for _, short := range pipeline.InputsOf(s.Name) {
			if len(ch.msgs[ch.topics.Name(short)]) > 0 {
				targets = append(targets, target{s.Name, short})
			}
		}
	}
	if len(targets) == 0 {
		f.Fatal("no stage has an input")
	}
	for i := range targets {
		f.Add(uint8(i), uint16(0), []byte(nil), uint32(0), []byte(nil))
		f.Add(uint8(i), uint16(1), []byte{0x40, 0x01, 0xff, 0x80, 0x02, 0x7f}, uint32(0), []byte(nil))
		f.Add(uint8(i), uint16(0), []byte{0x10, 0x03, 0x01}, uint32(200), []byte(nil))
		f.Add(uint8(i), uint16(0), []byte(nil), uint32(0), []byte{0, 0, 0x01, 1, 2, 0x20, 2, 5, 0x7f, 3, 1, 0x0f})
	}
	f.Fuzz(func(t *testing.T, which uint8, msg uint16, flips []byte, cut uint32, hflips []byte) {
		tg := targets[int(which)%len(targets)]
		topic := ch.topics.Name(tg.short)
		msgs := ch.msgs[topic]
		m := msgs[int(msg)%len(msgs)]
		v := bytes.Clone(m.Value)
		for i := 0; i+3 <= len(flips) && len(v) > 0; i += 3 {
			off := int(binary.LittleEndian.Uint16(flips[i:])) * 7 % len(v)
			v[off] ^= flips[i+2]
		}
		if cut > 0 && int(cut) < len(v) {
			v = v[:cut]
		}
		m.Value, m.Headers = v, slices.Clone(m.Headers)
		// Header flips: (header index, byte offset, xor) triples.
		for i := 0; i+3 <= len(hflips) && len(m.Headers) > 0; i += 3 {
			h := &m.Headers[int(hflips[i])%len(m.Headers)]
			if len(h.Value) == 0 {
				continue
			}
			hv := bytes.Clone(h.Value)
			hv[int(hflips[i+1])%len(hv)] ^= hflips[i+2]
			h.Value = hv
		}
		deps := ch.deps
		deps.SnapshotDir = t.TempDir()
		st, err := operators.New(tg.stage, deps)
		if err != nil {
			t.Fatal(err)
		}
		// Rollout and weight sync may wait by design (below): they get 3 s.
		// Every other stage must finish; its bound only turns a hang into a
		// failure, far above the 0.13 s the slowest input has taken.
		waits := tg.stage == "rollout" || tg.stage == "weightsync"
		limit := 30 * time.Second
		if waits {
			limit = 3 * time.Second
		}
		ctx, cancel := context.WithTimeout(context.Background(), limit)
		defer cancel()
		d, err := driveStage(ctx, st, []pipeline.Message{m}, ch.side(tg.stage), deps)
		if waits && errors.Is(err, context.DeadlineExceeded) {
			// By design: rollout waits for the policy version a task names,
			// however far ahead; weight sync tries again to load a release a
			// replica refused, the replica serving what it served.
			return
		}
		if err != nil && !errors.Is(err, gpu.ErrRelease) && !errors.Is(err, gate.ErrUnmeasured) {
			t.Fatalf("%s on %s: %v", tg.stage, tg.short, err)
		}
		if err != nil {
			return // stopped uncommitted, by design (above)
		}
		// A refusal quarantines the input whole; a stage may also
		// quarantine rows of an input it takes (reward's unavailable
		// evaluators): either way every quarantine record names a reason.
		q := d.On(deps.Topics.Quarantine)
		if d.Quarantined > 1 || len(q) < d.Quarantined {
			t.Fatalf("%s on %s: %d refused, %d quarantine records", tg.stage, tg.short, d.Quarantined, len(q))
		}
		for _, r := range q {
			if header(r.Headers, schemas.HeaderReason) == "" {
				t.Fatalf("%s on %s: a quarantine record without a reason", tg.stage, tg.short)
			}
		}
		for _, o := range d.Outputs {
			info, ok := pipeline.TopicInfoOf(deps.Topics.Short(o.Topic))
			if !ok || info.Plane != pipeline.PlaneArrow {
				continue
			}
			kind, version, err := schemas.PeekKind(o.Value)
			if err != nil || kind != info.Kind || version != schemas.Versions[kind] {
				t.Fatalf("%s on %s: output to %s is %q version %d (%v), want %q version %d",
					tg.stage, tg.short, o.Topic, kind, version, err, info.Kind, schemas.Versions[info.Kind])
			}
		}
	})
}
