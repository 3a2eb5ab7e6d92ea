package pack

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/schemas"
)

var update = flag.Bool("update", false, "rewrite the expect blocks of testdata/pack golden files")

const shiftGolden = "../../testdata/pack/shift_alignment.txt"

// goldenCase is one "case ... end" block of a golden file.
type goldenCase struct {
	name           string
	line           int
	opts           Options
	trainerVersion int64
	trajs          []schemas.Scored
	expect         []string // lines between "expect" and "end"
}

// parseGolden reads the golden file format documented at the top of
// testdata/pack/shift_alignment.txt.
func parseGolden(path string) ([]goldenCase, []string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	lines := strings.Split(string(raw), "\n")
	var cases []goldenCase
	var cur *goldenCase
	inExpect := false
	for i, line := range lines {
		f := strings.Fields(line)
		if inExpect {
			if len(f) == 1 && f[0] == "end" {
				inExpect = false
				cases = append(cases, *cur)
				cur = nil
				continue
			}
			cur.expect = append(cur.expect, line)
			continue
		}
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		bad := func(format string, a ...any) error {
			return fmt.Errorf("%s:%d: %s", path, i+1, fmt.Sprintf(format, a...))
		}
		if f[0] != "case" && cur == nil {
			return nil, nil, bad("%q outside a case", f[0])
		}
		kv := map[string]string{}
		for _, w := range f[1:] {
			if k, v, ok := strings.Cut(w, "="); ok {
				kv[k] = v
			}
		}
		switch f[0] {
		case "case":
			cur = &goldenCase{name: strings.Join(f[1:], " "), line: i + 1}
		case "options":
			var err error
			cur.opts.TokenBudget, err = strconv.Atoi(kv["token_budget"])
			if err != nil {
				return nil, nil, bad("token_budget: %v", err)
			}
			cur.opts.MaxLag, _ = strconv.ParseInt(kv["max_lag"], 10, 64)
			cur.trainerVersion, _ = strconv.ParseInt(kv["trainer_version"], 10, 64)
			cur.opts.StalePolicy = kv["stale_policy"]
			cur.opts.Overflow = kv["overflow"]
			cur.opts.BatchTokens = 1 << 30
		case "trajectory":
			if len(f) < 2 {
				return nil, nil, bad("trajectory without id")
			}
			s := scored(f[1], kv["group"])
			s.Group.Filtered = kv["filtered"]
			cur.trajs = append(cur.trajs, s)
		case "turn":
			if len(cur.trajs) == 0 {
				return nil, nil, bad("turn before trajectory")
			}
			s := &cur.trajs[len(cur.trajs)-1]
			var t schemas.Turn
			var err error
			ints := func(k string) []int32 {
				var out []int32
				for _, w := range strings.Split(kv[k], ",") {
					if w == "" {
						continue
					}
					v, e := strconv.ParseInt(w, 10, 32)
					if e != nil && err == nil {
						err = e
					}
					out = append(out, int32(v))
				}
				return out
			}
			floats := func(k string) []float32 {
				var out []float32
				for _, w := range strings.Split(kv[k], ",") {
					if w == "" {
						continue
					}
					v, e := strconv.ParseFloat(w, 32)
					if e != nil && err == nil {
						err = e
					}
					out = append(out, float32(v))
				}
				return out
			}
			t.Index = int32(len(s.Turns))
			t.PromptIDs, t.ActionIDs, t.ObservationIDs = ints("prompt"), ints("action"), ints("obs")
			t.ActionLogprobs = floats("logprobs")
			t.PolicyVersion, _ = strconv.ParseInt(kv["version"], 10, 64)
			t.Decision = kv["decision"]
			adv, vt := floats("advantage"), floats("value_target")
			if err != nil || len(adv) != 1 {
				return nil, nil, bad("turn: %v (advantage %v)", err, adv)
			}
			s.Turns = append(s.Turns, t)
			s.TurnAdvantages = append(s.TurnAdvantages, adv[0])
			if len(vt) == 1 {
				s.TurnValueTargets = append(s.TurnValueTargets, vt[0])
			}
		case "expect":
			inExpect = true
		default:
			return nil, nil, bad("unknown directive %q", f[0])
		}
	}
	if cur != nil {
		return nil, nil, fmt.Errorf("%s: case %q not ended", path, cur.name)
	}
	return cases, lines, nil
}

