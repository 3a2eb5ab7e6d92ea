package offline

import (
	"fmt"

	"github.com/apache/arrow-go/v18/arrow"

	"github.com/trajflow/trajflow/schemas"
)

// message is one input message built from a record batch of the input
// file: what the upstream stage would have produced.
type message struct {
	key   string   // the Kafka key the upstream stage sets (group id, batch id)
	value []byte   // the batch as its own IPC stream, encoded by the codec
	ids   []string // the record ids it holds
}

// kindIO reads and writes the messages of one data-plane kind.
type kindIO struct {
	schema *arrow.Schema
	// message decodes one single-batch stream and encodes it again with
	// the codec.
	message func(part []byte) (message, error)
	// record decodes one message as a record batch; the caller releases it.
	record func(value []byte) (arrow.RecordBatch, error)
}

// kinds are the data-plane kinds the offline stages consume and produce.
var kinds = map[schemas.Kind]kindIO{
	schemas.KindTrajectory: rowsIO(schemas.Trajectories, func(r *schemas.Trajectory) (string, string) { return r.GroupID, r.RecordID }),
	schemas.KindRewarded:   rowsIO(schemas.RewardedTrajectories, func(r *schemas.Rewarded) (string, string) { return r.GroupID, r.RecordID }),
	schemas.KindScored:     rowsIO(schemas.ScoredTrajectories, func(r *schemas.Scored) (string, string) { return r.GroupID, r.RecordID }),
	schemas.KindPackedBatch: {
		schema: schemas.PackedBatches.Schema(),
		message: func(part []byte) (message, error) {
			b, err := schemas.PackedBatches.Decode(nil, part)
			if err != nil {
				return message{}, err
			}
			v, err := schemas.PackedBatches.Encode(nil, b)
			return message{key: b.BatchID, value: v, ids: []string{b.BatchID}}, err
		},
		record: func(v []byte) (arrow.RecordBatch, error) {
			b, err := schemas.PackedBatches.Decode(nil, v)
			if err != nil {
				return nil, err
			}
			return schemas.PackedBatches.ToRecord(nil, b)
		},
	},
}

// rowsIO is the kindIO of a codec of rows; keyID returns a row's key
// (its group id) and record id.
func rowsIO[T any](c *schemas.Codec[T], keyID func(*T) (string, string)) kindIO {
	return kindIO{
		schema: c.Schema(),
		message: func(part []byte) (message, error) {
			rows, err := c.Decode(nil, part)
			if err != nil {
				return message{}, err
			}
			v, err := c.Encode(nil, rows)
			if err != nil {
				return message{}, err
			}
			m := message{value: v, ids: make([]string, len(rows))}
			for i := range rows {
				key, id := keyID(&rows[i])
				if i == 0 {
					m.key = key
				}
				m.ids[i] = id
			}
			return m, nil
		},
		record: func(v []byte) (arrow.RecordBatch, error) {
			rows, err := c.Decode(nil, v)
			if err != nil {
				return nil, err
			}
			return c.ToRecord(nil, rows)
		},
	}
}

// kindOf returns the kindIO of kind.
func kindOf(kind schemas.Kind) (kindIO, error) {
	k, ok := kinds[kind]
	if !ok {
		return kindIO{}, fmt.Errorf("offline: no reader for record kind %q", kind)
	}
	return k, nil
}
