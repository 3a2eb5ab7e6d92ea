package main

import (
	"context"
	"fmt"
	"io"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/census"
)

func init() {
	register("census", "census DIR: the attempt funnel of a run and the launched vs admitted distributions, from its snapshots", cmdCensus)
}

func cmdCensus(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("census", stderr)
	runName := fs.String("run", "", "run to read when DIR holds several")
	top := fs.Int("tasks", 20, "rows of the by-task table")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return fmt.Errorf("%w: trajflow census DIR", errUsage)
	}
	runDir, err := parquet.FindRun(pos[0], *runName)
	if err != nil {
		return err
	}
	rep, err := census.Collect(runDir)
	if err != nil {
		return err
	}
	rep.Print(stdout, *top)
	for _, w := range rep.Warnings {
		fmt.Fprintf(stderr, "warning: snapshot incomplete: %s\n", w)
	}
	return nil
}
