package main

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"math"
	"path/filepath"
	"reflect"
	"slices"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

func init() {
	register("replay", "replay DIR: rebuild a run's batches offline from its Parquet snapshots and compare them byte for byte (--to-brokers ADDR re-emits the snapshot into Kafka)", cmdReplay)
}

func cmdReplay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("replay", stderr)
	runName := fs.String("run", "", "run to replay when DIR holds several")
	cpath := fs.String("contract", "", "learning contract (default: the contract recorded in the snapshot)")
	to := fs.String("to-brokers", "", "re-emit every snapshot topic into the Kafka cluster at ADDR instead of replaying")
	clientCfg := fs.String("client-config", "", "YAML file with TLS/SASL client settings for --to-brokers")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return fmt.Errorf("%w: trajflow replay DIR [--contract FILE] [--to-brokers ADDR]", errUsage)
	}
	runDir, err := parquet.FindRun(pos[0], *runName)
	if err != nil {
		return err
	}
	if *to != "" {
		cc := kafka.ClientConfig{}
		if *clientCfg != "" {
			if cc, err = kafka.LoadClientConfig(*clientCfg); err != nil {
				return err
			}
		}
		cc.Brokers = splitList(*to)
		n, err := reemit(ctx, runDir, *cpath, cc)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "%d messages re-emitted to %s\n", n, *to)
		return nil
	}
	rep, err := replayRun(ctx, runDir, *cpath)
	if err != nil {
		return err
	}
	for _, l := range rep.Notes {
		fmt.Fprintln(stdout, l)
	}
	if rep.Diff != "" {
		return fmt.Errorf("%d of %d batches identical; first difference: %s", rep.Identical, rep.Batches, rep.Diff)
	}
	fmt.Fprintf(stdout, "%d batches identical\n", rep.Identical)
	return nil
}

// replayReport is the outcome of a replay.
type replayReport struct {
	Batches   int      // recorded batches
	Identical int      // replayed batches byte-identical to the recorded ones
	Diff      string   // first difference; "" when every batch matches
	Notes     []string // per-stage accounting
}

// snapshotContract loads the contract of a snapshot (or path) and checks
// it is the one the run recorded.
func snapshotContract(runDir, path string, info parquet.RunInfo) (*contract.Contract, error) {
	if path == "" {
		path = filepath.Join(runDir, parquet.ContractFile)
	}
	c, err := contract.Load(path)
	if err != nil {
		return nil, err
	}
	if err := c.Resolve(); err != nil {
		return nil, fmt.Errorf("contract %s: %w", path, err)
	}
	if h := c.Hash(); h != info.ContractHash {
		return nil, fmt.Errorf("contract %s has hash %s, the snapshot was written under %s", path, h, info.ContractHash)
	}
	return c, nil
}

// stageRun drives a stage's pure function over msgs, in order, and
// returns the outputs it produced on topic. Refused inputs are counted,
// as the runtime would quarantine them.
func stageRun(ctx context.Context, st pipeline.Stage, topic string, msgs []parquet.Message, out string) ([]pipeline.Output, int, error) {
	var outs []pipeline.Output
	refused := 0
	collect := func(res pipeline.Result) {
		for _, o := range res.Outputs {
			if o.Topic == out {
				outs = append(outs, o)
			}
		}
	}
	for _, m := range msgs {
		res, err := st.Process(ctx, pipeline.Message{
			Ref: pipeline.Ref{Topic: topic, Partition: m.Partition, Offset: m.Offset},
			Key: m.Key, Value: m.Value, Headers: m.Headers, Time: m.Time,
		})
		if err != nil {
			if _, ok := pipeline.AsRefusal(err); ok {
				refused++
				continue
			}
			return nil, refused, fmt.Errorf("%s at %s/%d@%d: %w", st.Name(), topic, m.Partition, m.Offset, err)
		}
		collect(res)
	}
	// Groups the live stage closed by timeout are closed here at the end.
	if tk, ok := st.(pipeline.Ticker); ok {
		res, err := tk.Tick(ctx, time.Now().Add(100*365*24*time.Hour))
		if err != nil {
			return nil, refused, fmt.Errorf("%s: %w", st.Name(), err)
		}
		collect(res)
	}
	return outs, refused, nil
}

