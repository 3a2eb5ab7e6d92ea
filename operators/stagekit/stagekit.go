// Package stagekit holds what every stage adapter shares: mapping decode
// failures to quarantine reasons, building data-plane and census outputs
// with their headers, and W3C trace context derived from record ids.
package stagekit

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Now returns clock(), or time.Now() when clock is nil. A stage's clock is
// its configured one (tests), else the runtime's (pipeline.Env.Now, set at
// Start): offline drives pass a fixed clock so that redelivered inputs give
// byte-identical outputs.
func Now(clock func() time.Time) time.Time {
	if clock == nil {
		return time.Now()
	}
	return clock()
}

// Quarantine reason codes shared by every stage.
const (
	ReasonUndecodable    = "undecodable"
	ReasonWrongKind      = "wrong_kind"
	ReasonUnknownVersion = "unknown_version"
	ReasonEmpty          = "empty_message"
	// ReasonHeaderMismatch refuses a record whose Kafka headers disagree
	// with its body (kind, version or deterministic id).
	ReasonHeaderMismatch = "header_mismatch"
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
// stream) into a refusal. The rows' token and log-prob slices point into
// m.Value (schemas.Codec.DecodeShared), which the runtime never modifies:
// stages must not modify them in place either (they are also the original
// bytes a refusal quarantines).
//
// The record's kind and version headers, when present, must name the
// codec's kind and version (the body's, which decoding checked): a record
// whose headers disagree with its body is refused with
// ReasonHeaderMismatch.
func Decode[T any](c *schemas.Codec[T], m pipeline.Message) ([]T, error) {
	rows, err := c.DecodeShared(nil, m.Value)
	if err != nil {
		return nil, DecodeRefusal(err)
	}
	if len(rows) == 0 {
		return nil, pipeline.Refuse(ReasonEmpty, "%s message with no rows", c.Kind())
	}
	if err := CheckKindHeaders(&m, c.Kind()); err != nil {
		return nil, err
	}
	return rows, nil
}

// CheckKindHeaders refuses m (ReasonHeaderMismatch) when its kind or
// version header is present and names another kind, or another version
// than the current one of kind (the body's).
func CheckKindHeaders(m *pipeline.Message, kind schemas.Kind) error {
	if v := m.Header(schemas.HeaderKind); v != nil && string(v) != string(kind) {
		return pipeline.Refuse(ReasonHeaderMismatch, "header %s is %q, the body is a %s", schemas.HeaderKind, v, kind)
	}
	if v := m.Header(schemas.HeaderVersion); v != nil && string(v) != strconv.Itoa(schemas.Versions[kind]) {
		return pipeline.Refuse(ReasonHeaderMismatch, "header %s is %q, the body is %s version %d", schemas.HeaderVersion, v, kind, schemas.Versions[kind])
	}
	return nil
}

// CheckID refuses m (ReasonHeaderMismatch) when its id header is present
// and differs from want, the id its producer derives from the body.
func CheckID(m *pipeline.Message, want string) error {
	if v := m.Header(schemas.HeaderID); v != nil && !bytes.Equal(v, []byte(want)) {
		return pipeline.Refuse(ReasonHeaderMismatch, "header %s is %q, the body's id is %q", schemas.HeaderID, v, want)
	}
	return nil
}

// Headers builds the standard headers of a data-plane record.
func Headers(kind schemas.Kind, id string) []pipeline.Header {
	return headers(kind, id, TraceParent(id))
}

func headers(kind schemas.Kind, id, traceparent string) []pipeline.Header {
	return []pipeline.Header{
		{Key: schemas.HeaderKind, Value: []byte(kind)},
		{Key: schemas.HeaderVersion, Value: []byte(strconv.Itoa(schemas.Versions[kind]))},
		{Key: schemas.HeaderID, Value: []byte(id)},
		{Key: schemas.HeaderTrace, Value: []byte(traceparent)},
	}
}

// Encode encodes rows with codec into one output record for topic, keyed by
// key, with id in its headers.
func Encode[T any](c *schemas.Codec[T], topic, key, id string, rows []T) (pipeline.Output, error) {
	b, release, err := c.EncodePooled(rows)
	if err != nil {
		return pipeline.Output{}, fmt.Errorf("encode %s for %s: %w", c.Kind(), topic, err)
	}
	return pipeline.Output{Topic: topic, Key: []byte(key), Value: b, Headers: Headers(c.Kind(), id), Release: release}, nil
}

// Census builds a census output keyed by attempt id. The event id is
// derived from the attempt, the kind and the stage, so a redelivered event
// has the same id and the census can count distinct events. Its
// traceparent names the emitting stage's span of the attempt
// (AttemptParent), so the processing of the event joins the attempt's
// trace under it.
func Census(topic string, ev schemas.CensusEvent) (pipeline.Output, error) {
	if ev.EventID == "" {
		ev.EventID = schemas.DerivedID("census/"+ev.Kind+"/"+ev.Stage+"/"+ev.Reason, ev.AttemptID)
	}
	b, err := schemas.EncodeCensus(ev)
	if err != nil {
		return pipeline.Output{}, fmt.Errorf("encode census event: %w", err)
	}
	trace := TraceParent(ev.EventID)
	if ev.AttemptID != "" {
		trace = AttemptParent(ev.Stage, ev.AttemptID)
	}
	return pipeline.Output{Topic: topic, Key: []byte(ev.AttemptID), Value: b, Headers: headers(schemas.KindCensusEvent, ev.EventID, trace)}, nil
}

// TraceParent derives a W3C traceparent from a record id: the trace id is
// the attempt's id (32 hex digits), so every record of one attempt shares a
// trace across stages (docs/SYSTEMS.md §15).
func TraceParent(id string) string { return traceParent(id, id) }

// traceParent is a traceparent in the trace of traceID (the id itself when
// it has 32 digits, else derived from it) with a span derived from spanID.
func traceParent(traceID, spanID string) string {
	span := schemas.DerivedID("trace", spanID)[:16]
	trace := traceID
	if len(trace) != 32 {
		trace = schemas.DerivedID("trace", traceID)
	}
	return "00-" + trace + "-" + span + "-01"
}

// Incident is a safety or integrity incident (schemas.Incident).
type Incident = schemas.Incident

// IncidentOutput builds the incidents-topic record of inc; its id is
// derived from the stage, the reason and the attempt, so a redelivered
// incident has the same id, and its traceparent is AttemptParent.
func IncidentOutput(topic string, inc Incident) (pipeline.Output, error) {
	if inc.IncidentID == "" {
		inc.IncidentID = schemas.DerivedID("incident/"+inc.Stage+"/"+inc.Reason, inc.AttemptID)
	}
	b, err := schemas.EncodeIncident(inc)
	if err != nil {
		return pipeline.Output{}, fmt.Errorf("encode incident: %w", err)
	}
	return pipeline.Output{Topic: topic, Key: []byte(inc.AttemptID), Value: b,
		Headers: headers(schemas.KindIncident, inc.IncidentID, AttemptParent(inc.Stage, inc.AttemptID))}, nil
}

// RowRefusal quarantines one row of a multi-row message: the quarantine
// record holds that row alone, re-encoded, so the other rows of the message
// go on; the original message stays in its topic.
func RowRefusal[T any](c *schemas.Codec[T], quarantineTopic, stage string, m pipeline.Message, row int, rec T, id, reason, detail string) (pipeline.Output, error) {
	b, err := c.Encode(nil, []T{rec})
	if err != nil {
		return pipeline.Output{}, fmt.Errorf("re-encode refused row %d: %w", row, err)
	}
	single := m
	single.Value = b
	single.Headers = append(headers(c.Kind(), id, AttemptParent(stage, id)), pipeline.Header{Key: schemas.HeaderSourceRow, Value: []byte(strconv.Itoa(row))})
	return pipeline.QuarantineRecord(quarantineTopic, stage, single, reason, detail), nil
}

// MessageID derives the id of a message holding the rows with ids, as
// produced by stage: a pure function of its content's ids, whatever offset
// the input came from.
func MessageID(stage string, ids ...string) string {
	if len(ids) == 1 {
		return schemas.DerivedID(stage, ids[0])
	}
	return schemas.DerivedID(stage, strings.Join(ids, ","))
}

// Refused describes a refused row for RefuseRow.
type Refused struct {
	RunID, AttemptID, TaskID, GroupID string
	Reason, Detail                    string
	Infra                             bool // an infrastructure failure, never a task failure
	Incident                          bool // also raise an incident (docs/PIPELINE.md §8, §9)
	At                                int64
	// Turns are the refused episode's turns: its census event carries
	// their rollout tokens and time, the failed generation's cost
	// (schemas.FailureCost).
	Turns []schemas.Turn
}

// RefuseRow builds every output of one refused row: the quarantine record
// (the row alone, re-encoded), its census event and, for incidents, the
// incidents-topic record.
func RefuseRow[T any](c *schemas.Codec[T], topics pipeline.Topics, stage string, m pipeline.Message, row int, rec T, r Refused) ([]pipeline.Output, error) {
	q, err := RowRefusal(c, topics.Quarantine, stage, m, row, rec, r.AttemptID, r.Reason, r.Detail)
	if err != nil {
		return nil, err
	}
	tokens, gen, env := schemas.TurnsUsage(r.Turns)
	ev, err := Census(topics.Census, schemas.CensusEvent{
		RunID: r.RunID, AttemptID: r.AttemptID, TaskID: r.TaskID, GroupID: r.GroupID,
		Kind: schemas.CensusQuarantined, Stage: stage, Reason: r.Reason, Infra: r.Infra,
		Tokens: tokens, LatencyUS: gen + env, At: r.At,
	})
	if err != nil {
		return nil, err
	}
	outs := []pipeline.Output{q, ev}
	if r.Incident {
		inc, err := IncidentOutput(topics.Incidents, Incident{
			RunID: r.RunID, AttemptID: r.AttemptID, TaskID: r.TaskID, Stage: stage,
			Reason: r.Reason, Detail: r.Detail, Source: m.Ref.String(), At: r.At,
		})
		if err != nil {
			return nil, err
		}
		outs = append(outs, inc)
	}
	return outs, nil
}

// CensusOf reads a record of the census topic for a stage that consumes
// it: the event, or a refusal when the record does not decode or its
// headers name another kind.
func CensusOf(m *pipeline.Message) (schemas.CensusEvent, error) {
	ev, err := schemas.DecodeCensus(m.Value)
	if err != nil {
		return ev, DecodeRefusal(err)
	}
	return ev, CheckKindHeaders(m, schemas.KindCensusEvent)
}

// NewerRelease reads a record of the policy topic for a stage that acts
// once per release (weight sync, evaluation): it returns the release and
// whether it is ready and newer than version last (-1: none yet). Older
// releases come back when the compacted topic is replayed; a record that
// is not a release, or whose headers say otherwise, is a refusal.
func NewerRelease(m *pipeline.Message, last int64) (schemas.PolicyRelease, bool, error) {
	rel, err := schemas.DecodeRelease(m.Value)
	if err != nil {
		return rel, false, DecodeRefusal(err)
	}
	if err := CheckKindHeaders(m, schemas.KindPolicyRelease); err != nil {
		return rel, false, err
	}
	return rel, rel.Ready && rel.PolicyVersion > last, nil
}
