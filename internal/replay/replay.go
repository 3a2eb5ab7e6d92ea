// Package replay rebuilds a run's batches offline from its Parquet
// snapshots and compares them byte for byte with the recorded ones
// (docs/PIPELINE.md §1: every batch traceable to its inputs, its contract and its
// window decisions), and re-emits a snapshot into Kafka topics.
//
// The stages after rollout are driven with pipeline.Drive, the live
// operator's own lifecycle and result handling, over the recorded
// trajectories; each recorded window is then rebuilt from its lineage
// (its admitted and filtered ids and the trainer version it closed at)
// with the pack window itself, so a batch that differs names the window
// and the first field that differs.
package replay

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// Report is the outcome of a replay.
type Report struct {
	Batches   int      // recorded batches
	Identical int      // replayed batches byte-identical to the recorded ones
	Diff      string   // first difference; "" when every batch matches
	Notes     []string // per-stage accounting and warnings
}

func (r *Report) fail(s string) {
	if r.Diff == "" {
		r.Diff = s
	}
}

// ContractPath is the contract a replay of runDir loads: path, or the
// contract recorded in the snapshot when path is "".
func ContractPath(runDir, path string) string {
	if path == "" {
		return filepath.Join(runDir, parquet.ContractFile)
	}
	return path
}

// loadContract loads the contract of a snapshot (ContractPath) and checks
// it is the one the run recorded.
func loadContract(runDir, path string, info parquet.RunInfo) (*contract.Contract, error) {
	path = ContractPath(runDir, path)
	c, err := contract.Load(path)
	if err != nil {
		return nil, err
	}
	if err := c.Recorded().Resolve(); err != nil {
		return nil, fmt.Errorf("contract %s: %w", path, err)
	}
	if h := c.Hash(); h != info.ContractHash {
		return nil, fmt.Errorf("contract %s has hash %s, the snapshot was written under %s", path, h, info.ContractHash)
	}
	return c, nil
}

// step is one stage of the replayed chain.
type step struct{ name, short string }

// chain are the stages replayed by Drive, each consuming the previous
// one's output (the first consumes the recorded trajectories).
var chain = []step{{"validate", "valid"}, {"reward", "rewarded"}, {"advantage", "scored"}}

// Topics are the topics a replay reads: the recorded trajectories it
// rebuilds from, the stages' outputs it compares its own with, and the
// windows and batches it rebuilds. A file of another topic (the census,
// the tasks) is neither read nor verified.
var Topics = []string{"trajectories", "valid", "rewarded", "scored", "windows", "batches"}

// Run rebuilds validate → reward → advantage → pack from the recorded
// trajectories of the run in runDir and compares every batch with the
// recorded one. contractPath "" uses the contract recorded in the
// snapshot. Every file of Topics that is missing or does not verify is
// named in the error (a *parquet.ReadError): a replay that lacks records
// cannot be exact.
func Run(ctx context.Context, runDir, contractPath string) (*Report, error) {
	snap, err := parquet.ReadRun(ctx, runDir, Topics, parquet.ReadOptions{})
	if err != nil {
		return nil, err
	}
	files, err := parquet.List(runDir)
	if err != nil {
		return nil, err
	}
	c, err := loadContract(runDir, contractPath, snap.Info)
	if err != nil {
		return nil, err
	}
	deps, err := operators.BuiltinDeps(c)
	if err != nil {
		return nil, err
	}
	deps.VocabSize = snap.Info.VocabSize
	deps.PartialGroupTimeout = time.Nanosecond // groups the live stage closed by timeout close at the final tick
	rep := &Report{}
	for _, g := range snap.Gaps {
		rep.Notes = append(rep.Notes, "warning: "+g.String())
	}
	missing, err := parquet.Missing(runDir)
	if err != nil {
		return nil, err
	}
	for _, f := range missing { // those of Topics made ReadRun fail
		rep.Notes = append(rep.Notes, fmt.Sprintf("warning: %v; the replay does not read topic %s", parquet.MissingError(f), f.Topic))
	}
	if err := checkComplete(c, snap, files, rep); err != nil {
		return nil, err
	}
	in := recorded(deps.Topics.Trajectories, snap.Topics["trajectories"])
	for _, s := range chain {
		if in, err = drive(ctx, deps, s, in, snap, rep); err != nil {
			return nil, err
		}
	}
	scored := map[string]schemas.Scored{}
	for _, m := range in {
		rows, err := schemas.ScoredTrajectories.Decode(nil, m.Value)
		if err != nil {
			return nil, fmt.Errorf("replay: decode replayed scored message: %w", err)
		}
		for _, r := range rows {
			scored[r.RecordID] = r
		}
	}
	if err := rebuildWindows(c, snap, scored, rep); err != nil {
		return nil, err
	}
	return rep, nil
}