// asMessages turns stage outputs into the next stage's inputs.
func asMessages(outs []pipeline.Output) []parquet.Message {
	msgs := make([]parquet.Message, len(outs))
	for i, o := range outs {
		msgs[i] = parquet.Message{Offset: int64(i), Key: o.Key, Value: o.Value, Headers: o.Headers}
	}
	return msgs
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

// replayRun rebuilds validate → reward → advantage → pack from the
// recorded trajectories of the run in runDir and compares every batch
// with the recorded one (pipeline §1: every batch traceable to its
// inputs, its contract and its window decisions).
func replayRun(ctx context.Context, runDir, cpath string) (*replayReport, error) {
	snap, err := parquet.ReadRun(runDir, nil, parquet.ReadOptions{})
	if err != nil {
		return nil, err
	}
	c, err := snapshotContract(runDir, cpath, snap.Info)
	if err != nil {
		return nil, err
	}
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return nil, err
	}
	rep := &replayReport{}
	for _, g := range snap.Gaps {
		rep.Notes = append(rep.Notes, "warning: "+g.String())
	}
	deps, err := operatorDeps(c, topics)
	if err != nil {
		return nil, err
	}
	deps.VocabSize = snap.Info.VocabSize
	deps.PartialGroupTimeout = time.Nanosecond // only used by the final tick
	deps.WindowMaxWait = 0
	stage := func(name string) (pipeline.Stage, error) {
		// Start is not called: the replayed stages keep no local state
		// and read nothing back from Kafka.
		return operators.New(name, deps)
	}
	in := slices.Clone(snap.Topics["trajectories"])
	slices.SortStableFunc(in, func(a, b parquet.Message) int { return a.Time.Compare(b.Time) })
	chain := []struct{ name, from, to, short string }{
		{"validate", topics.Trajectories, topics.Valid, "valid"},
		{"reward", topics.Valid, topics.Rewarded, "rewarded"},
		{"advantage", topics.Rewarded, topics.Scored, "scored"},
	}
	var outs []pipeline.Output
	for _, step := range chain {
		st, err := stage(step.name)
		if err != nil {
			return nil, err
		}
		var refused int
		outs, refused, err = stageRun(ctx, st, step.from, in, step.to)
		if err != nil {
			return nil, fmt.Errorf("replay: %w", err)
		}
		rep.Notes = append(rep.Notes, fmt.Sprintf("%-9s %d inputs, %d refused, %d outputs (%d byte-identical to the recorded %s topic, which holds %d)",
			step.name, len(in), refused, len(outs), sameValues(outs, snap.Topics[step.short]), step.short, len(snap.Topics[step.short])))
		in = asMessages(outs)
	}
	scored := map[string]schemas.Scored{}
	for _, o := range outs {
		rows, err := schemas.ScoredTrajectories.Decode(nil, o.Value)
		if err != nil {
			return nil, fmt.Errorf("replay: decode replayed scored message: %w", err)
		}
		for _, r := range rows {
			scored[r.RecordID] = r
		}
	}
	if err := replayPack(c, snap, scored, rep); err != nil {
		return nil, err
	}
	return rep, nil
}

