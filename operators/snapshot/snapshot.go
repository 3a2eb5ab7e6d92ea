// Package snapshot is the snapshot operator (`trajflow run snapshot`): a
// thin adapter over connectors/parquet, whose Stage consumes every topic
// of a run in a consumer group of its own and writes each partition to
// Parquet files with lineage (docs/PIPELINE.md §1), holding every input until the
// file holding it is durable.
package snapshot

import (
	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/pipeline"
)

// Config configures the snapshot operator (see parquet.StageConfig).
type Config = parquet.StageConfig

// TaskRow is one task of the registry, as written to the run's tasks file.
type TaskRow = parquet.TaskRow

// NewStage returns the snapshot stage over the topics of run: every topic
// of the topology.
func NewStage(cfg Config, topics pipeline.Topics) (*parquet.Stage, error) {
	if len(cfg.Topics) == 0 {
		cfg.Topics = topics.Names(pipeline.InputsOf(pipeline.SnapshotStage))
	}
	return parquet.NewStage(cfg)
}
