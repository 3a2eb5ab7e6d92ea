package model

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"math"
)

// Checkpoint format (all little-endian):
//
//	magic   [8]byte  "TFMLP\x00\x00\x01" (format version 1)
//	vocab, window, embed, hidden  uint32
//	count   uint32   number of parameters (must equal Config.NumParams)
//	params  [count]float32 (IEEE 754 bits)
//
// The checkpoint hash of a release is "sha256:<hex>" of exactly these
// bytes (docs/SYSTEMS.md §8).
var magic = [8]byte{'T', 'F', 'M', 'L', 'P', 0, 0, 1}

const headerLen = 8 + 5*4

// MaxCheckpointBytes is the size of the checkpoint of the largest model
// a Config allows: a reader of checkpoint files refuses a larger file
// without reading it.
const MaxCheckpointBytes = headerLen + 4*MaxParams

// Save writes the checkpoint of m to w.
func (m *Model) Save(w io.Writer) error {
	if err := m.Validate(); err != nil {
		return err
	}
	buf := make([]byte, headerLen+4*len(m.Params))
	copy(buf, magic[:])
	c := m.Config
	for k, v := range []int{c.Vocab, c.Window, c.Embed, c.Hidden, len(m.Params)} {
		binary.LittleEndian.PutUint32(buf[8+4*k:], uint32(v))
	}
	for i, p := range m.Params {
		binary.LittleEndian.PutUint32(buf[headerLen+4*i:], math.Float32bits(p))
	}
	if _, err := w.Write(buf); err != nil {
		return fmt.Errorf("model: save: %w", err)
	}
	return nil
}

// Bytes returns the checkpoint bytes of m.
func (m *Model) Bytes() ([]byte, error) {
	var b bytes.Buffer
	if err := m.Save(&b); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// Hash returns the checkpoint hash "sha256:<hex>" of m's checkpoint bytes.
func (m *Model) Hash() (string, error) {
	b, err := m.Bytes()
	if err != nil {
		return "", err
	}
	return HashBytes(b), nil
}

// HashBytes is "sha256:<hex>" of b.
func HashBytes(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// Load reads a checkpoint written by Save. Bad magic, an invalid
// configuration, a parameter count that disagrees with it, a short read,
// trailing bytes, or a non-finite parameter is an error wrapping
// ErrCheckpoint; it never panics.
func Load(r io.Reader) (*Model, error) {
	var hdr [headerLen]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, fmt.Errorf("%w: header: %v", ErrCheckpoint, err)
	}
	if !bytes.Equal(hdr[:8], magic[:]) {
		return nil, fmt.Errorf("%w: bad magic %q", ErrCheckpoint, hdr[:8])
	}
	u := func(k int) int { return int(binary.LittleEndian.Uint32(hdr[8+4*k:])) }
	cfg := Config{Vocab: u(0), Window: u(1), Embed: u(2), Hidden: u(3)}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrCheckpoint, err)
	}
	n := u(4)
	if n != cfg.NumParams() {
		return nil, fmt.Errorf("%w: %d parameters, config %+v needs %d", ErrCheckpoint, n, cfg, cfg.NumParams())
	}
	// Read as the bytes come, not into a buffer the header sized: a
	// short file claiming the largest config allocates what it holds.
	body, err := io.ReadAll(io.LimitReader(r, int64(4*n)+1))
	switch {
	case err != nil:
		return nil, fmt.Errorf("%w: parameters: %v", ErrCheckpoint, err)
	case len(body) < 4*n:
		return nil, fmt.Errorf("%w: parameters: %d of %d bytes: %v", ErrCheckpoint, len(body), 4*n, io.ErrUnexpectedEOF)
	case len(body) > 4*n:
		return nil, fmt.Errorf("%w: trailing bytes after %d parameters", ErrCheckpoint, n)
	}
	m := &Model{Config: cfg, Params: make([]float32, n)}
	for i := range m.Params {
		p := math.Float32frombits(binary.LittleEndian.Uint32(body[4*i:]))
		if math.IsNaN(float64(p)) || math.IsInf(float64(p), 0) {
			return nil, fmt.Errorf("%w: parameter %d is %v", ErrCheckpoint, i, p)
		}
		m.Params[i] = p
	}
	return m, nil
}

// LoadVerified decodes checkpoint bytes after checking that their hash is
// wantHash ("sha256:<hex>"); a mismatch is an ErrCheckpoint error and
// nothing is loaded (docs/SYSTEMS.md §8: "verify complete model" before a shadow
// slot switches).
func LoadVerified(b []byte, wantHash string) (*Model, error) {
	if got := HashBytes(b); got != wantHash {
		return nil, fmt.Errorf("%w: hash %s, manifest says %s", ErrCheckpoint, got, wantHash)
	}
	return Load(bytes.NewReader(b))
}
