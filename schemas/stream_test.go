package schemas

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/apache/arrow-go/v18/arrow"
)

// legacyEnd replaces the 8-byte end-of-stream marker of b by the 4-byte
// zero length that streams written before Arrow 0.15 end with.
func legacyEnd(t *testing.T, b []byte) []byte {
	t.Helper()
	if !bytes.HasSuffix(b, ipcEOS) {
		t.Fatalf("stream does not end with the end-of-stream marker")
	}
	return append(append([]byte(nil), b[:len(b)-len(ipcEOS)]...), 0, 0, 0, 0)
}

// Both end-of-stream markers end a stream, for the loader of a codec's own
// schema message and for Arrow's reader (a schema written by another
// writer); nothing else does.
func TestStreamEndMarkers(t *testing.T) {
	mem := newMem(t)
	want := sampleTrajectories()[2:]
	good, err := Trajectories.Encode(mem, want)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasSuffix(good, ipcEOS) {
		t.Fatalf("Encode does not end with the 8-byte end-of-stream marker")
	}
	rec, err := Trajectories.ToRecord(mem, want)
	if err != nil {
		t.Fatal(err)
	}
	arrowWritten := writeRaw(t, mem, rec.Schema(), []arrow.RecordBatch{rec})
	rec.Release()
	if !bytes.HasSuffix(arrowWritten, ipcEOS) {
		t.Fatalf("Arrow's writer does not end with the 8-byte end-of-stream marker")
	}
	viaArrow := func(b []byte) ([]Trajectory, error) {
		rows, err := Trajectories.rows.DecodeArrow(mem, b, false)
		return rows, Trajectories.decodeErr(err)
	}
	for _, tt := range []struct {
		name   string
		data   []byte
		decode func([]byte) ([]Trajectory, error)
	}{
		{"loader, 8-byte marker", good, func(b []byte) ([]Trajectory, error) { return Trajectories.Decode(mem, b) }},
		{"loader, legacy 4-byte marker", legacyEnd(t, good), func(b []byte) ([]Trajectory, error) { return Trajectories.Decode(mem, b) }},
		{"arrow reader, 8-byte marker", good, viaArrow},
		{"arrow reader, legacy 4-byte marker", legacyEnd(t, good), viaArrow},
		{"stream reader, 8-byte marker", good, func(b []byte) ([]Trajectory, error) { return Trajectories.DecodeStream(mem, b) }},
		{"stream reader, legacy 4-byte marker", legacyEnd(t, good), func(b []byte) ([]Trajectory, error) { return Trajectories.DecodeStream(mem, b) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.decode(tt.data)
			if err != nil {
				t.Fatal(err)
			}
			assertSame(t, "rows", got, want)
			for _, bad := range []struct {
				name string
				data []byte
			}{
				{"last 4 bytes cut", tt.data[:len(tt.data)-4]},
				{"marker and a byte", append(append([]byte(nil), tt.data...), 0)},
			} {
				if _, err := tt.decode(bad.data); !errors.Is(err, ErrDecode) {
					t.Errorf("%s: got %v, want ErrDecode", bad.name, err)
				}
			}
		})
	}
}

// streamOf writes groups of trajectories as one stream of one record batch
// per group, with Arrow's writer, as the offline tools write files.
func streamOf(t *testing.T, groups ...[]Trajectory) (b []byte, ends []int) {
	t.Helper()
	mem := newMem(t)
	var recs []arrow.RecordBatch
	for _, g := range groups {
		rec, err := Trajectories.ToRecord(mem, g)
		if err != nil {
			t.Fatal(err)
		}
		defer rec.Release()
		recs = append(recs, rec)
	}
	b = writeRaw(t, mem, Trajectories.Schema(), recs)
	// The message boundaries: after the schema, after each batch.
	return b, messageEnds(t, b)
}

// A stream of several record batches decodes whole; cut at any byte, and in
// particular exactly between two record batches (where Arrow's reader sees
// a clean end), it is an error naming the missing end-of-stream marker, so
// a group cut in two is never read as a smaller group.
func TestDecodeStreamRefusesTruncation(t *testing.T) {
	mem := newMem(t)
	all := sampleTrajectories()
	groups := [][]Trajectory{all[:1], all[1:2], all[2:]}
	b, ends := streamOf(t, groups...)
	if len(ends) != 1+len(groups) {
		t.Fatalf("%d message ends, want %d", len(ends), 1+len(groups))
	}
	got, err := Trajectories.DecodeStream(mem, b)
	if err != nil {
		t.Fatal(err)
	}
	assertSame(t, "rows", got, all)
	if got, err := Trajectories.DecodeStream(mem, legacyEnd(t, b)); err != nil {
		t.Fatalf("legacy end-of-stream marker: %v", err)
	} else {
		assertSame(t, "rows", got, all)
	}
	for _, end := range ends {
		rows, err := Trajectories.DecodeStream(mem, b[:end:end])
		if !errors.Is(err, ErrDecode) || !strings.Contains(err.Error(), "no end-of-stream marker") {
			t.Fatalf("cut after the message ending at byte %d: %d rows, err %v; want ErrDecode naming the missing marker", end, len(rows), err)
		}
	}
	for cut := range len(b) {
		if rows, err := Trajectories.DecodeStream(mem, b[:cut:cut]); !errors.Is(err, ErrDecode) {
			t.Fatalf("cut at %d of %d: %d rows, err %v; want ErrDecode", cut, len(b), len(rows), err)
		}
	}
	// ReadStream, the kind-free form, refuses the same cut.
	n := 0
	err = ReadStream(mem, b[:ends[1]:ends[1]], func(arrow.RecordBatch) error { n++; return nil })
	if !errors.Is(err, ErrDecode) || n != 0 {
		t.Fatalf("ReadStream of a stream cut after its first batch: %d batches, err %v", n, err)
	}
}

func TestDecodeStreamKindAndEmpty(t *testing.T) {
	mem := newMem(t)
	schemaOnly := writeRaw(t, mem, Trajectories.Schema(), nil)
	rows, err := Trajectories.DecodeStream(mem, schemaOnly)
	if err != nil || len(rows) != 0 {
		t.Fatalf("schema and no batch: %d rows, err %v", len(rows), err)
	}
	var ve *VersionError
	if _, err := TaskAttempts.DecodeStream(mem, schemaOnly); !errors.As(err, &ve) {
		t.Fatalf("trajectory stream decoded as task attempts: %v, want *VersionError", err)
	}
	b, _ := streamOf(t, sampleTrajectories())
	if _, err := TaskAttempts.DecodeStream(mem, b); !errors.As(err, &ve) {
		t.Fatalf("trajectory stream decoded as task attempts: %v, want *VersionError", err)
	}
	// Rows of DecodeStream equal Decode's for a one-batch stream.
	one, err := Trajectories.Encode(mem, sampleTrajectories())
	if err != nil {
		t.Fatal(err)
	}
	a, err1 := Trajectories.Decode(mem, one)
	s, err2 := Trajectories.DecodeStream(mem, one)
	if err := errors.Join(err1, err2); err != nil {
		t.Fatal(err)
	}
	if !same(reflect.ValueOf(a), reflect.ValueOf(s)) {
		t.Fatalf("Decode and DecodeStream disagree")
	}
}
