package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/trajflow/trajflow/internal/offline"
	"github.com/trajflow/trajflow/operators"
)

func init() {
	register("stage", "stage NAME --in F --out F: run one registered stage offline over an Arrow IPC stream file (validate, reward, advantage, pack, train)", cmdStage)
}

func cmdStage(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("stage", stderr)
	o := offline.Options{Log: stderr}
	fs.StringVar(&o.In, "in", "", "input: an Arrow IPC stream file, one record batch per input message (several streams one after the other are read in turn), or a Parquet snapshot file of the stage's input topic")
	fs.StringVar(&o.Out, "out", "", "output Arrow IPC stream file: one record batch per output message (train: release manifests, one per line)")
	fs.StringVar(&o.Quarantine, "quarantine", "", "write every quarantined record to this Arrow IPC stream file (reasons on stderr)")
	path := fs.String("contract", "", "learning contract (default: the built-in demo contract)")
	fs.Int64Var(&o.TrainerVersion, "trainer-version", -1, "pack: a policy version the trainer published before the first record (default: from the input records)")
	releases := fs.String("releases", "", "train: the release directory to write (checkpoints, manifests, update records)")
	device := fs.String("device", "cpu", "train: the trainer's backend (cpu, cuda or cuda:N)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 || o.In == "" || (o.Out == "" && pos[0] != "train") {
		return fmt.Errorf("%w: trajflow stage %s --in FILE --out FILE [--contract FILE]", errUsage, strings.Join(offline.Stages, "|"))
	}
	o.Stage = pos[0]
	if err := checkStageFlags(fs, o, *releases, *device); err != nil {
		return err
	}
	c, err := contractFlag(*path, stderr)
	if err != nil {
		return err
	}
	if o.Deps, err = operators.BuiltinDeps(c); err != nil {
		return err
	}
	o.Deps.ReleaseDir, o.Deps.Device = *releases, *device
	if o.Stage == "pack" && o.TrainerVersion < 0 {
		fmt.Fprintln(stderr, "no --trainer-version: the trainer version comes from the input (a record sampled at version v proves the trainer published v)")
	}
	rep, err := offline.Run(ctx, o)
	if errors.Is(err, offline.ErrStage) {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if err != nil {
		return err
	}
	printStageReport(rep, o, stdout, stderr)
	return nil
}

// checkStageFlags refuses an unknown stage, an input that is not a file,
// an output in a directory that is not there, and a flag of another
// stage (--releases and --device are train's, --trainer-version pack's).
func checkStageFlags(fs *flag.FlagSet, o offline.Options, releases, device string) error {
	if !slices.Contains(offline.Stages, o.Stage) {
		return fmt.Errorf("%w: unknown stage %q: want one of %s", errUsage, o.Stage, strings.Join(offline.Stages, ", "))
	}
	if err := onlyWith(fs, o.Stage == "train", "a flag of the train stage, not of "+o.Stage, "releases", "device"); err != nil {
		return err
	}
	if err := onlyWith(fs, o.Stage == "pack", "a flag of the pack stage, not of "+o.Stage, "trainer-version"); err != nil {
		return err
	}
	if o.Stage == "train" && releases == "" {
		return fmt.Errorf("%w: stage train needs --releases DIR (the release directory it writes)", errUsage)
	}
	if o.Stage == "train" {
		if err := checkOutDir("--releases", releases); err != nil {
			return err
		}
	}
	if err := operators.CheckDevice(device); err != nil {
		return fmt.Errorf("%w: --device %q: want cpu or cuda (cuda:N: GPU N)", errUsage, device)
	}
	if o.TrainerVersion < -1 {
		return fmt.Errorf("%w: --trainer-version %d: want a policy version, 0 or more (default: from the input)", errUsage, o.TrainerVersion)
	}
	if err := checkInFile("--in", o.In); err != nil {
		return err
	}
	return errors.Join(checkOutFile("--out", o.Out), checkOutFile("--quarantine", o.Quarantine))
}

// printStageReport prints what the stage did: a line per pack window or
// train release, the refusals and what the end of the input closed (on
// stderr), and the counts.
func printStageReport(rep *offline.Report, o offline.Options, stdout, stderr io.Writer) {
	for _, w := range rep.Windows {
		if w.BatchID == "" {
			fmt.Fprintf(stdout, "window of %d groups: every record filtered, no batch (%s)\n", len(w.Groups), closedBy(w.ClosedBy))
			continue
		}
		fmt.Fprintf(stdout, "batch %d: %d rows, %d admitted, %d filtered, %d tokens, efficiency %.4f, trainer version %d, max lag %d (%s)\n",
			w.BatchIndex, w.Rows, len(w.Admitted), len(w.Filtered), w.Tokens, w.Efficiency, w.TrainerVersion, w.MaxLag, closedBy(w.ClosedBy))
	}
	for _, r := range rep.Releases {
		fmt.Fprintf(stdout, "release: policy version %d, checkpoint %s\n", r.PolicyVersion, r.CheckpointURI)
	}
	for _, r := range rep.Refusals {
		where := fmt.Sprintf("record batch %d", r.Batch)
		if r.Row != "" {
			where += " row " + r.Row
		}
		fmt.Fprintf(stderr, "quarantined %s: %s: %s\n", where, r.Reason, r.Detail)
	}
	if rep.Closed > 0 {
		fmt.Fprintf(stderr, "%d records held by the open window/groups were closed at the end of the input (%d input messages)\n", rep.Closed, rep.ClosedMessages)
	}
	if rep.Held > 0 {
		fmt.Fprintf(stderr, "%d input messages are still held at the end of the input\n", rep.Held)
	}
	fmt.Fprintf(stdout, "%s: %d input messages (%d records), %d outputs on %s, %d quarantined\n",
		rep.Stage, rep.Inputs, rep.Records, rep.Outputs, rep.OutputTopic, len(rep.Refusals))
	if rep.Duplicates > 0 {
		fmt.Fprintf(stdout, "%d duplicate record ids in the input (decided as the live stage decides a redelivery)\n", rep.Duplicates)
	}
}

// closedBy says why a window closed offline: full, or at the end of the
// input (the final tick, the only one an offline run gives the window's
// timeout).
func closedBy(by string) string {
	if by == "timeout" {
		return "closed at the end of the input"
	}
	return "closed " + by
}