// replayPack rebuilds each recorded window's batch from its admitted and
// filtered ids and the trainer version it recorded, and compares it with
// the recorded batch.
func replayPack(c *contract.Contract, snap *parquet.Run, scored map[string]schemas.Scored, rep *replayReport) error {
	recorded := map[string][]byte{}
	var order []string
	for _, m := range snap.Topics["batches"] {
		id := string(m.Key)
		if id == "" {
			b, err := schemas.PackedBatches.Decode(nil, m.Value)
			if err != nil {
				return fmt.Errorf("replay: recorded batch at offset %d: %w", m.Offset, err)
			}
			id = b.BatchID
		}
		if _, dup := recorded[id]; !dup {
			order = append(order, id)
		}
		recorded[id] = m.Value
	}
	rep.Batches = len(recorded)
	opts := c.Packing
	opts.BatchTokens, opts.BatchGroups = math.MaxInt, 0
	seen := map[string]bool{}
	for _, m := range snap.Topics["windows"] {
		rec, err := schemas.DecodeWindow(m.Value)
		if err != nil {
			return fmt.Errorf("replay: window record at offset %d: %w", m.Offset, err)
		}
		if rec.BatchID == "" || seen[rec.BatchID] {
			continue // a window closed without rows, or redelivered
		}
		seen[rec.BatchID] = true
		want, ok := recorded[rec.BatchID]
		if !ok {
			rep.fail(fmt.Sprintf("batch %s (index %d): in the window lineage but not in the batches topic", rec.BatchID, rec.BatchIndex))
			continue
		}
		got, err := rebuildBatch(opts, c.RunID, rec, scored)
		if err != nil {
			rep.fail(fmt.Sprintf("batch %s (index %d): %v", rec.BatchID, rec.BatchIndex, err))
			continue
		}
		if sha256.Sum256(got) == sha256.Sum256(want) {
			rep.Identical++
			continue
		}
		rep.fail(fmt.Sprintf("batch %s (index %d): %s", rec.BatchID, rec.BatchIndex, batchDiff(want, got)))
	}
	for _, id := range order {
		if !seen[id] {
			rep.fail(fmt.Sprintf("batch %s: in the batches topic but no window record names it", id))
		}
	}
	return nil
}

func (r *replayReport) fail(s string) {
	if r.Diff == "" {
		r.Diff = s
	}
}

// rebuildBatch packs the records of one window as the live window did: the
// lag rule judged against the closing trainer version, the batch a pure
// function of the admitted set (pack.Window.Close).
func rebuildBatch(opts pack.Options, runID string, rec schemas.WindowRecord, scored map[string]schemas.Scored) ([]byte, error) {
	w, err := pack.NewWindow(opts, -1<<40) // no record is stale when added; Close judges
	if err != nil {
		return nil, err
	}
	ids := slices.Clone(rec.Admitted)
	for _, d := range rec.Filtered {
		ids = append(ids, d.RecordID)
	}
	slices.Sort(ids)
	for _, id := range ids {
		s, ok := scored[id]
		if !ok {
			return nil, fmt.Errorf("record %s of the window was not produced by the replayed stages", id)
		}
		res, err := w.Add(s)
		if err != nil {
			return nil, fmt.Errorf("record %s: %w", id, err)
		}
		if res.Outcome != pack.Admitted {
			return nil, fmt.Errorf("record %s: %s (%s) at replay, admitted to the recorded window", id, res.Outcome, res.Filter)
		}
	}
	batch, closed := w.Close(rec.BatchIndex, runID, rec.ContractHash, rec.TrainerVersion)
	var got []string
	for _, a := range closed.Admitted {
		got = append(got, a.RecordID)
	}
	want := slices.Clone(rec.Admitted)
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		return nil, fmt.Errorf("replay admitted %d records, the recorded window %d", len(got), len(want))
	}
	return schemas.PackedBatches.Encode(nil, batch)
}

// batchDiff names the first field where two encoded batches differ.
func batchDiff(want, got []byte) string {
	a, err := schemas.PackedBatches.Decode(nil, want)
	if err != nil {
		return fmt.Sprintf("recorded batch does not decode: %v", err)
	}
	b, err := schemas.PackedBatches.Decode(nil, got)
	if err != nil {
		return fmt.Sprintf("replayed batch does not decode: %v", err)
	}
	if d := firstDiff("", reflect.ValueOf(a), reflect.ValueOf(b)); d != "" {
		return d
	}
	return fmt.Sprintf("encodings differ (%d and %d bytes) with equal fields", len(want), len(got))
}

