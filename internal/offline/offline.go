// Package offline runs one registered stage over a file: `trajflow stage
// NAME --in F --out F`. It is the live stage, not a copy of its logic: the
// stage is built by operators.New and driven by pipeline.Drive, the live
// operator's lifecycle and result handling (a refusal becomes a quarantine
// record, held inputs stay held, the same deduplication), so the file's
// outputs are what the live operator would produce from the same messages.
//
// Each record batch of the input (an Arrow IPC stream file of the stage's
// input kind) is one input message, as the upstream stage would send it:
// the batch encoded as its own IPC stream by the kind's codec, keyed by its
// group id (batch id for packed batches), without headers. The outputs on
// the stage's data topic are written as one Arrow IPC stream file, one
// record batch per output message (schemas.SplitStream or DecodeAll cut it
// back into messages). When the input ends, the stage is ticked past every
// timeout and flushed, so groups and windows still open are closed, as a
// live operator's clock would close them later (Report.Closed says how many
// records that decided).
package offline

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"time"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Stages are the stages Run drives: those that consume one data-plane
// topic, in pipeline order.
var Stages = []string{"validate", "reward", "advantage", "pack", "train"}

// ErrStage is returned for a stage Run does not drive.
var ErrStage = errors.New("offline: no offline stage")

// Options configure one offline run.
type Options struct {
	Stage string
	// In is the input: an Arrow IPC stream file of the stage's input kind,
	// one record batch per message, or several such streams one after
	// the other (messages saved from Kafka), or a Parquet snapshot file of
	// the stage's input topic (connectors/parquet), its messages in offset
	// order.
	In string
	// Out receives the outputs on the stage's data topic: an Arrow IPC
	// stream file, one record batch per output message; for train (whose
	// output is the policy topic) one release manifest per line. "" writes
	// nothing.
	Out string
	// Quarantine, when set, receives every quarantined record: an Arrow IPC
	// stream file of the input kind, one record batch per record, in the
	// order of Report.Refusals.
	Quarantine string
	// Deps are the stage's dependencies (operators.BuiltinDeps): the
	// resolved contract, the run's topics, ReleaseDir for train.
	Deps operators.Deps
	// TrainerVersion, when >= 0, is a policy release the trainer published
	// before the first record (pack's lag rule judges against it, or
	// against a newer behavior version a record proves); < 0: the trainer
	// version comes from the records alone, as live.
	TrainerVersion int64
	// Log receives the stage's warnings (nil: discarded).
	Log io.Writer
}

// Refusal is one quarantine record.
type Refusal struct {
	Reason, Detail string
	Batch          int64  // the input record batch it came from
	Row            string // the row within it, when one row was refused
}

// Report is what one offline run did.
type Report struct {
	Stage       string
	OutputTopic string
	Inputs      int // input messages (record batches)
	Records     int // input records
	Duplicates  int // record ids seen before in the input
	Outputs     int // messages on the data topic
	Refusals    []Refusal
	// Closed counts the records of the inputs still held when the input
	// ended and closed by the final tick or flush (ClosedMessages inputs);
	// Held the inputs still held after it.
	Closed, ClosedMessages, Held int
	Windows                      []schemas.WindowRecord  // pack's window records
	Releases                     []schemas.PolicyRelease // train's releases
}

// Run drives the stage over the input file and writes its outputs.
func Run(ctx context.Context, o Options) (*Report, error) {
	sp, err := resolve(o.Stage, o.Deps.Topics)
	if err != nil {
		return nil, err
	}
	rep := &Report{Stage: o.Stage, OutputTopic: sp.out}
	inputs, rows, err := readInput(o.In, sp, rep)
	if err != nil {
		return nil, err
	}
	if o.Stage == "pack" && o.TrainerVersion >= 0 {
		if inputs, err = withRelease(inputs, o); err != nil {
			return nil, err
		}
	}
	d, err := drive(ctx, o, inputs)
	if err != nil {
		return nil, err
	}
	if err := rep.collect(d, sp, rows, o.Deps.Topics); err != nil {
		return nil, err
	}
	if err := writeOutputs(o.Out, sp, d.On(sp.out)); err != nil {
		return nil, err
	}
	if o.Quarantine != "" {
		if err := writeIPC(o.Quarantine, sp.inKind, d.On(o.Deps.Topics.Quarantine)); err != nil {
			return nil, err
		}
	}
	return rep, nil
}

// spec is what Run needs of a stage: its data input and output.
type spec struct {
	in, out string // full topic names
	inKind  kindIO
	outKind *kindIO // nil: the output is JSON documents (train's releases)
}

// resolve finds the stage's data input (its one data-plane input topic)
// and data output (its data-plane output, or for train the policy topic)
// in the topology.
func resolve(name string, t pipeline.Topics) (spec, error) {
	if !slices.Contains(Stages, name) {
		return spec{}, fmt.Errorf("%w %q (one of %v)", ErrStage, name, Stages)
	}
	var sp spec
	var inKind, outKind schemas.Kind
	for _, short := range pipeline.InputsOf(name) {
		if info, _ := pipeline.TopicInfoOf(short); info.Plane == pipeline.PlaneArrow {
			sp.in, inKind = t.Name(short), info.Kind
		}
	}
	for _, short := range pipeline.OutputsOf(name) {
		if info, _ := pipeline.TopicInfoOf(short); info.Plane == pipeline.PlaneArrow {
			sp.out, outKind = t.Name(short), info.Kind
		}
	}
	var err error
	if sp.inKind, err = kindOf(inKind); err != nil {
		return spec{}, err
	}
	if sp.out == "" { // train: its output is the policy topic
		sp.out = t.Policy
		return sp, nil
	}
	k, err := kindOf(outKind)
	if err != nil {
		return spec{}, err
	}
	sp.outKind = &k
	return sp, nil
}

