package gate

import (
	"errors"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

func testPolicy() Policy {
	return Policy{
		Objective: contract.Objective{
			PrimaryMetric: "verified_success_rate",
			Constraints:   map[string]float64{"unsafe_action_rate": 0, "p95_turns": 4},
			RegressionFloors: map[string]contract.Floor{
				"regression_success_rate": {Value: 0.98, Relative: true},
			},
			KLLimit: 0.5,
		},
		StopRules: []contract.StopRule{
			{Kind: contract.StopSafetyViolation},
			{Kind: contract.StopNoValidationGain, N: 3},
			{Kind: contract.StopKLAboveLimit, N: 2},
		},
	}
}

// ev is an evaluation with primary value v in [lo, hi], regression
// success reg, p95 turns p95 and unsafe actions out of 256.
func ev(version int64, v, lo, hi, reg, p95 float64, unsafe int) Evaluation {
	return Evaluation{Version: version, UnsafeActions: unsafe, Metrics: map[string]Estimate{
		"verified_success_rate":   {Value: v, Lo: lo, Hi: hi, N: 256},
		"regression_success_rate": {Value: reg, Lo: reg, Hi: reg, N: 256},
		"p95_turns":               {Value: p95, Lo: p95, Hi: p95, N: 256},
		"p95_cost":                {Value: 120, Lo: 110, Hi: 130, N: 256},
		"unsafe_action_rate":      {Value: float64(unsafe) / 256, N: 256},
	}}
}

// withMetric is e with metric name set to v (a point estimate).
func withMetric(e Evaluation, name string, v float64) Evaluation {
	e.Metrics[name] = Estimate{Value: v, Lo: v, Hi: v, N: 256}
	return e
}

func TestDecideTable(t *testing.T) {
	initial := ev(0, 0.30, 0.25, 0.36, 0.50, 4, 0)
	promoted5 := ev(5, 0.50, 0.44, 0.56, 0.50, 3, 0)
	noSafetyRule := testPolicy()
	noSafetyRule.StopRules = noSafetyRule.StopRules[1:]
	costCapped := testPolicy() // p95 of an episode's rollout tokens at most 200
	costCapped.Objective.Constraints = map[string]float64{"unsafe_action_rate": 0, "p95_turns": 4, "p95_cost": 200}
	for _, c := range []struct {
		name     string
		p        Policy
		state    func(*State)
		eval     Evaluation
		open     []Incident
		action   string
		rule     string
		back     int64 // RollbackTo
		promoted int64
		noGain   int
	}{
		{name: "improvement clears the interval: promote",
			eval: ev(5, 0.50, 0.44, 0.56, 0.50, 3, 0), action: Promote, promoted: 5},
		{name: "improvement inside the interval: continue", // Lo 0.28 < promoted 0.30
			eval: ev(5, 0.34, 0.28, 0.40, 0.50, 3, 0), action: Continue, noGain: 1},
		{name: "lower bound equal to the promoted value: continue",
			eval: ev(5, 0.36, 0.30, 0.42, 0.50, 3, 0), action: Continue, noGain: 1},
		{name: "regression floor broken: rollback", // 0.48 < 0.98 x 0.50 = 0.49
			state: func(s *State) { s.Promoted = promoted5 },
			eval:  ev(10, 0.70, 0.64, 0.76, 0.48, 3, 0), action: Rollback, back: 5, promoted: 5, noGain: 1},
		{name: "regression floor met exactly: promote",
			state: func(s *State) { s.Promoted = promoted5 },
			eval:  ev(10, 0.70, 0.64, 0.76, 0.49, 3, 0), action: Promote, promoted: 10},
		{name: "hard constraint broken (p95 turns 5 > 4): rollback",
			state: func(s *State) { s.Promoted = promoted5 },
			eval:  ev(10, 0.70, 0.64, 0.76, 0.50, 5, 0), action: Rollback, back: 5, promoted: 5, noGain: 1},
		{name: "hard constraint broken (p95 cost 250 > 200 tokens): rollback",
			p: costCapped, state: func(s *State) { s.Promoted = promoted5 },
			eval: withMetric(ev(10, 0.70, 0.64, 0.76, 0.50, 3, 0), "p95_cost", 250), action: Rollback, back: 5, promoted: 5, noGain: 1},
		{name: "p95 cost within its bound: promote",
			p: costCapped, state: func(s *State) { s.Promoted = promoted5 },
			eval: withMetric(ev(10, 0.70, 0.64, 0.76, 0.50, 3, 0), "p95_cost", 200), action: Promote, promoted: 10},
		{name: "unsafe action: stop by safety_violation",
			eval: ev(5, 0.50, 0.44, 0.56, 0.50, 3, 1), action: Stop, rule: "safety_violation"},
		{name: "unsafe action without the safety rule: rollback",
			p: noSafetyRule, state: func(s *State) { s.Promoted = promoted5 },
			eval: ev(10, 0.70, 0.64, 0.76, 0.50, 3, 2), action: Rollback, back: 5, promoted: 5, noGain: 1},
		{name: "open safety incident: stop by safety_violation",
			eval: ev(5, 0.50, 0.44, 0.56, 0.50, 3, 0), open: []Incident{{ID: "q1", Kind: "eval_task_attempt", Safety: true}},
			action: Stop, rule: "safety_violation"},
		{name: "open incident blocks promotion: continue",
			eval: ev(5, 0.50, 0.44, 0.56, 0.50, 3, 0), open: []Incident{{ID: "b7", Kind: "batch_corrupt"}},
			action: Continue, noGain: 1},
		{name: "no gain for 3 evaluations: stop",
			state: func(s *State) { s.EvalsWithoutGain = 2 },
			eval:  ev(15, 0.31, 0.26, 0.37, 0.50, 3, 0), action: Stop, rule: "no_validation_gain_for_3_evals", noGain: 3},
		{name: "rollback reaching the no-gain count: stop, rollback kept",
			state: func(s *State) { s.Promoted = promoted5; s.EvalsWithoutGain = 2 },
			eval:  ev(15, 0.10, 0.07, 0.14, 0.20, 3, 0), action: Stop, rule: "no_validation_gain_for_3_evals", back: 5, promoted: 5, noGain: 3},
		{name: "KL above limit for 2 updates (counted by Update): stop",
			state: func(s *State) { s.KLAbove = 2 },
			eval:  ev(5, 0.50, 0.44, 0.56, 0.50, 3, 0), action: Stop, rule: "kl_above_limit_for_2_updates"},
		{name: "KL above limit for fewer updates: promote",
			state: func(s *State) { s.KLAbove = 1 },
			eval:  ev(5, 0.50, 0.44, 0.56, 0.50, 3, 0), action: Promote, promoted: 5},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := c.p
			if p.Objective.PrimaryMetric == "" {
				p = testPolicy()
			}
			s, err := Start(p, initial)
			if err != nil {
				t.Fatal(err)
			}
			if c.state != nil {
				c.state(&s)
			}
			d, next, err := Decide(p, s, c.eval, c.open)
			if err != nil {
				t.Fatal(err)
			}
			if d.Action != c.action || d.StopRule != c.rule || d.RollbackTo != c.back || d.Promoted != c.promoted {
				t.Errorf("decision %s rule %q rollback_to %d promoted %d (%s); want %s %q %d %d",
					d.Action, d.StopRule, d.RollbackTo, d.Promoted, d.Reason, c.action, c.rule, c.back, c.promoted)
			}
			if next.Promoted.Version != c.promoted || next.EvalsWithoutGain != c.noGain || next.Stopped != (c.action == Stop) {
				t.Errorf("next state promoted %d, evals without gain %d, stopped %v; want %d %d %v",
					next.Promoted.Version, next.EvalsWithoutGain, next.Stopped, c.promoted, c.noGain, c.action == Stop)
			}
			if d.PolicyVersion != c.eval.Version || d.Reason == "" {
				t.Errorf("decision version %d reason %q", d.PolicyVersion, d.Reason)
			}
			// The evidence holds the primary metric against the promoted value.
			found := false
			for _, ch := range d.Checks {
				if ch.Kind == CheckPrimary && ch.Name == "verified_success_rate" && ch.Lo == c.eval.Metrics["verified_success_rate"].Lo {
					found = true
				}
			}
			if !found {
				t.Errorf("no primary check in the evidence %+v", d.Checks)
			}
		})
	}
}

