package advantage_test

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/schemas"
)

// goldenDir holds one file per behaviour (repository testdata/advantage).
const goldenDir = "../../testdata/advantage"

type goldenComponent struct {
	Name      string  `yaml:"name"`
	Scope     string  `yaml:"scope"`
	Turn      int32   `yaml:"turn"`
	SpanStart int32   `yaml:"span_start"`
	SpanEnd   int32   `yaml:"span_end"`
	Value     float64 `yaml:"value"`
	Error     string  `yaml:"error"`
}

type goldenMember struct {
	Member         int32             `yaml:"member"`
	RecordID       string            `yaml:"record_id"`
	Status         string            `yaml:"status"`
	Turns          int               `yaml:"turns"`
	Values         []float32         `yaml:"values"`
	End            string            `yaml:"end"`
	EndReason      string            `yaml:"end_reason"`
	BootstrapValue float32           `yaml:"bootstrap_value"`
	Rewards        []goldenComponent `yaml:"rewards"`
}

type goldenStats struct {
	Size       int32   `yaml:"size"`
	Expected   int32   `yaml:"expected"`
	Mean       float64 `yaml:"mean"`
	Std        float64 `yaml:"std"`
	Min        float64 `yaml:"min"`
	Max        float64 `yaml:"max"`
	ZeroVar    bool    `yaml:"zero_var"`
	Filtered   string  `yaml:"filtered"`
	Incomplete bool    `yaml:"incomplete"`
}

type goldenExpectMember struct {
	Member       int32     `yaml:"member"`
	Rewards      []float64 `yaml:"rewards"`
	Returns      []float64 `yaml:"returns"`
	Advantages   []float64 `yaml:"advantages"`
	ValueTargets []float64 `yaml:"value_targets"`
}

type goldenCase struct {
	Options   advantage.Options `yaml:"options"`
	GroupSize int32             `yaml:"group_size"`
	Members   []goldenMember    `yaml:"members"`
	Expect    struct {
		EstimatorVersion string               `yaml:"estimator_version"`
		Group            goldenStats          `yaml:"group"`
		Members          []goldenExpectMember `yaml:"members"`
	} `yaml:"expect"`
}

const goldenGroupID = "golden-group"

func (m goldenMember) rewarded(groupSize int32) (schemas.Rewarded, error) {
	if m.Values != nil && len(m.Values) != m.Turns {
		return schemas.Rewarded{}, fmt.Errorf("member %d: %d values for %d turns", m.Member, len(m.Values), m.Turns)
	}
	r := schemas.Rewarded{Trajectory: schemas.Trajectory{
		RecordID:       m.RecordID,
		GroupID:        goldenGroupID,
		GroupSize:      groupSize,
		Member:         m.Member,
		Status:         m.Status,
		End:            m.End,
		EndReason:      m.EndReason,
		BootstrapValue: m.BootstrapValue,
	}}
	if r.RecordID == "" {
		r.RecordID = fmt.Sprintf("m%d", m.Member)
	}
	if r.Status == "" {
		r.Status = schemas.StatusCompleted
	}
	if r.End == "" {
		r.End = schemas.EndTerminated
	}
	for i := range m.Turns {
		v := float32(math.NaN())
		if m.Values != nil {
			v = m.Values[i]
		}
		r.Turns = append(r.Turns, schemas.Turn{Index: int32(i), ActionIDs: []int32{1, 2, 3, 4}, Value: v})
	}
	for _, c := range m.Rewards {
		turn := c.Turn
		if c.Scope == schemas.ScopeTrajectory {
			turn = -1
		}
		r.Rewards = append(r.Rewards, schemas.RewardComponent{
			TrajectoryID: r.RecordID, Name: c.Name, Version: "1", Raw: c.Value, Weight: 1,
			Transform: "identity", Value: c.Value, Scope: c.Scope, Turn: turn,
			SpanStart: c.SpanStart, SpanEnd: c.SpanEnd, Error: c.Error,
		})
		r.RewardTotal += c.Value
	}
	return r, nil
}

func loadGolden(t *testing.T, path string) goldenCase {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var c goldenCase
	if err := dec.Decode(&c); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return c
}

const tol = 1e-6

func near(a, b float64) bool { return math.Abs(a-b) <= tol }

func compareSlice(t *testing.T, what string, got []float32, want []float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: got %d entries %v, want %d %v", what, len(got), got, len(want), want)
		return
	}
	for i := range want {
		if !near(float64(got[i]), want[i]) {
			t.Errorf("%s[%d] = %v, want %v", what, i, got[i], want[i])
		}
	}
}

// TestGolden scores every testdata/advantage file in three member orders and
// compares the result with the expected output written next to its input.
func TestGolden(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(goldenDir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 10 {
		t.Fatalf("found %d golden files in %s, want at least 10", len(files), goldenDir)
	}
	for _, path := range files {
		t.Run(filepath.Base(path), func(t *testing.T) {
			c := loadGolden(t, path)
			var members []schemas.Rewarded
			for _, m := range c.Members {
				r, err := m.rewarded(c.GroupSize)
				if err != nil {
					t.Fatal(err)
				}
				members = append(members, r)
			}
			reversed := slices.Clone(members)
			slices.Reverse(reversed)
			rotated := append(slices.Clone(members[1:]), members[0])

			got, err := advantage.ScoreGroup(c.Options, members)
			if err != nil {
				t.Fatalf("ScoreGroup: %v", err)
			}
			for name, in := range map[string][]schemas.Rewarded{"reversed": reversed, "rotated": rotated} {
				other, err := advantage.ScoreGroup(c.Options, in)
				if err != nil {
					t.Fatalf("ScoreGroup(%s): %v", name, err)
				}
				if !reflect.DeepEqual(got, other) {
					t.Errorf("output for %s member order differs from file order", name)
				}
			}

			want := c.Expect
			if len(got) != len(want.Members) {
				t.Fatalf("got %d scored members, want %d", len(got), len(want.Members))
			}
			for i, s := range got {
				w := want.Members[i]
				if s.Member != w.Member {
					t.Errorf("output %d is member %d, want %d", i, s.Member, w.Member)
					continue
				}
				p := fmt.Sprintf("member %d ", w.Member)
				compareSlice(t, p+"rewards", s.TurnRewards, w.Rewards)
				compareSlice(t, p+"returns", s.TurnReturns, w.Returns)
				compareSlice(t, p+"advantages", s.TurnAdvantages, w.Advantages)
				compareSlice(t, p+"value_targets", s.TurnValueTargets, w.ValueTargets)
				if s.Estimator != c.Options.Estimator || s.EstimatorVersion != want.EstimatorVersion {
					t.Errorf("%sestimator %q/%q, want %q/%q", p, s.Estimator, s.EstimatorVersion, c.Options.Estimator, want.EstimatorVersion)
				}
				g, wg := s.Group, want.Group
				if g.Size != wg.Size || g.Expected != wg.Expected || g.ZeroVar != wg.ZeroVar ||
					g.Filtered != wg.Filtered || g.Incomplete != wg.Incomplete ||
					!near(g.Mean, wg.Mean) || !near(g.Std, wg.Std) || !near(g.Min, wg.Min) || !near(g.Max, wg.Max) {
					t.Errorf("%sgroup stats %+v, want %+v", p, g, wg)
				}
			}
		})
	}
}
