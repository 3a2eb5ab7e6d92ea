package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/ipc"

	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/operators/reward"
	"github.com/trajflow/trajflow/operators/validate"
	"github.com/trajflow/trajflow/schemas"
)

func init() {
	register("stage", "stage NAME --in F --out F: run one stage's pure function offline over an Arrow IPC stream file", cmdStage)
}

// readRows reads every record batch of an Arrow IPC stream with codec c.
func readRows[T any](c *schemas.Codec[T], path string) ([]T, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r, err := ipc.NewReader(f)
	if err != nil {
		return nil, fmt.Errorf("%s: not an Arrow IPC stream: %w", path, err)
	}
	defer r.Release()
	var out []T
	for r.Next() {
		rows, err := c.FromRecord(r.RecordBatch())
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		out = append(out, rows...)
	}
	if err := r.Err(); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return out, nil
}

// writeRecords writes records of one schema as one IPC stream.
func writeRecords(path string, schema *arrow.Schema, recs []arrow.RecordBatch) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := ipc.NewWriter(f, ipc.WithSchema(schema))
	for _, rec := range recs {
		if err := w.Write(rec); err != nil {
			w.Close()
			f.Close()
			return fmt.Errorf("write %s: %w", path, err)
		}
	}
	if err := w.Close(); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

func writeRows[T any](c *schemas.Codec[T], path string, rows []T) error {
	rec, err := c.ToRecord(nil, rows)
	if err != nil {
		return err
	}
	defer rec.Release()
	return writeRecords(path, c.Schema(), []arrow.RecordBatch{rec})
}

func cmdStage(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("stage", stderr)
	in := fs.String("in", "", "input Arrow IPC stream file")
	out := fs.String("out", "", "output Arrow IPC stream file")
	path := fs.String("contract", "", "learning contract (default: the built-in demo contract)")
	trainer := fs.Int64("trainer-version", 0, "trainer policy version for the pack stage's lag rule")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 || *in == "" || *out == "" {
		return fmt.Errorf("%w: trajflow stage validate|reward|advantage|pack --in FILE --out FILE [--contract FILE]", errUsage)
	}
	c, err := loadContract(*path)
	if err != nil {
		return err
	}
	deps, err := operatorDeps(c, operatorsTopics(c))
	if err != nil {
		return err
	}
	switch pos[0] {
	case "validate":
		rows, err := readRows(schemas.Trajectories, *in)
		if err != nil {
			return err
		}
		opts := operators.ValidateOptions(deps)
		valid := rows[:0:0]
		for i := range rows {
			if v := validate.Check(&rows[i], opts); !v.OK() {
				fmt.Fprintf(stderr, "refused %s: %v\n", rows[i].RecordID, v)
				continue
			}
			valid = append(valid, rows[i])
		}
		fmt.Fprintf(stdout, "validate: %d in, %d valid\n", len(rows), len(valid))
		return writeRows(schemas.Trajectories, *out, valid)
	case "reward":
		rows, err := readRows(schemas.Trajectories, *in)
		if err != nil {
			return err
		}
		reg, err := operators.RewardRegistry(deps)
		if err != nil {
			return err
		}
		comps := operators.RewardComponents(c)
		outRows := make([]schemas.Rewarded, 0, len(rows))
		for i := range rows {
			r, err := reward.Score(ctx, &rows[i], comps, reg)
			if err != nil {
				return err
			}
			outRows = append(outRows, r)
		}
		fmt.Fprintf(stdout, "reward: %d rewarded\n", len(outRows))
		return writeRows(schemas.RewardedTrajectories, *out, outRows)
	case "advantage":
		rows, err := readRows(schemas.RewardedTrajectories, *in)
		if err != nil {
			return err
		}
		// Groups in order of first appearance; each scored as a whole.
		var order []string
		groups := map[string][]schemas.Rewarded{}
		for _, r := range rows {
			if _, ok := groups[r.GroupID]; !ok {
				order = append(order, r.GroupID)
			}
			groups[r.GroupID] = append(groups[r.GroupID], r)
		}
		var scored []schemas.Scored
		for _, g := range order {
			s, err := advantage.ScoreGroup(c.Estimator, groups[g])
			if err != nil {
				return fmt.Errorf("group %s: %w", g, err)
			}
			scored = append(scored, s...)
		}
		fmt.Fprintf(stdout, "advantage: %d groups, %d scored\n", len(order), len(scored))
		return writeRows(schemas.ScoredTrajectories, *out, scored)
	case "pack":
		rows, err := readRows(schemas.ScoredTrajectories, *in)
		if err != nil {
			return err
		}
		w, err := pack.NewWindow(c.Packing, *trainer)
		if err != nil {
			return err
		}
		var recs []arrow.RecordBatch
		defer func() {
			for _, r := range recs {
				r.Release()
			}
		}()
		var index int64
		flush := func() error {
			if len(w.Pending()) == 0 {
				return nil
			}
			b, closed := w.Close(index, c.RunID, c.Hash(), *trainer)
			fmt.Fprintf(stdout, "batch %d: %d rows, %d segments, %d tokens, efficiency %.4f, %d filtered at close\n",
				index, closed.Stats.Rows, closed.Stats.Segments, closed.Stats.Tokens, closed.Stats.Efficiency, len(closed.Filtered))
			index++
			if len(b.Rows) == 0 {
				return nil
			}
			rec, err := schemas.PackedBatches.ToRecord(nil, b)
			if err != nil {
				return err
			}
			recs = append(recs, rec)
			return nil
		}
		for _, s := range rows {
			if w.Ready() {
				if err := flush(); err != nil {
					return err
				}
			}
			res, err := w.Add(s)
			if err != nil {
				fmt.Fprintf(stderr, "refused %s: %v\n", s.RecordID, err)
				continue
			}
			if res.Outcome == pack.Filtered {
				fmt.Fprintf(stderr, "filtered %s: %s\n", s.RecordID, res.Filter)
			}
		}
		if err := flush(); err != nil {
			return err
		}
		return writeRecords(*out, schemas.PackedBatches.Schema(), recs)
	default:
		return fmt.Errorf("%w: no offline stage %q (validate, reward, advantage, pack)", errUsage, pos[0])
	}
}
