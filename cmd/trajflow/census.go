package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/census"
)

func init() {
	register("census", "census DIR: the attempt funnel of a run and the launched vs admitted distributions, from its snapshots "+
		"(DIR/run=<run> or DIR/snapshots/run=<run>); it names every missing or corrupt file it reads and, after printing "+
		"the partial counts, exits 1 (--partial: 0)", cmdCensus)
}

// cmdCensus prints the census of a run. Every snapshot file of the topics
// the census reads that is missing (its checksum sidecar remains) or does
// not verify is named on stderr; the counts printed lack their records
// and say so, and the command fails unless --partial accepts them.
// Partitions without a file, gaps between files and missing files of
// topics the census does not read are warnings.
func cmdCensus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("census", stderr)
	runName := fs.String("run", "", "run to read when DIR holds several")
	top := fs.Int("tasks", 20, "rows of the by-task table")
	partial := fs.Bool("partial", false, "exit 0 when snapshot files are unreadable (missing or corrupt), with the counts of the files that read; "+
		"without it the census prints them and exits 1")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return fmt.Errorf("%w: trajflow census DIR [--partial]", errUsage)
	}
	if *top < 1 {
		return fmt.Errorf("%w: --tasks %d: want at least 1 row", errUsage, *top)
	}
	runDir, err := findRunDir(pos[0], *runName)
	if err != nil {
		return err
	}
	rep, err := census.Collect(ctx, runDir)
	if err != nil {
		return err
	}
	rep.Print(stdout, *top)
	for _, w := range rep.Warnings {
		fmt.Fprintf(stderr, "warning: snapshot incomplete: %s\n", w)
	}
	for _, f := range rep.Unreadable {
		fmt.Fprintf(stderr, "unreadable: %v\n", f.Err)
	}
	if rep.Partial() {
		if *partial {
			fmt.Fprintf(stderr, "warning: the counts are partial: %d snapshot file(s) unreadable (--partial)\n", len(rep.Unreadable))
			return nil
		}
		return fmt.Errorf("%d snapshot file(s) unreadable (named above): the counts printed are partial; --partial accepts them", len(rep.Unreadable))
	}
	return nil
}

// findRunDir is parquet.FindRun for a command's DIR and --run: a DIR that
// does not exist, or holds no such run or several and none named, is a
// command-line mistake (exit status 2).
func findRunDir(dir, run string) (string, error) {
	d, err := parquet.FindRun(dir, run)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, parquet.ErrNoRun) || errors.Is(err, parquet.ErrSeveralRuns) {
		return "", fmt.Errorf("%w: %w", errUsage, err)
	}
	return d, err
}
