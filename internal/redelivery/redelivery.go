// Package redelivery holds the table of redelivered records that the
// advantage and pack stages' tests share (testdata/dedup/redelivery.yaml):
// what an identical redelivery and a conflicting one (the same record id
// with other content) look like, so both stages are held to one rule.
package redelivery

import (
	"bytes"
	"fmt"
	"math"
	"os"

	"gopkg.in/yaml.v3"

	"github.com/trajflow/trajflow/schemas"
)

// Want values of a Case.
const (
	Duplicate = "duplicate" // an identical redelivery: a counted no-op
	Malformed = "malformed" // the same id with other content: an error
)

// Case is one row of the table.
type Case struct {
	Name   string `yaml:"name"`
	Change string `yaml:"change"`
	Values string `yaml:"values"` // "nan": no critic ran
	Want   string `yaml:"want"`
}

// Load reads the table at path.
func Load(path string) ([]Case, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var doc struct {
		Cases []Case `yaml:"cases"`
	}
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	for _, c := range doc.Cases {
		if c.Want != Duplicate && c.Want != Malformed {
			return nil, fmt.Errorf("%s: case %q: want %q", path, c.Name, c.Want)
		}
	}
	return doc.Cases, nil
}

// Record returns the record of the table (see the file's comment), fresh
// on every call so a change never reaches another delivery.
func (c Case) Record() schemas.Rewarded {
	v0, v1 := float32(0.5), float32(0.25)
	if c.Values == "nan" {
		v0, v1 = float32(math.NaN()), float32(math.NaN())
	}
	return schemas.Rewarded{
		Trajectory: schemas.Trajectory{
			RecordID: "r0", RunID: "run", TaskID: "task", Split: schemas.SplitTrain,
			GroupID: "g", GroupSize: 2, Member: 0,
			Status: schemas.StatusCompleted, End: schemas.EndTerminated,
			Turns: []schemas.Turn{
				{Index: 0, PromptIDs: []int32{1, 2}, ActionIDs: []int32{3, 4}, ActionLogprobs: []float32{-0.5, -0.25},
					PolicyVersion: 3, Decision: schemas.DecisionOK, ObservationIDs: []int32{5}, Value: v0},
				{Index: 1, PromptIDs: []int32{6}, ActionIDs: []int32{7}, ActionLogprobs: []float32{-1},
					PolicyVersion: 4, Decision: schemas.DecisionOK, ObservationIDs: []int32{}, Value: v1},
			},
		},
		Rewards: []schemas.RewardComponent{{TrajectoryID: "r0", Name: "success", Version: "1", Raw: 1, Weight: 1,
			Transform: "identity", Value: 1, Scope: schemas.ScopeTrajectory, Turn: -1}},
		RewardTotal: 1,
	}
}

// Redelivered returns the second delivery: Record changed as c.Change says.
func (c Case) Redelivered() (schemas.Rewarded, error) {
	r := c.Record()
	t := r.Turns
	switch c.Change {
	case "none":
	case "empty_as_nil":
		t[1].ObservationIDs = nil
	case "prompt_token":
		t[0].PromptIDs = []int32{1, 9}
	case "action_token":
		t[1].ActionIDs = []int32{8}
	case "observation_token":
		t[0].ObservationIDs = []int32{6}
	case "action_logprob":
		t[0].ActionLogprobs = []float32{-0.5, -0.125}
	case "policy_version":
		t[1].PolicyVersion = 5
	case "reward_total":
		r.Rewards[0].Raw, r.Rewards[0].Value, r.RewardTotal = 2, 2, 2
	default:
		return r, fmt.Errorf("case %q: unknown change %q", c.Name, c.Change)
	}
	return r, nil
}
