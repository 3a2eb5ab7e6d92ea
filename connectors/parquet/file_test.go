package parquet

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"
	pq "github.com/parquet-go/parquet-go"
	"github.com/parquet-go/parquet-go/encoding/thrift"
	"github.com/parquet-go/parquet-go/format"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

const testRun = "snaptest"

// trajMessages encodes groups [0, n) of synthetic trajectories as the
// messages of partition 0 starting at offset from.
func trajMessages(t testing.TB, n int, from int64) []Message {
	t.Helper()
	s := synth.Default()
	s.RunID = testRun
	s.MeanTokens, s.MaxTokens = 300, 2000
	var msgs []Message
	for g := range int64(n) {
		rows := s.Group(g)
		b, err := schemas.Trajectories.Encode(nil, rows)
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, Message{
			Offset: from + g, Key: []byte(rows[0].GroupID), Value: b,
			Headers: []pipeline.Header{{Key: schemas.HeaderKind, Value: []byte(schemas.KindTrajectory)}},
			Time:    time.UnixMicro(1_700_000_000_000_000 + g).UTC(),
		})
	}
	return msgs
}

func testBatch() schemas.PackedBatch {
	return schemas.PackedBatch{
		BatchID: schemas.BatchID(testRun, 3), BatchIndex: 3, RunID: testRun, ContractHash: "sha256:00",
		TrainerVersion: 2, TokenBudget: 8,
		Rows: []schemas.PackedRow{{
			InputIDs: []int32{1, 2, 3, 4}, PositionIDs: []int32{0, 1, 0, 1}, SegmentIDs: []int32{0, 0, 1, 1},
			ActionMask: []uint8{1, 0, 1, 0}, OldLogprobs: []float32{-0.5, 0, -0.25, 0},
			Advantages: []float32{1, 0, -1, 0}, ValueTargets: []float32{0, 0, 0, 0},
			TurnIDs: []int32{0, -1, 0, -1}, PolicyVersions: []int32{2, -1, 1, -1},
			SegTrajectoryIDs: []string{"a", "b"}, SegGroupIDs: []string{"g", "g"},
			SegPolicyVersions: []int64{2, 1}, SegLengths: []int32{2, 2}, SegWeights: []float32{1, 1},
			SegTruncated: []bool{false, true},
		}},
	}
}

// cutStream drops the end-of-stream marker of message i's value: the
// stream then ends exactly at a record-batch boundary.
func cutStream(msgs []Message, i int) []Message {
	v := msgs[i].Value
	msgs[i].Value = v[: len(v)-8 : len(v)-8]
	return msgs
}

func TestWriteReadRoundTrip(t *testing.T) {
	mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
	defer mem.AssertSize(t, 0)
	dir := t.TempDir()
	census, err := schemas.EncodeCensus(schemas.CensusEvent{RunID: testRun, AttemptID: "x", Kind: schemas.CensusFiltered, Stage: "pack", Reason: "stale", At: 5})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := schemas.PackedBatches.Encode(nil, testBatch())
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		topic string
		msgs  []Message
	}{
		{"trajectories", "trajectories", trajMessages(t, 6, 10)},
		{"undecodable data-plane messages stay", "trajectories", append(trajMessages(t, 2, 0),
			Message{Offset: 2, Value: []byte("not arrow")}, Message{Offset: 3})},
		{"a stream cut before its end-of-stream marker stays whole", "trajectories", cutStream(trajMessages(t, 3, 0), 1)},
		{"batches", "batches", []Message{{Offset: 0, Key: []byte("b"), Value: batch}}},
		{"census", "census", []Message{{Offset: 7, Key: []byte("x"), Value: census}, {Offset: 8, Value: []byte("{bad json")}}},
		{"quarantine keeps binary values", "quarantine", []Message{{Offset: 0, Value: []byte{0, 1, 2, 255, 0}, Headers: []pipeline.Header{
			{Key: schemas.HeaderReason, Value: []byte("undecodable")}, {Key: schemas.HeaderSourceOffset, Value: []byte("12")}}}}},
		{"windows", "windows", []Message{{Offset: 0, Value: []byte(`{"batch_id":"b","admitted":["a","b"],"filtered":[{"RecordID":"c","GroupID":"g","Filter":"stale"}]}`)}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			target := Target{Dir: dir, Run: testRun, Topic: testRun + "." + tc.topic, ContractHash: "sha256:00"}
			for i := range tc.msgs {
				tc.msgs[i].Partition = 1
			}
			path, lin, err := WriteFile(target, 1, tc.msgs, WriteOptions{Mem: mem})
			if err != nil {
				t.Fatal(err)
			}
			if want := FileName(tc.msgs[0].Offset, tc.msgs[len(tc.msgs)-1].Offset); filepath.Base(path) != want {
				t.Fatalf("file %s, want %s", path, want)
			}
			got, msgs, err := ReadFile(path, ReadOptions{Mem: mem})
			if err != nil {
				t.Fatal(err)
			}
			if got != lin {
				t.Fatalf("lineage read %+v, written %+v", got, lin)
			}
			if len(msgs) != len(tc.msgs) {
				t.Fatalf("%d messages read, %d written", len(msgs), len(tc.msgs))
			}
			for i := range msgs {
				w, g := tc.msgs[i], msgs[i]
				if !bytes.Equal(w.Value, g.Value) || !bytes.Equal(w.Key, g.Key) || g.Offset != w.Offset || !g.Time.Equal(w.Time) || len(g.Headers) != len(w.Headers) {
					t.Fatalf("message %d differs: wrote offset %d key %q %d bytes, read offset %d key %q %d bytes",
						i, w.Offset, w.Key, len(w.Value), g.Offset, g.Key, len(g.Value))
				}
			}
		})
	}
}