// MaxStreamInput bounds an input that is not a regular file (a pipe,
// /dev/stdin, a device), whose size is not known before it is read: the
// input is held in memory whole, and a stream that does not end (a
// device such as /dev/zero) must not take the machine's memory with it.
const MaxStreamInput = 1 << 30

// readWhole reads the file at path: a regular file whole, anything else
// up to limit bytes, refusing more with an error that names the file.
func readWhole(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if fi.IsDir() {
		return nil, fmt.Errorf("%s: is a directory", path)
	}
	if fi.Mode().IsRegular() {
		return io.ReadAll(f)
	}
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s: not a regular file and longer than %d bytes: write it to a file and pass that", path, limit)
	}
	return b, nil
}

// parquetMagic begins (and ends) every Parquet file.
const parquetMagic = "PAR1"

// readInput reads the input file: one message per record batch, offsets
// 0, 1, ... on the stage's input topic. It returns the record count of
// every message and counts the records and duplicate record ids into rep.
func readInput(path string, sp spec, rep *Report) ([]pipeline.Message, []int, error) {
	b, err := readWhole(path, MaxStreamInput)
	if err != nil {
		return nil, nil, fmt.Errorf("offline: input: %w", err)
	}
	var parts [][]byte
	switch {
	case len(b) == 0:
		return nil, nil, fmt.Errorf("offline: %s: empty file: want an Arrow IPC stream of the records of %s, or a Parquet snapshot file of that topic", path, sp.in)
	case bytes.HasPrefix(b, []byte(parquetMagic)):
		// A snapshot file: its messages are the topic's, in offset order.
		_, msgs, err := parquet.ReadFile(path, parquet.ReadOptions{})
		if err != nil {
			return nil, nil, fmt.Errorf("offline: %s: %w", path, err)
		}
		for _, m := range msgs {
			parts = append(parts, m.Value)
		}
	default:
		if parts, err = schemas.SplitStreams(b); err != nil {
			return nil, nil, fmt.Errorf("offline: %s: not an Arrow IPC stream nor a Parquet file: %w", path, err)
		}
	}
	seen := map[string]bool{}
	msgs := make([]pipeline.Message, len(parts))
	rows := make([]int, len(parts))
	for i, p := range parts {
		m, err := sp.inKind.message(p)
		if err != nil {
			return nil, nil, fmt.Errorf("offline: %s: record batch %d: %w", path, i, err)
		}
		for _, id := range m.ids {
			if seen[id] {
				rep.Duplicates++
			}
			seen[id] = true
		}
		rows[i] = len(m.ids)
		rep.Records += len(m.ids)
		msgs[i] = pipeline.Message{Ref: pipeline.Ref{Topic: sp.in, Offset: int64(i)}, Key: []byte(m.key), Value: m.value}
	}
	rep.Inputs = len(msgs)
	return msgs, rows, nil
}

// withRelease puts a policy release of o.TrainerVersion before the inputs,
// as the trainer's manifest on the policy topic.
func withRelease(inputs []pipeline.Message, o Options) ([]pipeline.Message, error) {
	c := o.Deps.Contract
	v, err := schemas.EncodeRelease(schemas.PolicyRelease{PolicyVersion: o.TrainerVersion, ContractHash: c.Hash(), Ready: true})
	if err != nil {
		return nil, err
	}
	rel := pipeline.Message{Ref: pipeline.Ref{Topic: o.Deps.Topics.Policy}, Key: []byte(c.RunID), Value: v}
	return append([]pipeline.Message{rel}, inputs...), nil
}

// drive builds the registered stage and drives it over the inputs, then
// ticks it past every timeout and flushes it, so the run ends decided.
func drive(ctx context.Context, o Options, inputs []pipeline.Message) (*pipeline.Driven, error) {
	deps := o.Deps
	// Groups and windows still open when the input ends close at the final
	// tick (their timeouts are only read by Tick).
	deps.PartialGroupTimeout, deps.WindowMaxWait = time.Nanosecond, time.Nanosecond
	st, err := operators.New(o.Stage, deps)
	if err != nil {
		return nil, err
	}
	w := o.Log
	if w == nil {
		w = io.Discard
	}
	env := pipeline.EnvConfig{Logger: slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelWarn})).With("stage", o.Stage)}
	if deps.ReleaseDir != "" {
		if env.Releases, err = pipeline.NewDirReleases(deps.ReleaseDir); err != nil {
			return nil, err
		}
	}
	return pipeline.Drive(ctx, st, inputs, pipeline.DriveConfig{
		QuarantineTopic: deps.Topics.Quarantine, MaxMessageBytes: deps.Contract.Topics.MaxMessageBytes,
		Env: env, TickAt: time.Now().Add(100 * 365 * 24 * time.Hour), Flush: true,
	})
}
