package parquet

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// FuzzReadFile feeds arbitrary bytes to ReadFile as a data-plane file and
// as a control-plane file, each with a sidecar that matches (so the bytes
// reach the Parquet decoders): every input is read or refused with
// ErrCorrupt, never a panic.
func FuzzReadFile(f *testing.F) {
	seedDir := f.TempDir()
	for _, topic := range []string{"trajectories", "census"} {
		msgs := trajMessages(f, 2, 0)
		if topic == "census" {
			msgs = []Message{{Offset: 0, Value: []byte(`{"kind":"census_event","version":1,"data":{"attempt_id":"a","kind":"admitted"}}`)}}
		}
		path, _, err := WriteFile(Target{Dir: seedDir, Run: testRun, Topic: testRun + "." + topic}, 0, msgs, WriteOptions{})
		if err != nil {
			f.Fatal(err)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, topic == "census")
	}
	f.Add([]byte("PAR1PAR1"), false)
	f.Add([]byte{}, true)
	f.Fuzz(func(t *testing.T, data []byte, control bool) {
		topic := "trajectories"
		if control {
			topic = "census"
		}
		dir := filepath.Join(t.TempDir(), "run="+testRun, "topic="+topic, "partition=0")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, FileName(0, 1))
		sum := sha256.Sum256(data)
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(SidecarPath(path), []byte(hex.EncodeToString(sum[:])+"  x\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		_, _, err := ReadFile(path, ReadOptions{})
		if err != nil && !errors.Is(err, ErrCorrupt) {
			t.Fatalf("error does not wrap ErrCorrupt: %v", err)
		}
	})
}

func FuzzParseFileName(f *testing.F) {
	f.Add(FileName(3, 9))
	f.Add("00000000000000000001-00000000000000000000.parquet")
	f.Add("-1--2.parquet")
	f.Fuzz(func(t *testing.T, name string) {
		first, last, ok := ParseFileName(name)
		if ok && (first < 0 || last < first) {
			t.Fatalf("%q parsed as %d-%d", name, first, last)
		}
	})
}