func TestCorruptionNamesFile(t *testing.T) {
	dir := t.TempDir()
	msgs := trajMessages(t, 4, 0)
	path, _, err := WriteFile(Target{Dir: dir, Run: testRun, Topic: testRun + ".trajectories"}, 0, msgs, WriteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	orig, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, at := range []int{0, 4, len(orig) / 3, len(orig) / 2, len(orig) - 100, len(orig) - 9, len(orig) - 1} {
		b := bytes.Clone(orig)
		b[at] ^= 0x20
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		_, _, err := ReadFile(path, ReadOptions{})
		if err == nil || !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), path) {
			t.Fatalf("byte %d flipped: err %v, want ErrCorrupt naming %s", at, err, path)
		}
	}
	// Without the sidecar the file's own lineage hashes still catch a
	// changed value.
	if err := os.WriteFile(path, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ReadFile(path, ReadOptions{}); err != nil {
		t.Fatalf("restored file: %v", err)
	}
	if err := os.Remove(SidecarPath(path)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ReadFile(path, ReadOptions{}); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("missing sidecar: %v", err)
	}
}

// TestControlRowCountBounded: a control-plane file whose footer claims
// more rows than it holds (its sidecar matching, so the bytes reach the
// decoder) is refused naming the claim; the rows are never sized by it.
func TestControlRowCountBounded(t *testing.T) {
	dir := t.TempDir()
	msgs := []Message{{Offset: 0, Value: []byte(`{"kind":"census_event","version":1,"data":{"attempt_id":"a","kind":"admitted"}}`)},
		{Offset: 1, Value: []byte(`{"kind":"census_event","version":1,"data":{"attempt_id":"b","kind":"admitted"}}`)}}
	path, _, err := WriteFile(Target{Dir: dir, Run: testRun, Topic: testRun + ".census"}, 0, msgs, WriteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// The footer: thrift FileMetaData, its length, "PAR1".
	flen := int(binary.LittleEndian.Uint32(b[len(b)-8:]))
	body, footer := b[:len(b)-8-flen], b[len(b)-8-flen:len(b)-8]
	var md format.FileMetaData
	if err := thrift.Unmarshal(new(thrift.CompactProtocol), footer, &md); err != nil {
		t.Fatal(err)
	}
	const claim = 1 << 40
	md.NumRows, md.RowGroups[0].NumRows = claim, claim
	footer, err = thrift.Marshal(new(thrift.CompactProtocol), &md)
	if err != nil {
		t.Fatal(err)
	}
	b = binary.LittleEndian.AppendUint32(append(bytes.Clone(body), footer...), uint32(len(footer)))
	b = append(b, "PAR1"...)
	sum := sha256.Sum256(b)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(SidecarPath(path), []byte(hex.EncodeToString(sum[:])+"  x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, _, err = ReadFile(path, ReadOptions{})
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), fmt.Sprintf("footer declares %d rows", claim)) {
		t.Fatalf("footer claiming %d rows: %v, want ErrCorrupt naming %s and the claim", claim, err, path)
	}
}

func TestListAndContiguity(t *testing.T) {
	dir := t.TempDir()
	target := Target{Dir: dir, Run: testRun, Topic: testRun + ".trajectories"}
	all := trajMessages(t, 9, 0)
	for _, r := range [][2]int{{0, 3}, {3, 5}, {6, 9}} {
		if _, _, err := WriteFile(target, 0, all[r[0]:r[1]], WriteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	files, err := List(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 3 || files[0].FirstOffset != 0 || files[2].LastOffset != 8 || files[1].Topic != "trajectories" {
		t.Fatalf("files %+v", files)
	}
	gaps := Contiguity(files)
	if len(gaps) != 1 || gaps[0].After != 4 || gaps[0].Next != 6 {
		t.Fatalf("gaps %v, want one after 4", gaps)
	}
}

// TestCensusColumns: the typed columns of a census file carry the event's
// fields, the stale tokens of the lag rule among them, for queries that
// do not decode _value.
func TestCensusColumns(t *testing.T) {
	ev := schemas.CensusEvent{RunID: testRun, AttemptID: "x", GroupID: "g", Kind: schemas.CensusFiltered, Stage: "pack",
		Reason: "stale", PolicyVersion: 3, StaleTokens: 17, At: 5}
	v, err := schemas.EncodeCensus(ev)
	if err != nil {
		t.Fatal(err)
	}
	path, _, err := WriteFile(Target{Dir: t.TempDir(), Run: testRun, Topic: testRun + ".census"}, 0, []Message{{Offset: 4, Value: v}}, WriteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rows, err := pq.ReadFile[ControlRow](path)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 1 {
		t.Fatalf("%d rows, want 1", len(rows))
	}
	r := rows[0]
	got := schemas.CensusEvent{RunID: r.RunID, AttemptID: r.AttemptID, GroupID: r.GroupID, Kind: r.Kind, Stage: r.Stage,
		Reason: r.Reason, PolicyVersion: r.PolicyVersion, StaleTokens: r.StaleTokens, At: r.At}
	if got != ev {
		t.Errorf("columns %+v, want %+v", got, ev)
	}
}
