package schemas

import (
	"bytes"
	"errors"
	"io"
	"reflect"
	"testing"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/ipc"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// Fuzz targets: every decoder returns an error or rows, never panics, and
// leaks nothing; whatever decodes re-encodes and decodes to the same rows.

// addSeeds adds the valid encoding and a few corruptions of it.
func addSeeds(f *testing.F, valid ...[]byte) {
	for _, b := range valid {
		f.Add(b)
		f.Add(b[:len(b)/2])
		flipped := append([]byte(nil), b...)
		for i := 8; i < len(flipped); i += 97 {
			flipped[i] ^= 0x5a
		}
		f.Add(flipped)
	}
	f.Add([]byte{})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0})
}

func fuzzCodec[T any](f *testing.F, c *Codec[T], samples []T) {
	b, err := c.Encode(memory.NewGoAllocator(), samples)
	if err != nil {
		f.Fatal(err)
	}
	empty, err := c.Encode(memory.NewGoAllocator(), nil)
	if err != nil {
		f.Fatal(err)
	}
	addSeeds(f, b, empty)
	f.Fuzz(func(t *testing.T, data []byte) {
		mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
		defer mem.AssertSize(t, 0)
		rows, err := c.Decode(mem, data)
		if err != nil {
			checkDecodeError(t, err)
			return
		}
		// Streams that start with the codec's schema message take the
		// engine's loader (internal/rowipc/load.go): whatever it accepts, Arrow's reader must
		// accept with the same rows; DecodeShared must agree too.
		viaArrow, err := c.rows.DecodeArrow(mem, data, false)
		if err != nil {
			t.Fatalf("decoded, but Arrow's reader refuses the stream: %v", err)
		}
		shared, err := c.DecodeShared(mem, data)
		if err != nil {
			t.Fatalf("Decode accepts the stream, DecodeShared refuses it: %v", err)
		}
		if len(rows) > 0 && (!same(reflect.ValueOf(rows), reflect.ValueOf(viaArrow)) || !same(reflect.ValueOf(rows), reflect.ValueOf(shared))) {
			t.Fatalf("the decoders disagree on the rows")
		}
		again, err := c.Encode(mem, rows)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		// The direct encoder writes what Arrow's writer writes for the
		// record ToRecord builds of the same rows.
		assertArrowBytes(t, mem, c, rows, again)
		rows2, err := c.Decode(mem, again)
		if err != nil {
			t.Fatalf("decode of re-encoding: %v", err)
		}
		if len(rows) > 0 && !same(reflect.ValueOf(rows), reflect.ValueOf(rows2)) {
			t.Fatalf("re-encoding changed the rows")
		}
	})
}

func checkDecodeError(t *testing.T, err error) {
	var ve *VersionError
	if !errors.Is(err, ErrDecode) && !errors.As(err, &ve) {
		t.Fatalf("error %v is neither ErrDecode nor *VersionError", err)
	}
}

func FuzzDecodeTaskAttempts(f *testing.F) { fuzzCodec(f, TaskAttempts, sampleTaskAttempts()) }
func FuzzDecodeTrajectories(f *testing.F) { fuzzCodec(f, Trajectories, sampleTrajectories()) }
func FuzzDecodeRewardComponents(f *testing.F) {
	fuzzCodec(f, RewardComponents, sampleRewardComponents())
}
func FuzzDecodeRewarded(f *testing.F) { fuzzCodec(f, RewardedTrajectories, sampleRewarded()) }
func FuzzDecodeScored(f *testing.F)   { fuzzCodec(f, ScoredTrajectories, sampleScored()) }

func FuzzDecodePackedBatch(f *testing.F) {
	b, err := PackedBatches.Encode(memory.NewGoAllocator(), samplePackedBatch())
	if err != nil {
		f.Fatal(err)
	}
	addSeeds(f, b)
	f.Fuzz(func(t *testing.T, data []byte) {
		mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
		defer mem.AssertSize(t, 0)
		batch, err := PackedBatches.Decode(mem, data)
		if err != nil {
			checkDecodeError(t, err)
			return
		}
		again, err := PackedBatches.Encode(mem, batch)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		batch2, err := PackedBatches.Decode(mem, again)
		if err != nil || !same(reflect.ValueOf(batch), reflect.ValueOf(batch2)) {
			t.Fatalf("re-encoding changed the batch (%v)", err)
		}
	})
}

