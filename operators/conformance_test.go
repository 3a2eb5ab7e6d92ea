package operators_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http/httptest"
	"regexp"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/ipc"

	"github.com/trajflow/trajflow/connectors/policy/serve"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// The conformance suite: every stage of the registry (operators.Specs) is
// driven offline (pipeline.Drive) over real inputs made by the stages
// upstream of it, and must
//   - be deterministic under redelivery: the same inputs, driven twice on
//     fresh instances, give byte-identical outputs (keys, values, headers);
//   - refuse, never panic on, garbage, a record of another kind and a record
//     of an unknown version on each of its input topics;
//   - release every input it held at most once (never twice);
//   - survive a second call of every output's Release and a second Close;
//   - give every output it produces (quarantine records aside) a
//     deterministic id and a W3C traceparent.
// A stage gets the suite by being registered: the loop below has no list
// of its own.

// fixedNow is the clock of every drive: outputs do not depend on the time.
func fixedNow() time.Time { return time.Unix(1_800_000_000, 0) }

type chain struct {
	deps   operators.Deps
	topics pipeline.Topics
	// msgs holds every message the upstream stages produced, by full
	// topic name, in production order.
	msgs map[string][]pipeline.Message
}

func conformanceContract(t testing.TB) *contract.Contract {
	t.Helper()
	c := contract.Default()
	c.RunID = "conf"
	c.Dispatch.TasksPerUpdate, c.Dispatch.GroupsPerUpdate = 2, 2
	c.Sampler.GroupSize = 4
	c.Packing.BatchGroups = 2
	c.Estimator.ZeroVariance = "keep"
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	return c
}

func newDeps(t testing.TB, c *contract.Contract) operators.Deps {
	t.Helper()
	reg, err := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	if err != nil {
		t.Fatal(err)
	}
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		t.Fatal(err)
	}
	return operators.Deps{
		Contract: c, Topics: topics, Tasks: reg, VocabSize: rollout.VocabSize,
		Evaluators: []reward.Evaluator{rollout.NewValidator(reg)}, EvalDenylist: reg.IsEval,
		ReleaseDir: t.TempDir(), SnapshotDir: t.TempDir(), Rounds: 1,
	}
}

// drive runs a new instance of stage name over its inputs from ch.
func (ch *chain) drive(t testing.TB, name string, deps operators.Deps) *pipeline.Driven {
	t.Helper()
	st, err := operators.New(name, deps)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	d, err := driveStage(context.Background(), st, ch.inputs(name), ch.side(name), deps)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return d
}

func driveStage(ctx context.Context, st pipeline.Stage, inputs, side []pipeline.Message, deps operators.Deps) (d *pipeline.Driven, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v\n%s", p, debug.Stack())
		}
	}()
	files, err := pipeline.NewDirReleases(deps.ReleaseDir)
	if err != nil {
		return nil, err
	}
	return pipeline.Drive(ctx, st, inputs, pipeline.DriveConfig{
		QuarantineTopic: deps.Topics.Quarantine, Side: side, TickAt: fixedNow().Add(time.Hour),
		Env: pipeline.EnvConfig{Now: fixedNow, Releases: files, Scanner: pipeline.MemScanner{}},
	})
}

// inputs are the messages of the stage's input topics, in topology order.
func (ch *chain) inputs(name string) []pipeline.Message {
	var in []pipeline.Message
	for _, short := range pipeline.InputsOf(name) {
		in = append(in, ch.msgs[ch.topics.Name(short)]...)
	}
	return in
}

func (ch *chain) side(name string) []pipeline.Message {
	var in []pipeline.Message
	for _, short := range pipeline.SideInputsOf(name) {
		in = append(in, ch.msgs[ch.topics.Name(short)]...)
	}
	return in
}

// record adds d's outputs to the chain's topics.
func (ch *chain) record(d *pipeline.Driven) {
	for _, o := range d.Outputs {
		n := int64(len(ch.msgs[o.Topic]))
		ch.msgs[o.Topic] = append(ch.msgs[o.Topic], pipeline.Message{
			Ref: pipeline.Ref{Topic: o.Topic, Offset: n}, Key: o.Key, Value: bytes.Clone(o.Value),
			Headers: slices.Clone(o.Headers), Time: fixedNow(),
		})
	}
}