// recorded turns the snapshot's messages of a topic into the stage's
// input, in the order they were produced.
func recorded(topic string, msgs []parquet.Message) []pipeline.Message {
	msgs = slices.Clone(msgs)
	slices.SortStableFunc(msgs, func(a, b parquet.Message) int { return a.Time.Compare(b.Time) })
	out := make([]pipeline.Message, len(msgs))
	for i, m := range msgs {
		out[i] = pipeline.Message{Ref: pipeline.Ref{Topic: topic, Partition: m.Partition, Offset: m.Offset},
			Key: m.Key, Value: m.Value, Headers: m.Headers, Time: m.Time}
	}
	return out
}

// drive runs the registered stage of s over in with pipeline.Drive — a
// refusal is quarantined, held inputs stay held, groups still open at the
// end are closed by a final tick — and returns its outputs on its data
// topic as the next stage's input.
func drive(ctx context.Context, deps operators.Deps, s step, in []pipeline.Message, snap *parquet.Run, rep *Report) ([]pipeline.Message, error) {
	st, err := operators.New(s.name, deps)
	if err != nil {
		return nil, err
	}
	d, err := pipeline.Drive(ctx, st, in, pipeline.DriveConfig{
		QuarantineTopic: deps.Topics.Quarantine, MaxMessageBytes: deps.Contract.Topics.MaxMessageBytes,
		Env:    pipeline.EnvConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))},
		TickAt: time.Now().Add(100 * 365 * 24 * time.Hour),
	})
	if err != nil {
		return nil, fmt.Errorf("replay: %w", err)
	}
	outs := d.On(deps.Topics.Name(s.short))
	rec := snap.Topics[s.short]
	rep.Notes = append(rep.Notes, fmt.Sprintf("%-9s %d input messages, %d refused, %d output messages (%d byte-identical to the recorded %s topic, which holds %d)",
		s.name, len(in), d.Quarantined, len(outs), sameValues(outs, rec), s.short, len(rec)))
	return pipeline.AsMessages(outs), nil
}

// sameValues counts the replayed outputs whose bytes appear among the
// recorded messages of the topic.
func sameValues(outs []pipeline.Output, recorded []parquet.Message) int {
	have := map[[32]byte]int{}
	for _, m := range recorded {
		have[sha256.Sum256(m.Value)]++
	}
	n := 0
	for _, o := range outs {
		k := sha256.Sum256(o.Value)
		if have[k] > 0 {
			have[k]--
			n++
		}
	}
	return n
}

// ErrIncomplete marks a snapshot that lacks records a replay needs.
var ErrIncomplete = errors.New("replay: incomplete snapshot")

// checkComplete refuses a snapshot that lacks a partition or the first
// offsets of a topic the replay reads. tasks, trajectories, valid and
// rewarded share the key and the partition count, and each feeds the
// next, so a partition of one of them without a file is a hole when the
// same partition has a file in a topic that it feeds (a stage may refuse
// every record of a partition, so the other way round proves nothing)
// or, for trajectories, in tasks. Any other hole is a note. files are
// every file of the run (parquet.List), those of the topics it does not
// read included.
func checkComplete(c *contract.Contract, snap *parquet.Run, files []parquet.File, rep *Report) error {
	parts, fromStart := operators.SnapshotLayout(c)
	has := map[string]map[int]bool{}
	for _, f := range files {
		if has[f.Topic] == nil {
			has[f.Topic] = map[int]bool{}
		}
		has[f.Topic][f.Partition] = true
	}
	evidence := map[string][]string{
		"trajectories": {"tasks", "valid", "rewarded"},
		"valid":        {"rewarded"},
	}
	var refused []string
	for _, h := range parquet.Holes(files, parts, fromStart) {
		proven := h.Before > 0 && slices.Contains(Topics, h.Topic)
		for _, t := range evidence[h.Topic] {
			if has[t][h.Partition] {
				proven = true
			}
		}
		if proven {
			refused = append(refused, h.String())
		} else {
			rep.Notes = append(rep.Notes, "warning: "+h.String())
		}
	}
	if len(snap.Topics["trajectories"]) == 0 && len(snap.Topics["batches"]) > 0 {
		refused = append(refused, "no trajectories file, though the snapshot holds batches")
	}
	if len(refused) > 0 {
		return fmt.Errorf("%w: %s: %s; a replay rebuilds every batch from every recorded trajectory, so it needs every partition",
			ErrIncomplete, snap.Dir, strings.Join(refused, "; "))
	}
	return nil
}