func FuzzPeekKind(f *testing.F) {
	b, err := Trajectories.Encode(memory.NewGoAllocator(), sampleTrajectories())
	if err != nil {
		f.Fatal(err)
	}
	addSeeds(f, b)
	f.Fuzz(func(t *testing.T, data []byte) {
		if _, _, err := PeekKind(data); err != nil && !errors.Is(err, ErrDecode) {
			t.Fatalf("error %v does not wrap ErrDecode", err)
		}
	})
}

func FuzzDecodeRelease(f *testing.F) {
	b, err := EncodeRelease(sampleRelease())
	if err != nil {
		f.Fatal(err)
	}
	addSeeds(f, b)
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := DecodeRelease(data)
		if err != nil {
			checkDecodeError(t, err)
			return
		}
		again, err := EncodeRelease(r)
		if err != nil {
			t.Fatal(err)
		}
		if r2, err := DecodeRelease(again); err != nil || r2 != r {
			t.Fatalf("re-encoding changed the release: %+v %v", r2, err)
		}
	})
}

func FuzzDecodeCensus(f *testing.F) {
	b, err := EncodeCensus(sampleCensus())
	if err != nil {
		f.Fatal(err)
	}
	plain, err := EncodeCensus(CensusEvent{EventID: "e", RunID: "r", AttemptID: "a", Kind: CensusAdmitted, Stage: "pack", Tokens: 12, At: -3})
	if err != nil {
		f.Fatal(err)
	}
	addSeeds(f, b, plain)
	f.Fuzz(func(t *testing.T, data []byte) {
		e, err := DecodeCensus(data)
		if err != nil {
			checkDecodeError(t, err)
			return
		}
		// The canonical fast path accepts only what encoding/json reads
		// to the same event.
		if fast, ok := decodeCensusCanonical(data); ok {
			slow, err := decodeDoc[CensusEvent](KindCensusEvent, data)
			if err != nil || slow != fast {
				t.Fatalf("fast census decoder read %+v, encoding/json %+v (%v)", fast, slow, err)
			}
		}
		again, err := EncodeCensus(e)
		if err != nil {
			t.Fatal(err)
		}
		if e2, err := DecodeCensus(again); err != nil || e2 != e {
			t.Fatalf("re-encoding changed the event: %+v %v", e2, err)
		}
	})
}

