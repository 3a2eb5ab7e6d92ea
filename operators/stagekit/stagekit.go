// Package stagekit holds what every stage adapter shares: mapping decode
// failures to quarantine reasons, building data-plane and census outputs
// with their headers, and W3C trace context derived from record ids.
package stagekit

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Quarantine reason codes shared by every stage.
const (
	ReasonUndecodable    = "undecodable"
	ReasonWrongKind      = "wrong_kind"
	ReasonUnknownVersion = "unknown_version"
	ReasonEmpty          = "empty_message"
)

// DecodeRefusal maps a decoder error to a quarantine refusal.
func DecodeRefusal(err error) *pipeline.Refusal {
	var ve *schemas.VersionError
	if errors.As(err, &ve) {
		if string(ve.WantKind) != ve.GotKind {
			return pipeline.Refuse(ReasonWrongKind, "%v", err)
		}
		return pipeline.Refuse(ReasonUnknownVersion, "%v", err)
	}
	return pipeline.Refuse(ReasonUndecodable, "%v", err)
}

// Decode decodes m.Value with codec, turning every failure (and an empty
// stream) into a refusal.
func Decode[T any](c *schemas.Codec[T], m pipeline.Message) ([]T, error) {
	rows, err := c.Decode(nil, m.Value)
	if err != nil {
		return nil, DecodeRefusal(err)
	}
	if len(rows) == 0 {
		return nil, pipeline.Refuse(ReasonEmpty, "%s message with no rows", c.Kind())
	}
	return rows, nil
}

// Headers builds the standard headers of a data-plane record.
func Headers(kind schemas.Kind, id string) []pipeline.Header {
	return []pipeline.Header{
		{Key: schemas.HeaderKind, Value: []byte(kind)},
		{Key: schemas.HeaderVersion, Value: []byte(strconv.Itoa(schemas.Versions[kind]))},
		{Key: schemas.HeaderID, Value: []byte(id)},
		{Key: schemas.HeaderTrace, Value: []byte(TraceParent(id))},
	}
}

// Encode encodes rows with codec into one output record for topic, keyed by
// key, with id in its headers.
func Encode[T any](c *schemas.Codec[T], topic, key, id string, rows []T) (pipeline.Output, error) {
	b, err := c.Encode(nil, rows)
	if err != nil {
		return pipeline.Output{}, fmt.Errorf("encode %s for %s: %w", c.Kind(), topic, err)
	}
	return pipeline.Output{Topic: topic, Key: []byte(key), Value: b, Headers: Headers(c.Kind(), id)}, nil
}

// Census builds a census output keyed by attempt id. The event id is
// derived from the attempt, the kind and the stage, so a redelivered event
// has the same id and the census can count distinct events.
func Census(topic string, ev schemas.CensusEvent) (pipeline.Output, error) {
	if ev.EventID == "" {
		ev.EventID = schemas.DerivedID("census/"+ev.Kind+"/"+ev.Stage+"/"+ev.Reason, ev.AttemptID)
	}
	b, err := schemas.EncodeCensus(ev)
	if err != nil {
		return pipeline.Output{}, fmt.Errorf("encode census event: %w", err)
	}
	return pipeline.Output{Topic: topic, Key: []byte(ev.AttemptID), Value: b, Headers: Headers(schemas.KindCensusEvent, ev.EventID)}, nil
}

// TraceParent derives a W3C traceparent from a record id: the trace id is
// the attempt's id (32 hex digits), so every record of one attempt shares a
// trace across stages (systems §15).
func TraceParent(id string) string {
	trace := schemas.DerivedID("trace", id)
	span := trace[:16]
	if len(id) == 32 {
		trace = id
	}
	return "00-" + trace + "-" + span + "-01"
}
