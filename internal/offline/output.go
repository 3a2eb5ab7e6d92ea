package offline

import (
	"fmt"
	"os"
	"strconv"

	"github.com/apache/arrow-go/v18/arrow/ipc"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// collect fills rep from what the drive produced; rows are the record
// counts of the input messages.
func (rep *Report) collect(d *pipeline.Driven, sp spec, rows []int, t pipeline.Topics) error {
	rep.Outputs = len(d.On(sp.out))
	for _, q := range d.On(t.Quarantine) {
		rep.Refusals = append(rep.Refusals, refusalOf(q))
	}
	for _, ref := range d.Closed {
		if ref.Topic == sp.in {
			rep.ClosedMessages++
			rep.Closed += rows[ref.Offset]
		}
	}
	rep.Held = len(d.Held)
	for _, o := range d.On(t.Windows) {
		w, err := schemas.DecodeWindow(o.Value)
		if err != nil {
			return fmt.Errorf("offline: window record: %w", err)
		}
		rep.Windows = append(rep.Windows, w)
	}
	for _, o := range d.On(t.Policy) {
		r, err := schemas.DecodeRelease(o.Value)
		if err != nil {
			return fmt.Errorf("offline: release: %w", err)
		}
		rep.Releases = append(rep.Releases, r)
	}
	return nil
}

// refusalOf reads a quarantine record's headers.
func refusalOf(q pipeline.Output) Refusal {
	var r Refusal
	for _, h := range q.Headers {
		switch h.Key {
		case schemas.HeaderReason:
			r.Reason = string(h.Value)
		case schemas.HeaderDetail:
			r.Detail = string(h.Value)
		case schemas.HeaderSourceOffset:
			r.Batch, _ = strconv.ParseInt(string(h.Value), 10, 64)
		case schemas.HeaderSourceRow:
			r.Row = string(h.Value)
		}
	}
	return r
}

// writeOutputs writes the outputs of the data topic to path ("" writes
// nothing): an Arrow IPC stream of the output kind, or JSON lines.
func writeOutputs(path string, sp spec, outs []pipeline.Output) error {
	if path == "" {
		return nil
	}
	if sp.outKind == nil {
		return writeLines(path, outs)
	}
	return writeIPC(path, *sp.outKind, outs)
}

// writeIPC writes outs as one Arrow IPC stream of kind k, one record
// batch per output, with Arrow's own writer.
func writeIPC(path string, k kindIO, outs []pipeline.Output) (err error) {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("offline: %w", err)
	}
	defer func() {
		if cerr := f.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("offline: %w", cerr)
		}
	}()
	w := ipc.NewWriter(f, ipc.WithSchema(k.schema))
	for i, o := range outs {
		rec, err := k.record(o.Value)
		if err != nil {
			w.Close()
			return fmt.Errorf("offline: %s: message %d: %w", path, i, err)
		}
		err = w.Write(rec)
		rec.Release()
		if err != nil {
			w.Close()
			return fmt.Errorf("offline: write %s: %w", path, err)
		}
	}
	if err := w.Close(); err != nil {
		return fmt.Errorf("offline: write %s: %w", path, err)
	}
	return nil
}

// writeLines writes each output's value (a JSON document) on a line.
func writeLines(path string, outs []pipeline.Output) error {
	var b []byte
	for _, o := range outs {
		b = append(append(b, o.Value...), '\n')
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("offline: %w", err)
	}
	return nil
}