// DecodeStream accepts only streams Arrow's own reader reads to the same
// rows, and refuses every stream that lacks the end-of-stream marker
// (which Arrow's reader accepts when it stops between two messages).
func FuzzDecodeStream(f *testing.F) {
	var recs []arrow.RecordBatch
	for _, g := range [][]Trajectory{sampleTrajectories()[:1], sampleTrajectories()[1:]} {
		rec, err := Trajectories.ToRecord(memory.NewGoAllocator(), g)
		if err != nil {
			f.Fatal(err)
		}
		defer rec.Release()
		recs = append(recs, rec)
	}
	var buf bytes.Buffer
	w := ipc.NewWriter(&buf, ipc.WithSchema(Trajectories.Schema()))
	for _, r := range recs {
		if err := w.Write(r); err != nil {
			f.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		f.Fatal(err)
	}
	one, err := Trajectories.Encode(memory.NewGoAllocator(), sampleTrajectories())
	if err != nil {
		f.Fatal(err)
	}
	addSeeds(f, buf.Bytes(), one)
	f.Fuzz(func(t *testing.T, data []byte) {
		mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
		defer mem.AssertSize(t, 0)
		rows, err := Trajectories.DecodeStream(mem, data)
		if err != nil {
			checkDecodeError(t, err)
			return
		}
		if !bytes.HasSuffix(data, ipcEOS) && !bytes.HasSuffix(data, []byte{0, 0, 0, 0}) {
			t.Fatalf("decoded %d rows of a stream without an end-of-stream marker", len(rows))
		}
		r, err := ipc.NewReader(bytes.NewReader(data), ipc.WithAllocator(mem))
		if err != nil {
			t.Fatalf("decoded, but Arrow's reader refuses the stream: %v", err)
		}
		defer r.Release()
		var viaArrow []Trajectory
		for r.Next() {
			got, err := Trajectories.FromRecord(r.RecordBatch())
			if err != nil {
				t.Fatalf("decoded, but the rows of Arrow's reader do not: %v", err)
			}
			viaArrow = append(viaArrow, got...)
		}
		if err := r.Err(); err != nil && !errors.Is(err, io.EOF) {
			t.Fatalf("decoded, but Arrow's reader fails: %v", err)
		}
		if len(rows) != len(viaArrow) || (len(rows) > 0 && !same(reflect.ValueOf(rows), reflect.ValueOf(viaArrow))) {
			t.Fatalf("DecodeStream and Arrow's reader disagree on the rows")
		}
	})
}

// fuzzDoc fuzzes a JSON document decoder: a refusal wraps ErrDecode, and
// what it accepts re-encodes to a document that decodes and re-encodes to
// the same bytes.
func fuzzDoc[T any](f *testing.F, enc func(T) ([]byte, error), dec func([]byte) (T, error), seeds ...T) {
	for _, s := range seeds {
		b, err := enc(s)
		if err != nil {
			f.Fatal(err)
		}
		addSeeds(f, b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		v, err := dec(data)
		if err != nil {
			checkDecodeError(t, err)
			return
		}
		once, err := enc(v)
		if err != nil {
			t.Fatal(err)
		}
		v2, err := dec(once)
		if err != nil {
			t.Fatalf("a re-encoded document does not decode: %v", err)
		}
		twice, err := enc(v2)
		if err != nil || !bytes.Equal(once, twice) {
			t.Fatalf("re-encoding is not stable:\n%s\n%s (%v)", once, twice, err)
		}
	})
}

func FuzzDecodeEvaluation(f *testing.F) {
	to := int64(3)
	fuzzDoc(f, EncodeEvaluation, DecodeEvaluation,
		EvaluationRecord{RunID: "r", PolicyVersion: 4, RolledBackTo: &to, KL: Estimate{Value: 0.1, Lo: 0.05, Hi: 0.2, N: 64}},
		EvaluationRecord{RunID: "r", PolicyVersion: 5, Evaluation: &GateEvaluation{Version: 5, Metrics: map[string]Estimate{"m": {Value: 1, N: 2}}},
			Suites: []SuiteResult{{Suite: "heldout", Tasks: 2, PassAtK: &Estimate{Value: 0.5}}}, OptimizerTokens: 10, StepSeconds: 0.5})
}

func FuzzDecodeIncident(f *testing.F) {
	fuzzDoc(f, EncodeIncident, DecodeIncident,
		Incident{IncidentID: "i", RunID: "r", AttemptID: "a", TaskID: "t", Stage: "validate", Reason: "token_range",
			Detail: "tokens[3] = 99", Source: "trajectories/1@42", At: 7},
		Incident{})
}

func FuzzDecodeUpdate(f *testing.F) {
	fuzzDoc(f, EncodeUpdate, DecodeUpdate,
		UpdateRecord{Version: 3, BatchID: "b", BatchIndex: 2, Metrics: UpdateMetrics{GradNorm: 0.5, Rows: 4, Segments: 9},
			Last: ObjectiveStats{Loss: -0.25, Tokens: 40, Sequences: 9}, Duplicates: 1, MaxLag: 2, StalePolicy: "mask",
			StaleTokens: 5, StaleSegments: 1, NotTrained: []string{"x"}, StaleLag: []LagCount{{Lag: 3, Tokens: 5}},
			Lag: []LagCount{{Lag: 0, Tokens: 35}}, Selection: &UpdateSelection{Segments: 9, TrainedSegments: 8},
			StepSeconds: 0.125, MinibatchOrder: [][][]int{{{1, 0}, {2, 3}}}},
		UpdateRecord{})
}

func FuzzDecodeWeightAck(f *testing.F) {
	fuzzDoc(f, EncodeWeightAck, DecodeWeightAck,
		WeightAck{RunID: "r", Replica: "http://127.0.0.1:8080", Protocol: "llamacpp", Version: 4, Loaded: true,
			Model: "trajflow-v4", Checksum: "ab12", Unloaded: []int64{2}, At: 9},
		WeightAck{Replica: "x", Protocol: "vllm", Error: "load failed"})
}

func FuzzDecodeGateDecision(f *testing.F) {
	fuzzDoc(f, EncodeGateDecision, DecodeGateDecision,
		GateDecision{RunID: "r", PolicyVersion: 5, Action: GateRollback, RollbackTo: 0, Checks: []GateCheck{{Kind: "kl", Value: 1}},
			Resume: &GateResume{State: GateState{EvalsWithoutGain: 2}, Usage: GateUsage{RolloutTokens: 7}}},
		GateDecision{RunID: "r", Action: GateHalted, RoundsDispatched: 9})
}