func TestUpdateKLRule(t *testing.T) {
	p := testPolicy()
	s, err := Start(p, ev(0, 0.3, 0.25, 0.36, 0.5, 4, 0))
	if err != nil {
		t.Fatal(err)
	}
	// 0.6, 0.4 (resets), 0.6: never two in a row.
	for i, kl := range []float64{0.6, 0.4, 0.6} {
		var d *Decision
		if d, s = Update(p, s, int64(i+1), kl); d != nil {
			t.Fatalf("update %d kl %v: stop %+v", i+1, kl, d)
		}
	}
	d, s := Update(p, s, 4, 0.7)
	if d == nil || d.Action != Stop || d.StopRule != "kl_above_limit_for_2_updates" || d.PolicyVersion != 4 || !s.Stopped {
		t.Fatalf("second update above the limit: %+v, stopped %v", d, s.Stopped)
	}
	if _, _, err := Decide(p, s, ev(5, 0.5, 0.44, 0.56, 0.5, 3, 0), nil); err == nil {
		t.Error("an evaluation after the stop: no error")
	}
	// At the limit is not above it.
	s2, _ := Start(p, ev(0, 0.3, 0.25, 0.36, 0.5, 4, 0))
	for i := range 5 {
		if d, s2 = Update(p, s2, int64(i+1), 0.5); d != nil {
			t.Fatalf("kl at the limit stopped the run: %+v", d)
		}
	}
}