// buildChain runs the loop once, stage after stage in pipeline order, so
// that every stage has real inputs: train first (it publishes version 0),
// then dispatch, rollout, validate, reward, advantage, pack, and train on
// the batch (and, with the built-in policy, eval on release 0). With
// served, the contract's policy runs on a policy server
// (the built-in policy over SGLang's protocol, connectors/policy/serve,
// reading the chain's releases): weight sync loads version 0 into it
// before dispatch, and rollout generates there.
func buildChain(t testing.TB, served bool) *chain {
	t.Helper()
	c := conformanceContract(t)
	ch := &chain{deps: newDeps(t, c), msgs: map[string][]pipeline.Message{}}
	ch.topics = ch.deps.Topics
	stages := []string{"dispatch", "rollout", "validate", "reward", "advantage", "pack"}
	if served {
		srv, err := serve.New(serve.Config{Protocol: contract.PolicySGLang, Releases: ch.deps.ReleaseDir, Grammar: ch.deps.Tasks.Grammar()})
		if err != nil {
			t.Fatal(err)
		}
		hs := httptest.NewServer(srv)
		t.Cleanup(hs.Close)
		c = c.Clone()
		c.Policy.Protocol, c.Policy.Endpoints = contract.PolicySGLang, []string{hs.URL}
		if err := c.Resolve(); err != nil {
			t.Fatal(err)
		}
		ch.deps.Contract = c
		stages = append([]string{"weightsync"}, stages...)
	} else {
		stages = append(stages, "eval") // release 0 measured: the gate's input
	}
	ch.record(ch.drive(t, "train", ch.deps)) // version 0
	for _, name := range stages {
		d := ch.drive(t, name, ch.deps)
		if len(d.Outputs) == 0 {
			t.Fatalf("%s produced nothing: the chain is broken", name)
		}
		ch.record(d)
	}
	if len(ch.msgs[ch.topics.Batches]) == 0 {
		t.Fatal("the chain made no batch")
	}
	return ch
}

var traceRe = regexp.MustCompile(`^00-[0-9a-f]{32}-[0-9a-f]{16}-01$`)

