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
		var tasks []parquet.TaskRow
		if d.Tasks != nil {
			for _, t := range append(d.Tasks.Train(), d.Tasks.Eval()...) {
				tasks = append(tasks, parquet.TaskRow{TaskID: t.ID, TaskVersion: t.Version, Domain: t.Domain,
					Split: t.Split, EnvVersion: t.EnvVersion, Key: t.Key})
			}
		}
		return parquet.NewStage(parquet.StageConfig{
			Dir: d.SnapshotDir, Run: d.Contract.RunID, Topics: d.Topics.All(), Tasks: tasks,
			ContractHash: d.Contract.Hash(), ContractYAML: y, VocabSize: d.VocabSize,
			RollBytes: d.SnapshotRollBytes, RollInterval: d.SnapshotRollInterval,
		})
	})
}
