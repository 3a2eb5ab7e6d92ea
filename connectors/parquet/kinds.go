package parquet

import (
	"fmt"

	"github.com/apache/arrow-go/v18/arrow"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// dataCodec is what the snapshot needs of a data-plane kind: its schema,
// and the re-encoding of the rows of one message back into the message's
// bytes (schemas codecs are deterministic, so this reproduces the value
// the producer wrote).
type dataCodec interface {
	Kind() schemas.Kind
	Version() int
	Schema() *arrow.Schema
	reencode(rec arrow.RecordBatch) ([]byte, error)
}

type rowCodec[T any] struct{ *schemas.Codec[T] }

func (c rowCodec[T]) reencode(rec arrow.RecordBatch) ([]byte, error) {
	rows, err := c.FromRecord(rec)
	if err != nil {
		return nil, err
	}
	return c.Encode(nil, rows)
}

type batchCodec struct{ *schemas.PackedBatchCodec }

func (c batchCodec) reencode(rec arrow.RecordBatch) ([]byte, error) {
	b, err := c.FromRecord(rec)
	if err != nil {
		return nil, err
	}
	return c.Encode(nil, b)
}

// Control-plane kinds (MetaSchemaKind values of files written with
// parquet-go): "json:<kind>" for the JSON documents of a topic of the
// topology, KindQuarantine for the quarantine topic, KindRaw for a topic
// the topology does not know.
const (
	KindCensus     = "json:census_event"
	KindIncident   = "json:incident"
	KindPolicy     = "json:policy_release"
	KindWindow     = "json:window_record"
	KindQuarantine = "raw:quarantine"
	KindRaw        = "raw"
)

// dataCodecs maps the data-plane record kinds to their codecs.
var dataCodecs = map[schemas.Kind]dataCodec{
	schemas.KindTaskAttempt: rowCodec[schemas.TaskAttempt]{schemas.TaskAttempts},
	schemas.KindTrajectory:  rowCodec[schemas.Trajectory]{schemas.Trajectories},
	schemas.KindRewarded:    rowCodec[schemas.Rewarded]{schemas.RewardedTrajectories},
	schemas.KindScored:      rowCodec[schemas.Scored]{schemas.ScoredTrajectories},
	schemas.KindPackedBatch: batchCodec{schemas.PackedBatches},
}

// dataCodecOf is the codec of a data-plane topic (its short name in the
// topology), if it is one.
func dataCodecOf(short string) (dataCodec, bool) {
	info, ok := pipeline.TopicInfoOf(short)
	if !ok || info.Plane != pipeline.PlaneArrow {
		return nil, false
	}
	c, ok := dataCodecs[info.Kind]
	return c, ok
}

// KindOf returns the schema kind and version a topic's files are written
// with, from its short name (the topology table says what it carries).
func KindOf(short string) (kind string, version int) {
	if c, ok := dataCodecOf(short); ok {
		return string(c.Kind()), c.Version()
	}
	info, ok := pipeline.TopicInfoOf(short)
	switch {
	case !ok:
		return KindRaw, 1
	case info.Plane == pipeline.PlaneRaw:
		return KindQuarantine, 1
	}
	return "json:" + string(info.Kind), schemas.Versions[info.Kind]
}

// IsDataPlane reports whether a topic's files are Arrow (pqarrow) files.
func IsDataPlane(short string) bool {
	_, ok := dataCodecOf(short)
	return ok
}

func codecFor(short string) (dataCodec, error) {
	c, ok := dataCodecOf(short)
	if !ok {
		return nil, fmt.Errorf("snapshot: topic %q is not a data-plane topic", short)
	}
	return c, nil
}
