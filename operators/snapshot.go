package operators

import (
	"errors"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/pipeline"
)

func init() {
	Register("snapshot", func(d Deps) (pipeline.Stage, error) {
		if d.SnapshotDir == "" {
			return nil, errors.New("operators: snapshot: no snapshot directory (--snapshot-dir)")
		}
		y, err := d.Contract.YAML()
		if err != nil {
			return nil, err
		}
		return parquet.NewStage(parquet.StageConfig{
			Dir: d.SnapshotDir, Run: d.Contract.RunID, Topics: d.Topics.All(),
			ContractHash: d.Contract.Hash(), ContractYAML: y, VocabSize: d.VocabSize,
			RollBytes: d.SnapshotRollBytes, RollInterval: d.SnapshotRollInterval,
		})
	})
}
