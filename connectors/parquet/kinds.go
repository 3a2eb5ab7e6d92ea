package parquet

import (
	"fmt"

	"github.com/apache/arrow-go/v18/arrow"

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
// parquet-go).
const (
	KindCensus     = "json:census_event"
	KindIncident   = "json:incident"
	KindPolicy     = "json:policy_release"
	KindWindow     = "json:window_record"
	KindQuarantine = "raw:quarantine"
	KindRaw        = "raw"
)

// dataCodecs maps the short names of data-plane topics (pipeline.Topics)
// to their kinds.
var dataCodecs = map[string]dataCodec{
	"tasks":        rowCodec[schemas.TaskAttempt]{schemas.TaskAttempts},
	"trajectories": rowCodec[schemas.Trajectory]{schemas.Trajectories},
	"valid":        rowCodec[schemas.Trajectory]{schemas.Trajectories},
	"rewarded":     rowCodec[schemas.Rewarded]{schemas.RewardedTrajectories},
	"scored":       rowCodec[schemas.Scored]{schemas.ScoredTrajectories},
	"batches":      batchCodec{schemas.PackedBatches},
}

// controlKinds maps the short names of control-plane topics to their kinds;
// any other topic is written as KindRaw.
var controlKinds = map[string]string{
	"census":     KindCensus,
	"incidents":  KindIncident,
	"policy":     KindPolicy,
	"windows":    KindWindow,
	"quarantine": KindQuarantine,
}

// KindOf returns the schema kind and version a topic's files are written
// with, from its short name.
func KindOf(short string) (kind string, version int) {
	if c, ok := dataCodecs[short]; ok {
		return string(c.Kind()), c.Version()
	}
	if k, ok := controlKinds[short]; ok {
		switch k {
		case KindCensus:
			return k, schemas.Versions[schemas.KindCensusEvent]
		case KindPolicy:
			return k, schemas.Versions[schemas.KindPolicyRelease]
		}
		return k, 1
	}
	return KindRaw, 1
}

// IsDataPlane reports whether a topic's files are Arrow (pqarrow) files.
func IsDataPlane(short string) bool {
	_, ok := dataCodecs[short]
	return ok
}

func codecFor(short string) (dataCodec, error) {
	c, ok := dataCodecs[short]
	if !ok {
		return nil, fmt.Errorf("snapshot: topic %q is not a data-plane topic", short)
	}
	return c, nil
}