func header(hs []pipeline.Header, key string) string {
	for _, h := range hs {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// TestConformance runs the suite over the loop with the built-in policy in
// process. A stage that needs policy servers (weight sync) must refuse
// that contract with operators.ErrNoPolicyServer; it runs in
// TestConformanceServed.
func TestConformance(t *testing.T) { conformance(t, buildChain(t, false)) }

// TestConformanceServed runs the suite over the loop whose policy runs on
// a policy server: every stage, weight sync and rollout on the server
// included.
func TestConformanceServed(t *testing.T) { conformance(t, buildChain(t, true)) }

func conformance(t *testing.T, ch *chain) {
	for _, spec := range operators.Specs() {
		t.Run(spec.Name, func(t *testing.T) {
			deps := ch.deps
			if ch.deps.Contract.Policy.Protocol == contract.PolicyBuiltin {
				if _, err := operators.New(spec.Name, deps); errors.Is(err, operators.ErrNoPolicyServer) {
					return // the refusal the builtin policy gets: nothing to load releases into
				}
			} else if _, err := operators.New(spec.Name, deps); errors.Is(err, operators.ErrServedPolicy) {
				return // the refusal a served policy gets: the evaluation plane runs the built-in one
			}
			deps.SnapshotDir = t.TempDir()
			first := ch.drive(t, spec.Name, deps)
			if spec.Name != pipeline.SnapshotStage && len(first.Outputs) == 0 {
				t.Fatalf("no output from %d inputs", len(ch.inputs(spec.Name)))
			}
			// Each subtest works on its own copy of deps with its own
			// snapshot directory, set before any stage is made: a stage made
			// with a directory an earlier subtest owned would write into it
			// after that subtest removed it.
			t.Run("deterministic under redelivery", func(t *testing.T) {
				deps := deps
				deps.SnapshotDir = t.TempDir()
				second := ch.drive(t, spec.Name, deps)
				if err := sameOutputs(first.Outputs, second.Outputs); err != nil {
					t.Fatal(err)
				}
			})
			t.Run("ids and traceparents", func(t *testing.T) {
				for _, o := range first.Outputs {
					if o.Topic == deps.Topics.Quarantine {
						continue
					}
					if header(o.Headers, schemas.HeaderID) == "" || !traceRe.MatchString(header(o.Headers, schemas.HeaderTrace)) {
						t.Fatalf("output to %s without an id or a traceparent: %v", o.Topic, o.Headers)
					}
				}
			})
			t.Run("held inputs released at most once", func(t *testing.T) {
				seen := map[pipeline.Ref]int{}
				for _, r := range first.Released {
					if seen[r]++; seen[r] > 1 {
						t.Fatalf("input %s released twice", r)
					}
				}
				for _, r := range first.Held {
					if seen[r] > 0 {
						t.Fatalf("input %s both released and still held", r)
					}
				}
			})
			t.Run("release callbacks and close twice", func(t *testing.T) {
				deps := deps
				deps.SnapshotDir = t.TempDir()
				st, err := operators.New(spec.Name, deps)
				if err != nil {
					t.Fatal(err)
				}
				d, err := driveStage(context.Background(), st, ch.inputs(spec.Name), ch.side(spec.Name), deps)
				if err != nil {
					t.Fatal(err)
				}
				kept := copyOutputs(d.Outputs)
				for _, o := range d.Outputs {
					if o.Release != nil {
						o.Release()
						o.Release()
					}
				}
				if c, ok := st.(io.Closer); ok {
					if err := c.Close(); err != nil {
						t.Fatalf("second Close: %v", err)
					}
				}
				deps.SnapshotDir = t.TempDir()
				again := ch.drive(t, spec.Name, deps)
				if err := sameOutputs(kept, again.Outputs); err != nil {
					t.Fatalf("after releasing every output twice: %v", err)
				}
			})
			for _, short := range pipeline.InputsOf(spec.Name) {
				for _, bad := range badInputs(t, ch, short) {
					t.Run(bad.name+" on "+short, func(t *testing.T) {
						deps := deps
						deps.SnapshotDir = t.TempDir()
						st, err := operators.New(spec.Name, deps)
						if err != nil {
							t.Fatal(err)
						}
						d, err := driveStage(context.Background(), st, []pipeline.Message{bad.m}, ch.side(spec.Name), deps)
						if err != nil {
							t.Fatal(err)
						}
						if spec.Name == pipeline.SnapshotStage {
							// The snapshot keeps every record as it was, refused or
							// not: it must take it (held until durable), not drop it.
							if len(d.Held)+len(d.Released) == 0 && d.Quarantined == 0 {
								t.Fatal("the snapshot dropped a record")
							}
							return
						}
						q := d.On(deps.Topics.Quarantine)
						if d.Quarantined != 1 || len(q) != 1 {
							t.Fatalf("%d refused, %d quarantine records: want the record refused", d.Quarantined, len(q))
						}
						reason := header(q[0].Headers, schemas.HeaderReason)
						if !slices.Contains(bad.reasons, reason) {
							t.Fatalf("reason %q (%s), want one of %v", reason, header(q[0].Headers, schemas.HeaderDetail), bad.reasons)
						}
					})
				}
			}
		})
	}
}

type badInput struct {
	name    string
	m       pipeline.Message
	reasons []string
}

// badInputs are garbage, a record of another kind and a record of an
// unknown version, for the topic short.
func badInputs(t *testing.T, ch *chain, short string) []badInput {
	t.Helper()
	topic := ch.topics.Name(short)
	info, _ := pipeline.TopicInfoOf(short)
	msg := func(v []byte) pipeline.Message {
		return pipeline.Message{Ref: pipeline.Ref{Topic: topic, Offset: 1_000}, Key: []byte("bad"), Value: v, Time: fixedNow()}
	}
	decode := []string{"undecodable", "empty_message"}
	other := []string{"wrong_kind", "undecodable"}
	version := []string{"unknown_version"}
	out := []badInput{{"garbage", msg([]byte("\x00\x01 not a record at all")), decode}}
	switch info.Plane {
	case pipeline.PlaneArrow:
		wrong := ch.msgs[ch.topics.Tasks][0].Value // a tasks stream
		if short == "tasks" {
			wrong = ch.msgs[ch.topics.Trajectories][0].Value
		}
		out = append(out, badInput{"a record of another kind", msg(wrong), other})
		good := ch.msgs[topic]
		if len(good) == 0 {
			t.Fatalf("no record on %s to derive a bad version from", topic)
		}
		out = append(out, badInput{"an unknown version", msg(withVersion(t, good[0].Value, "99")), version})
	case pipeline.PlaneJSON:
		wrong := `{"kind":"census_event","version":1,"data":{"event_id":"e","run_id":"r","attempt_id":"a","kind":"started","stage":"s","at_us":1}}`
		if info.Kind == schemas.KindCensusEvent {
			wrong = `{"kind":"incident","version":1,"data":{"incident_id":"i","run_id":"r","reason":"eval_task_id","at_us":1}}`
		}
		out = append(out,
			badInput{"a record of another kind", msg([]byte(wrong)), other},
			badInput{"an unknown version", msg([]byte(`{"kind":"` + string(info.Kind) + `","version":99,"data":{}}`)), version})
	}
	return out
}

// withVersion re-encodes an Arrow IPC stream with its schema's version
// metadata set to v.
func withVersion(t *testing.T, b []byte, v string) []byte {
	t.Helper()
	r, err := ipc.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Release()
	if !r.Next() {
		t.Fatalf("no record batch: %v", r.Err())
	}
	rec := r.RecordBatch()
	md := rec.Schema().Metadata()
	keys, vals := slices.Clone(md.Keys()), slices.Clone(md.Values())
	for i, k := range keys {
		if k == schemas.MetaVersion {
			vals[i] = v
		}
	}
	m := arrow.NewMetadata(keys, vals)
	sc := arrow.NewSchema(rec.Schema().Fields(), &m)
	rec2 := array.NewRecordBatch(sc, rec.Columns(), rec.NumRows())
	defer rec2.Release()
	var buf bytes.Buffer
	w := ipc.NewWriter(&buf, ipc.WithSchema(sc))
	if err := w.Write(rec2); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func copyOutputs(outs []pipeline.Output) []pipeline.Output {
	c := make([]pipeline.Output, len(outs))
	for i, o := range outs {
		c[i] = pipeline.Output{Topic: o.Topic, Key: bytes.Clone(o.Key), Value: bytes.Clone(o.Value), Headers: slices.Clone(o.Headers)}
	}
	return c
}

func sameOutputs(a, b []pipeline.Output) error {
	if len(a) != len(b) {
		return fmt.Errorf("%d outputs, then %d", len(a), len(b))
	}
	for i := range a {
		x, y := a[i], b[i]
		if x.Topic != y.Topic || !bytes.Equal(x.Key, y.Key) || !bytes.Equal(x.Value, y.Value) {
			return fmt.Errorf("output %d to %s differs (key %q vs %q, %d vs %d bytes)", i, x.Topic, x.Key, y.Key, len(x.Value), len(y.Value))
		}
		if len(x.Headers) != len(y.Headers) {
			return fmt.Errorf("output %d to %s: headers %v vs %v", i, x.Topic, x.Headers, y.Headers)
		}
		for j := range x.Headers {
			if x.Headers[j].Key != y.Headers[j].Key || !bytes.Equal(x.Headers[j].Value, y.Headers[j].Value) {
				return fmt.Errorf("output %d to %s: header %s %q vs %q", i, x.Topic, x.Headers[j].Key, x.Headers[j].Value, y.Headers[j].Value)
			}
		}
	}
	return nil
}

// TestServedChainSameBatches: the loop with its policy on a policy server
// (over SGLang's protocol) makes the same batches, byte for byte, as the
// loop with the built-in policy in process; its trajectories record the
// server's sampler id, and its weight acknowledgement names version 0 and
// the checkpoint's hash.
func TestServedChainSameBatches(t *testing.T) {
	in, served := buildChain(t, false), buildChain(t, true)
	a, b := in.msgs[in.topics.Batches], served.msgs[served.topics.Batches]
	if len(a) == 0 || len(a) != len(b) {
		t.Fatalf("%d batches in process, %d served", len(a), len(b))
	}
	for i := range a {
		if !bytes.Equal(a[i].Value, b[i].Value) {
			t.Fatalf("batch %d differs between the in-process and the served loop", i)
		}
	}
	ack, err := schemas.DecodeWeightAck(served.msgs[served.topics.Weights][0].Value)
	if err != nil || !ack.Loaded || ack.Version != 0 || !strings.HasPrefix(ack.Checksum, "sha256:") {
		t.Fatalf("weight ack %+v %v", ack, err)
	}
	trajs := func(ch *chain) schemas.Trajectory {
		rows, err := schemas.Trajectories.Decode(nil, ch.msgs[ch.topics.Trajectories][0].Value)
		if err != nil {
			t.Fatal(err)
		}
		return rows[0]
	}
	ta, tb := trajs(in), trajs(served)
	if ta.SamplerID == tb.SamplerID || tb.TokenizerHash != rollout.TokenizerHash || tb.Turns[0].PolicyVersion != 0 {
		t.Fatalf("in process sampler %s, served sampler %s tokenizer %s", ta.SamplerID, tb.SamplerID, tb.TokenizerHash)
	}
}
