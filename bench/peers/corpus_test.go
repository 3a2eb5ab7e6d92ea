package peers

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/schemas"
)

// TestCorpusRoundTrip: the corpus holds the bytes the real stages produced
// on every hop (each decodes as its hop's kind), at least one batch, and it
// reads back byte for byte.
func TestCorpusRoundTrip(t *testing.T) {
	c := testkit.LoadContract(t, "../../testdata/contracts/bench.yaml")
	cp, err := BuildCorpus(context.Background(), c, synth.Bench(), 96)
	if err != nil {
		t.Fatal(err)
	}
	if len(cp.Groups) != 96 || len(cp.Batches) == 0 {
		t.Fatalf("groups %d batches %d", len(cp.Groups), len(cp.Batches))
	}
	reached := 0
	for _, g := range cp.Groups {
		if len(g.Hops[0]) != 1 || g.Tokens <= 0 || g.Action <= 0 || g.Action > g.Tokens {
			t.Fatalf("group %d: hops %d tokens %d action %d", g.Index, len(g.Hops[0]), g.Tokens, g.Action)
		}
		if len(g.Hops[3]) > 0 {
			reached++
			if _, err := schemas.ScoredTrajectories.Decode(nil, g.Hops[3][0]); err != nil {
				t.Fatalf("group %d scored message: %v", g.Index, err)
			}
		}
	}
	if reached < 80 {
		t.Fatalf("only %d of 96 groups reached the scored topic", reached)
	}
	for i, b := range cp.Batches {
		if _, err := schemas.PackedBatches.Decode(nil, b.Value); err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
		if b.After <= 0 || b.After > 96 {
			t.Fatalf("batch %d after %d groups", i, b.After)
		}
	}
	path := filepath.Join(t.TempDir(), "corpus.bin")
	if err := cp.Write(path); err != nil {
		t.Fatal(err)
	}
	back, err := ReadCorpus(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(back.Groups) != len(cp.Groups) || len(back.Batches) != len(cp.Batches) {
		t.Fatalf("read back %d groups %d batches", len(back.Groups), len(back.Batches))
	}
	for i := range cp.Groups {
		for h := range cp.Groups[i].Hops {
			for k := range cp.Groups[i].Hops[h] {
				if !bytes.Equal(cp.Groups[i].Hops[h][k], back.Groups[i].Hops[h][k]) {
					t.Fatalf("group %d hop %d message %d differs", i, h, k)
				}
			}
		}
	}
	if !bytes.Equal(cp.Batches[0].Value, back.Batches[0].Value) || cp.Batches[0].After != back.Batches[0].After {
		t.Fatal("batch 0 differs")
	}
	// A stage's subset: one hop kept, the rest skipped but counted.
	sub, err := ReadCorpusHops(path, []int{2}, false)
	if err != nil {
		t.Fatal(err)
	}
	for i := range cp.Groups {
		if sub.Groups[i].Bytes != cp.Groups[i].Bytes || back.Groups[i].Bytes != cp.Groups[i].Bytes || cp.Groups[i].Bytes <= 0 {
			t.Fatalf("group %d: bytes %d (subset) %d (read back) %d (built)", i, sub.Groups[i].Bytes, back.Groups[i].Bytes, cp.Groups[i].Bytes)
		}
		if len(sub.Groups[i].Hops[0]) != 0 || len(sub.Groups[i].Hops[2]) != len(cp.Groups[i].Hops[2]) {
			t.Fatalf("group %d: subset holds %d messages of hop 0, %d of hop 2 (want 0, %d)", i,
				len(sub.Groups[i].Hops[0]), len(sub.Groups[i].Hops[2]), len(cp.Groups[i].Hops[2]))
		}
	}
	for i, b := range sub.Batches {
		if b.Value != nil || b.Size != len(cp.Batches[i].Value) || b.After != cp.Batches[i].After {
			t.Fatalf("batch %d of the subset: value %d bytes, size %d, after %d (want none, %d, %d)", i, len(b.Value), b.Size, b.After,
				len(cp.Batches[i].Value), cp.Batches[i].After)
		}
	}
	// BatchDue: batch k after its group count, again one corpus later.
	first := cp.Batches[0].After
	if k := cp.BatchDue(int64(first)); k != 0 {
		t.Fatalf("BatchDue(%d) = %d, want 0", first, k)
	}
	if k := cp.BatchDue(int64(first + len(cp.Groups))); k != 0 {
		t.Fatalf("BatchDue(%d) = %d, want 0 (the corpus repeats)", first+len(cp.Groups), k)
	}
	if first > 1 {
		if k := cp.BatchDue(1); k != -1 {
			t.Fatalf("BatchDue(1) = %d, want -1 (no batch after the first group)", k)
		}
	}
	if _, err := ReadCorpus(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Fatal("missing corpus read without error")
	}
}

// TestCorpusLengthBounded: a message length the file cannot hold (a
// damaged corpus) is refused naming it, before a buffer of that length
// is allocated.
func TestCorpusLengthBounded(t *testing.T) {
	const claim = 64 << 20
	b := binary.LittleEndian.AppendUint32([]byte(corpusMagic), claim)
	b = append(b, `{"groups":1}`...)
	path := filepath.Join(t.TempDir(), "corpus.bin")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := ReadCorpus(path)
	if want := fmt.Sprintf("header: message of %d bytes, more than the %d-byte file holds", claim, len(b)); err == nil ||
		!strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), want) {
		t.Fatalf("header length %d in a %d-byte file: %v, want an error naming %s with %q", claim, len(b), err, path, want)
	}
}