// renderGolden runs one case and renders its outcome: the filtered
// trajectories, then one line per packed position with the input side
// (row, position, input id, role, segment, the target input id) beside the
// target-aligned columns.
func renderGolden(t *testing.T, c goldenCase) []string {
	t.Helper()
	var out []string
	var segs []Segment
	for i := range c.trajs {
		seg, f, err := Reconstruct(&c.trajs[i], c.trainerVersion, c.opts)
		if err != nil {
			out = append(out, fmt.Sprintf("error %s %v", c.trajs[i].RecordID, err))
			continue
		}
		if f != FilterNone {
			out = append(out, fmt.Sprintf("filtered %s %s", c.trajs[i].RecordID, f))
			continue
		}
		segs = append(segs, seg)
	}
	rows, st := Pack(segs, c.opts.TokenBudget)
	roles := make(map[string][]Role)
	for i := range segs {
		roles[segs[i].TrajectoryID] = segs[i].Roles()
	}
	out = append(out, fmt.Sprintf("stats rows=%d segments=%d tokens=%d trained=%d truncated=%d efficiency=%.4f",
		st.Rows, st.Segments, st.Tokens, st.TrainedTokens, st.Truncated, st.Efficiency))
	for r, row := range rows {
		for k, id := range row.SegTrajectoryIDs {
			out = append(out, fmt.Sprintf("segment row=%d seg=%d trajectory=%s group=%s policy_version=%d length=%d weight=%g truncated=%v",
				r, k, id, row.SegGroupIDs[k], row.SegPolicyVersions[k], row.SegLengths[k], row.SegWeights[k], row.SegTruncated[k]))
		}
	}
	out = append(out, fmt.Sprintf("%-3s %-3s %-3s %-5s %-7s %-6s | %-4s %-8s %-9s %-6s %-4s %s",
		"row", "pos", "seg", "input", "role", "target", "mask", "old_lp", "advantage", "value", "turn", "version"))
	for r, row := range rows {
		start := 0
		for p := range row.InputIDs {
			seg := row.SegmentIDs[p]
			if p > 0 && seg != row.SegmentIDs[p-1] {
				start = p
			}
			target := "-"
			if p+1 < len(row.InputIDs) && row.SegmentIDs[p+1] == seg {
				target = strconv.Itoa(int(row.InputIDs[p+1]))
			}
			role := roles[row.SegTrajectoryIDs[seg]][p-start]
			out = append(out, fmt.Sprintf("%-3d %-3d %-3d %-5d %-7s %-6s | %-4d %-8g %-9g %-6g %-4d %d",
				r, row.PositionIDs[p], seg, row.InputIDs[p], role, target,
				row.ActionMask[p], row.OldLogprobs[p], row.Advantages[p], row.ValueTargets[p], row.TurnIDs[p], row.PolicyVersions[p]))
		}
	}
	return out
}

func fields(lines []string) [][]string {
	var out [][]string
	for _, l := range lines {
		if f := strings.Fields(l); len(f) > 0 {
			out = append(out, f)
		}
	}
	return out
}

// TestShiftAlignmentGolden reads testdata/pack/shift_alignment.txt: input
// trajectories and the expected packed, target-aligned columns side by
// side (docs/PIPELINE.md §11, §12). Run with -update to rewrite the expect blocks
// after a deliberate change (then review the diff by hand).
func TestShiftAlignmentGolden(t *testing.T) {
	cases, lines, err := parseGolden(shiftGolden)
	if err != nil {
		t.Fatal(err)
	}
	if len(cases) == 0 {
		t.Fatal("no cases")
	}
	rendered := make([][]string, len(cases))
	for i, c := range cases {
		rendered[i] = renderGolden(t, c)
		t.Run(c.name, func(t *testing.T) {
			got, want := fields(rendered[i]), fields(c.expect)
			if !*update && !reflect.DeepEqual(got, want) {
				t.Errorf("%s:%d: case %q\n got:\n%s\nwant:\n%s", shiftGolden, c.line, c.name,
					strings.Join(rendered[i], "\n"), strings.Join(c.expect, "\n"))
			}
		})
	}
	if *update {
		var b strings.Builder
		w := bufio.NewWriter(&b)
		ci, skipping := 0, false
		for i, line := range lines {
			f := strings.Fields(line)
			switch {
			case skipping && len(f) == 1 && f[0] == "end":
				skipping = false
			case skipping:
				continue
			case len(f) == 1 && f[0] == "expect":
				fmt.Fprintln(w, line)
				for _, l := range rendered[ci] {
					fmt.Fprintln(w, l)
				}
				ci++
				skipping = true
				continue
			}
			if i == len(lines)-1 && line == "" {
				break
			}
			fmt.Fprintln(w, line)
		}
		w.Flush()
		if err := os.WriteFile(shiftGolden, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
