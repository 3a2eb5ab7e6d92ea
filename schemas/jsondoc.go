package schemas

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
)

// The control-plane kinds (docs/GUARANTEES.md "Wire format") travel as small JSON
// documents:
//
//	{"kind":"policy_release","version":1,"data":{...fields of PolicyRelease...}}
//
// The record sits under "data" because CensusEvent has a "kind" field of its
// own. Decoding rejects unknown fields at both levels and trailing bytes
// (ErrDecode), and a kind or version other than the expected one
// (*VersionError, checked before the record is read).

type jsonDoc struct {
	Kind    string          `json:"kind"`
	Version json.RawMessage `json:"version"`
	Data    json.RawMessage `json:"data"`
}

func encodeDoc[T any](kind Kind, v *T) ([]byte, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("schemas: encode %s: %w", kind, err)
	}
	return json.Marshal(jsonDoc{Kind: string(kind), Version: json.RawMessage(strconv.Itoa(Versions[kind])), Data: data})
}

// strictUnmarshal decodes exactly one JSON value with no unknown fields.
func strictUnmarshal(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("trailing data after the document")
	}
	return nil
}

func decodeDoc[T any](kind Kind, b []byte) (T, error) {
	var zero T
	var doc jsonDoc
	if err := strictUnmarshal(b, &doc); err != nil {
		return zero, fmt.Errorf("%w: %s: %v", ErrDecode, kind, err)
	}
	if err := checkVersion(kind, doc.Kind, string(doc.Version)); err != nil {
		return zero, err
	}
	if len(doc.Data) == 0 || string(doc.Data) == "null" {
		return zero, fmt.Errorf("%w: %s: document has no data", ErrDecode, kind)
	}
	var v T
	if err := strictUnmarshal(doc.Data, &v); err != nil {
		return zero, fmt.Errorf("%w: %s: data: %v", ErrDecode, kind, err)
	}
	return v, nil
}

// EncodeRelease returns the JSON document of a policy release manifest
// (docs/SYSTEMS.md §8).
func EncodeRelease(r PolicyRelease) ([]byte, error) { return encodeDoc(KindPolicyRelease, &r) }

// DecodeRelease reads a document written by EncodeRelease.
func DecodeRelease(b []byte) (PolicyRelease, error) {
	return decodeDoc[PolicyRelease](KindPolicyRelease, b)
}
