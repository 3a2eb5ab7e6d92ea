package envsvc

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"

	"github.com/trajflow/trajflow/connectors/env/capability"
)

// ReadKeyFile reads a capability run key: capability.KeySize bytes as hex
// on one line.
func ReadKeyFile(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("envsvc: key file: %w", err)
	}
	k, err := hex.DecodeString(strings.TrimSpace(string(b)))
	if err != nil || len(k) != capability.KeySize {
		return nil, fmt.Errorf("envsvc: key file %s: want %d bytes as hex on one line", path, capability.KeySize)
	}
	return k, nil
}

// EnsureKeyFile reads the key at path, or creates it (mode 0600, a fresh
// random key) when the file does not exist. created says which.
func EnsureKeyFile(path string) (key []byte, created bool, err error) {
	k, err := ReadKeyFile(path)
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		return k, false, err
	}
	k = make([]byte, capability.KeySize)
	if _, err := rand.Read(k); err != nil {
		return nil, false, fmt.Errorf("envsvc: key: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, false, fmt.Errorf("envsvc: key file: %w", err)
	}
	if _, err := fmt.Fprintln(f, hex.EncodeToString(k)); err != nil {
		f.Close()
		return nil, false, fmt.Errorf("envsvc: key file %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return nil, false, fmt.Errorf("envsvc: key file %s: %w", path, err)
	}
	return k, true, nil
}