// firstDiff walks two values of one type and describes the first
// difference by its field path.
func firstDiff(path string, a, b reflect.Value) string {
	switch a.Kind() {
	case reflect.Struct:
		for i := range a.NumField() {
			f := a.Type().Field(i)
			name := f.Name
			if tag, ok := f.Tag.Lookup("json"); ok {
				name = tag
			}
			p := name
			if path != "" {
				p = path + "." + name
			}
			if d := firstDiff(p, a.Field(i), b.Field(i)); d != "" {
				return d
			}
		}
		return ""
	case reflect.Slice:
		if a.Len() != b.Len() {
			return fmt.Sprintf("field %s: recorded length %d, replayed %d", path, a.Len(), b.Len())
		}
		for i := range a.Len() {
			if d := firstDiff(fmt.Sprintf("%s[%d]", path, i), a.Index(i), b.Index(i)); d != "" {
				return d
			}
		}
		return ""
	case reflect.Float32, reflect.Float64:
		x, y := a.Float(), b.Float()
		if math.Float64bits(x) != math.Float64bits(y) && !(math.IsNaN(x) && math.IsNaN(y)) {
			return fmt.Sprintf("field %s: recorded %v, replayed %v", path, x, y)
		}
		return ""
	}
	if !reflect.DeepEqual(a.Interface(), b.Interface()) {
		return fmt.Sprintf("field %s: recorded %v, replayed %v", path, a.Interface(), b.Interface())
	}
	return ""
}

// reemit produces every message of the snapshot into its topic, partition
// and order, with its key and headers (for re-running any stage from a
// snapshot).
func reemit(ctx context.Context, runDir, cpath string, cc kafka.ClientConfig) (int, error) {
	snap, err := parquet.ReadRun(runDir, nil, parquet.ReadOptions{})
	if err != nil {
		return 0, err
	}
	c, err := snapshotContract(runDir, cpath, snap.Info)
	if err != nil {
		return 0, err
	}
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return 0, err
	}
	if err := kafka.CreateTopics(ctx, cc, cc.Brokers, operators.TopicSpecs(c, topics)); err != nil {
		return 0, err
	}
	transport, err := cc.Transport()
	if err != nil {
		return 0, err
	}
	w := &kafkago.Writer{
		Addr: kafkago.TCP(cc.Brokers...), RequiredAcks: kafkago.RequireAll, BatchTimeout: 5 * time.Millisecond,
		BatchBytes: kafka.WriterBatchBytes(c.Topics.MaxMessageBytes),
		Balancer: kafkago.BalancerFunc(func(m kafkago.Message, parts ...int) int {
			if p, ok := m.WriterData.(int); ok && slices.Contains(parts, p) {
				return p
			}
			return parts[0]
		}),
	}
	if transport != nil {
		w.Transport = transport
	}
	defer w.Close()
	shorts := make([]string, 0, len(snap.Topics))
	for s := range snap.Topics {
		shorts = append(shorts, s)
	}
	slices.Sort(shorts)
	n := 0
	for _, s := range shorts {
		full := snap.FullTopics[s]
		msgs := snap.Topics[s]
		for len(msgs) > 0 {
			k := min(len(msgs), 256)
			batch := make([]kafkago.Message, k)
			for i, m := range msgs[:k] {
				batch[i] = kafkago.Message{Topic: full, Key: m.Key, Value: m.Value, Time: m.Time, WriterData: m.Partition}
				for _, h := range m.Headers {
					batch[i].Headers = append(batch[i].Headers, kafkago.Header{Key: h.Key, Value: h.Value})
				}
			}
			if err := w.WriteMessages(ctx, batch...); err != nil {
				return n, fmt.Errorf("re-emit %s: %w", full, err)
			}
			n += k
			msgs = msgs[k:]
		}
	}
	return n, nil
}