func TestUnmeasuredMetric(t *testing.T) {
	p := testPolicy()
	p.Objective.RegressionFloors["tool_schema_holdout"] = contract.Floor{Value: 0.75}
	_, err := Start(p, ev(0, 0.3, 0.25, 0.36, 0.5, 4, 0))
	if !errors.Is(err, ErrUnmeasured) || !strings.Contains(err.Error(), "objective.regression_floors.tool_schema_holdout") {
		t.Fatalf("err = %v, want ErrUnmeasured naming the floor", err)
	}
}

func TestCheckBudget(t *testing.T) {
	p := testPolicy()
	p.Budgets = contract.Budgets{RolloutTokens: 1000, OptimizerTokens: 800, EnvironmentHours: 1, AcceleratorHours: 1}
	s, _ := Start(p, ev(0, 0.3, 0.25, 0.36, 0.5, 4, 0))
	if d, s2 := CheckBudget(p, s, 3, Usage{RolloutTokens: 999, OptimizerTokens: 700}); d != nil || s2.Stopped {
		t.Fatalf("under every budget: %+v", d)
	}
	d, s2 := CheckBudget(p, s, 4, Usage{RolloutTokens: 1000, OptimizerTokens: 700})
	if d == nil || d.Action != Stop || d.StopRule != "budget_exhausted" || !s2.Stopped || !strings.Contains(d.Reason, "rollout_tokens 1000 of 1000") {
		t.Fatalf("rollout budget reached: %+v", d)
	}
	if d.Checks[0].OK || !d.Checks[1].OK {
		t.Fatalf("checks %+v", d.Checks)
	}
}

// TestCountCensus: the budgets count a completed episode's tokens and
// time, and the time of an infrastructure try that was run again; nothing
// else (hours: 3.6e9 µs = 1 h).
func TestCountCensus(t *testing.T) {
	for _, tc := range []struct {
		name string
		ev   schemas.CensusEvent
		want Usage
		ok   bool
	}{
		{"completed", schemas.CensusEvent{Kind: schemas.CensusCompleted, Tokens: 40, LatencyUS: 1_800_000}, Usage{RolloutTokens: 40, EnvironmentHours: 0.0005}, true},
		{"infrastructure try", schemas.CensusEvent{Kind: schemas.CensusFailed, Infra: true, LatencyUS: 3_600_000}, Usage{EnvironmentHours: 0.001}, true},
		{"timed out", schemas.CensusEvent{Kind: schemas.CensusTimedOut, Infra: true, LatencyUS: 360_000}, Usage{EnvironmentHours: 0.0001}, true},
		{"failed try without time", schemas.CensusEvent{Kind: schemas.CensusFailed, Infra: true}, Usage{}, false},
		{"agent failure", schemas.CensusEvent{Kind: schemas.CensusFailed, LatencyUS: 5}, Usage{}, false},
		{"quarantined after completing", schemas.CensusEvent{Kind: schemas.CensusQuarantined, Stage: "validate", Tokens: 9, LatencyUS: 5}, Usage{}, false},
		{"started", schemas.CensusEvent{Kind: schemas.CensusStarted}, Usage{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var u Usage
			if ok := CountCensus(&u, tc.ev); ok != tc.ok || u != tc.want {
				t.Fatalf("CountCensus = %v, usage %+v; want %v, %+v", ok, u, tc.ok, tc.want)
			}
		})
	}
}
