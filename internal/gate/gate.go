package gate

import (
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// Actions of a decision (docs/PIPELINE.md §17).
const (
	// Promote: the evaluated release is the new promoted release.
	Promote = schemas.GatePromote
	// Continue: training goes on; the promoted release stays.
	Continue = schemas.GateContinue
	// Rollback: the evaluated release broke a hard constraint or a
	// regression floor; the run goes back to the last promoted release
	// (RollbackTo), and the failed branch is kept as evidence.
	Rollback = schemas.GateRollback
	// Stop: a stop rule fired (StopRule); the run ends, its result is the
	// last promoted release.
	Stop = schemas.GateStop
)

// Check kinds.
const (
	CheckPrimary     = "primary"
	CheckConstraint  = "constraint"
	CheckFloor       = "regression_floor"
	CheckSafety      = "safety"
	CheckIncident    = "incident"
	CheckKL          = "kl"
	CheckNoGain      = "no_validation_gain"
	CheckBudgetSpent = "budget"
)

// Estimate is a metric's point estimate with its confidence interval
// [Lo, Hi] over N observations (Lo = Hi = Value when the metric has no
// interval).
type Estimate = schemas.Estimate

// Evaluation is one measurement of a release by the evaluation plane:
// every metric by name, and the count of unsafe actions of its safety
// suite.
type Evaluation = schemas.GateEvaluation

// Incident is an open (unresolved) incident of the run: a quarantined
// attempt at evaluation data, an infrastructure corruption, a reward
// anomaly. Safety incidents stop the run under the safety_violation rule;
// any other open incident blocks promotion.
type Incident = schemas.GateIncident

// Policy is what the gate applies: the contract's objective (primary
// metric, constraints, regression floors, KL limit) and stop rules.
type Policy struct {
	Objective contract.Objective
	StopRules []contract.StopRule
	Budgets   contract.Budgets
}

// PolicyOf is the gate policy of a resolved contract.
func PolicyOf(c *contract.Contract) Policy {
	return Policy{Objective: c.Objective, StopRules: c.StopRules, Budgets: c.Budgets}
}

// rule returns the stop rule of kind, if declared.
func (p Policy) rule(kind string) (contract.StopRule, bool) {
	for _, r := range p.StopRules {
		if r.Kind == kind {
			return r, true
		}
	}
	return contract.StopRule{}, false
}

// Check is one piece of a decision's evidence.
type Check = schemas.GateCheck

// Decision is the gate's answer for one evaluation (or one update, for a
// KL stop), with its evidence; the loop fills RunID and At and puts it on
// the decisions topic.
type Decision = schemas.GateDecision

// State is what the gate remembers between decisions.
type State = schemas.GateState

// ErrUnmeasured is wrapped when the contract names a metric the
// evaluation does not measure.
var ErrUnmeasured = errors.New("gate: metric not measured by the evaluation plane")

// Start checks that the initial evaluation measures every metric the
// policy names and returns the first state: the initial release promoted.
func Start(p Policy, initial Evaluation) (State, error) {
	if err := p.measured(initial); err != nil {
		return State{}, err
	}
	return State{Initial: initial, Promoted: initial}, nil
}

// measured reports every metric of p missing from ev.
func (p Policy) measured(ev Evaluation) error {
	have := slices.Sorted(maps.Keys(ev.Metrics))
	var errs []error
	miss := func(key, m string) {
		if _, ok := ev.Metrics[m]; !ok {
			errs = append(errs, fmt.Errorf("%w: %s: %q (measured: %v)", ErrUnmeasured, key, m, have))
		}
	}
	miss("objective.primary_metric", p.Objective.PrimaryMetric)
	for _, m := range slices.Sorted(maps.Keys(p.Objective.Constraints)) {
		miss("objective.constraints."+m, m)
	}
	for _, m := range slices.Sorted(maps.Keys(p.Objective.RegressionFloors)) {
		miss("objective.regression_floors."+m, m)
	}
	return errors.Join(errs...)
}

// Update counts one trained update with mean KL to the reference kl and
// returns a stop decision when the kl_above_limit_for_N_updates rule
// fires (nil otherwise). Without that rule it only counts.
func Update(p Policy, s State, version int64, kl float64) (*Decision, State) {
	if p.Objective.KLLimit > 0 && kl > p.Objective.KLLimit {
		s.KLAbove++
	} else {
		s.KLAbove = 0
	}
	r, ok := p.rule(contract.StopKLAboveLimit)
	if !ok || s.Stopped || s.KLAbove < r.N {
		return nil, s
	}
	s.Stopped = true
	return &Decision{
		PolicyVersion: version, Action: Stop, StopRule: r.String(), Promoted: s.Promoted.Version,
		Reason: fmt.Sprintf("KL %.4g above the limit %.4g for %d consecutive updates", kl, p.Objective.KLLimit, s.KLAbove),
		Checks: []Check{{Kind: CheckKL, Name: "kl", Value: kl, Lo: kl, Hi: kl, Bound: p.Objective.KLLimit}},
	}, s
}

// Decide applies p to the evaluation ev of a release given the gate's
// state and the run's open incidents, and returns the decision and the
// next state. In order:
//
//  1. an unsafe action in the safety suite, or an open safety incident:
//     stop by safety_violation when declared, otherwise roll back;
//  2. the KL rule already counted to N (Update): stop;
//  3. a hard constraint above its bound, or a regression floor broken
//     (relative floors against the initial evaluation): roll back to the
//     last promoted release;
//  4. any other open incident: continue (no promotion while one is open);
//  5. the primary metric's interval lies above the promoted release's
//     value (Lo > promoted value): promote;
//  6. otherwise continue.
//
// Every outcome but a promotion counts toward
// no_validation_gain_for_N_evals; at N the decision is a stop (a rollback
// that reaches N stops too, with RollbackTo kept).
func Decide(p Policy, s State, ev Evaluation, open []Incident) (Decision, State, error) {
	if err := p.measured(ev); err != nil {
		return Decision{}, s, err
	}
	if s.Stopped {
		return Decision{}, s, fmt.Errorf("gate: release %d evaluated after the run stopped", ev.Version)
	}
	d := Decision{PolicyVersion: ev.Version, Evaluated: true}
	safeOK := ev.UnsafeActions == 0
	d.Checks = append(d.Checks, Check{Kind: CheckSafety, Name: "unsafe_actions", Value: float64(ev.UnsafeActions),
		Lo: float64(ev.UnsafeActions), Hi: float64(ev.UnsafeActions), OK: safeOK})
	var safetyInc, otherInc []string
	for _, in := range open {
		if in.Safety {
			safetyInc = append(safetyInc, in.ID)
		} else {
			otherInc = append(otherInc, in.ID)
		}
		d.Checks = append(d.Checks, Check{Kind: CheckIncident, Name: in.Kind + ":" + in.ID})
	}
	var broken []string
	for _, m := range slices.Sorted(maps.Keys(p.Objective.Constraints)) {
		e, bound := ev.Metrics[m], p.Objective.Constraints[m]
		ok := e.Value <= bound
		d.Checks = append(d.Checks, Check{Kind: CheckConstraint, Name: m, Value: e.Value, Lo: e.Lo, Hi: e.Hi, Bound: bound, OK: ok})
		if !ok {
			broken = append(broken, fmt.Sprintf("constraint %s %.4g > %.4g", m, e.Value, bound))
		}
	}
	for _, m := range slices.Sorted(maps.Keys(p.Objective.RegressionFloors)) {
		e, th := ev.Metrics[m], p.Objective.RegressionFloors[m].Threshold(s.Initial.Metrics[m].Value)
		ok := e.Value >= th
		d.Checks = append(d.Checks, Check{Kind: CheckFloor, Name: m, Value: e.Value, Lo: e.Lo, Hi: e.Hi, Bound: th, OK: ok})
		if !ok {
			broken = append(broken, fmt.Sprintf("regression floor %s %.4g < %.4g (%s)", m, e.Value, th, p.Objective.RegressionFloors[m]))
		}
	}
	pm := p.Objective.PrimaryMetric
	cur, prom := ev.Metrics[pm], s.Promoted.Metrics[pm].Value
	gain := cur.Lo > prom
	d.Checks = append(d.Checks, Check{Kind: CheckPrimary, Name: pm, Value: cur.Value, Lo: cur.Lo, Hi: cur.Hi, Bound: prom, OK: gain})

	switch {
	case !safeOK || len(safetyInc) > 0:
		why := fmt.Sprintf("%d unsafe actions in the safety suite", ev.UnsafeActions)
		if len(safetyInc) > 0 {
			why = fmt.Sprintf("open safety incidents %v", safetyInc)
		}
		if r, ok := p.rule(contract.StopSafetyViolation); ok {
			d.Action, d.StopRule, d.Reason = Stop, r.String(), why
			s.Stopped = true
		} else {
			d.Action, d.RollbackTo, d.Reason = Rollback, s.Promoted.Version, why
		}
	case s.KLAbove > 0 && klRuleReached(p, s):
		r, _ := p.rule(contract.StopKLAboveLimit)
		d.Action, d.StopRule, d.Reason = Stop, r.String(), fmt.Sprintf("KL above the limit for %d consecutive updates", s.KLAbove)
		s.Stopped = true
	case len(broken) > 0:
		d.Action, d.RollbackTo = Rollback, s.Promoted.Version
		d.Reason = fmt.Sprintf("%v; back to release %d", broken, s.Promoted.Version)
	case len(otherInc) > 0:
		d.Action, d.Reason = Continue, fmt.Sprintf("open incidents %v block promotion", otherInc)
	case gain:
		d.Action = Promote
		d.Reason = fmt.Sprintf("%s %.4g [%.4g, %.4g] clears the promoted release %d (%.4g)", pm, cur.Value, cur.Lo, cur.Hi, s.Promoted.Version, prom)
	default:
		d.Action = Continue
		d.Reason = fmt.Sprintf("%s %.4g [%.4g, %.4g] does not clear the promoted release %d (%.4g)", pm, cur.Value, cur.Lo, cur.Hi, s.Promoted.Version, prom)
	}
	if d.Action == Promote {
		s.Promoted, s.EvalsWithoutGain = ev, 0
	} else if !s.Stopped {
		s.EvalsWithoutGain++
		if r, ok := p.rule(contract.StopNoValidationGain); ok {
			d.Checks = append(d.Checks, Check{Kind: CheckNoGain, Name: r.String(), Value: float64(s.EvalsWithoutGain),
				Lo: float64(s.EvalsWithoutGain), Hi: float64(s.EvalsWithoutGain), Bound: float64(r.N), OK: s.EvalsWithoutGain < r.N})
			if s.EvalsWithoutGain >= r.N {
				d.Reason = fmt.Sprintf("%s: %s; no promotion in %d evaluations", d.Action, d.Reason, s.EvalsWithoutGain)
				d.Action, d.StopRule = Stop, r.String()
				s.Stopped = true
			}
		}
	}
	d.Promoted = s.Promoted.Version
	return d, s, nil
}

// klRuleReached reports whether the KL rule's count is reached.
func klRuleReached(p Policy, s State) bool {
	r, ok := p.rule(contract.StopKLAboveLimit)
	return ok && s.KLAbove >= r.N
}

// Usage is what a run has spent, in the units of contract.Budgets.
type Usage = schemas.GateUsage

// CheckBudget returns a stop decision at release version when usage has
// reached any budget (a budget is a hard limit: the run stops whether or
// not budget_exhausted is declared), nil otherwise.
func CheckBudget(p Policy, s State, version int64, u Usage) (*Decision, State) {
	checks := BudgetChecks(p, u)
	var spent []string
	for _, c := range checks {
		if !c.OK {
			spent = append(spent, fmt.Sprintf("%s %.6g of %.6g", c.Name, c.Value, c.Bound))
		}
	}
	if len(spent) == 0 || s.Stopped {
		return nil, s
	}
	s.Stopped = true
	return &Decision{PolicyVersion: version, Action: Stop, StopRule: contract.StopBudgetExhausted, Promoted: s.Promoted.Version,
		Reason: fmt.Sprintf("budget spent: %v", spent), Checks: checks}, s
}

// BudgetChecks holds usage against every budget (OK: not yet reached).
func BudgetChecks(p Policy, u Usage) []Check {
	b := p.Budgets
	checks := []Check{
		{Kind: CheckBudgetSpent, Name: "rollout_tokens", Value: float64(u.RolloutTokens), Bound: float64(b.RolloutTokens)},
		{Kind: CheckBudgetSpent, Name: "optimizer_tokens", Value: float64(u.OptimizerTokens), Bound: float64(b.OptimizerTokens)},
		{Kind: CheckBudgetSpent, Name: "environment_hours", Value: u.EnvironmentHours, Bound: b.EnvironmentHours},
		{Kind: CheckBudgetSpent, Name: "accelerator_hours", Value: u.AcceleratorHours, Bound: b.AcceleratorHours},
	}
	for i := range checks {
		c := &checks[i]
		c.Lo, c.Hi = c.Value, c.Value
		c.OK = c.Value < c.Bound
	}
	return checks
}

// Judge rules on release version, as the gate does on every release: the
// KL rule first (Update, kl the release's KL to the reference), then the
// budgets (CheckBudget, usage what the run spent so far), then, when
// neither stopped the run, the evaluation evaluate returns (Decide); a
// release evaluate returns nil for (not an evaluation release) continues
// with its KL as evidence. evaluate is called only when the evaluation
// can decide. Every decision but a budget stop carries the budget checks.
func Judge(p Policy, s State, version int64, kl Estimate, usage Usage, open []Incident, evaluate func() (*Evaluation, error)) (Decision, State, error) {
	d, s := Update(p, s, version, kl.Value)
	if d == nil {
		d, s = CheckBudget(p, s, version, usage)
	}
	if d == nil {
		ev, err := evaluate()
		if err != nil {
			return Decision{}, s, err
		}
		if ev != nil {
			dd, st, err := Decide(p, s, *ev, open)
			if err != nil {
				return Decision{}, s, err
			}
			d, s = &dd, st
		}
	}
	if d == nil {
		d = &Decision{PolicyVersion: version, Action: Continue, Promoted: s.Promoted.Version,
			Reason: fmt.Sprintf("KL %.4g to the reference; not an evaluation release", kl.Value),
			Checks: []Check{{Kind: CheckKL, Name: contract.StopKLAboveLimit, Value: kl.Value, Lo: kl.Lo, Hi: kl.Hi,
				Bound: p.Objective.KLLimit, OK: p.Objective.KLLimit == 0 || kl.Value <= p.Objective.KLLimit}}}
	}
	if d.StopRule != contract.StopBudgetExhausted {
		d.Checks = append(d.Checks, BudgetChecks(p, usage)...)
	}
	return *d, s, nil
}

// CountCensus adds an attempt's census event to usage: a completed
// episode's stream tokens (prompts, actions, observations) and time, and
// the time of a try that failed for a reason of the infrastructure and
// was run again (it never completed: its time is in no completed event).
// It reports whether ev counted.
func CountCensus(u *Usage, ev schemas.CensusEvent) bool {
	switch {
	case ev.Kind == schemas.CensusCompleted:
		u.RolloutTokens += ev.Tokens
	case (ev.Kind == schemas.CensusFailed || ev.Kind == schemas.CensusTimedOut) && ev.Infra:
		if ev.LatencyUS <= 0 {
			return false
		}
	default:
		return false
	}
	u.EnvironmentHours += float64(ev.LatencyUS) / 3.6e9
	return true
}

// IncidentOf is the gate's view of an incident of the run: one about
// evaluation data (a hidden-eval task id on a training topic) or a
// declared safety incident is a safety incident.
func IncidentOf(inc schemas.Incident) Incident {
	safety := inc.Reason == "eval_task_id" || inc.Reason == "safety_incident"
	return Incident{ID: inc.IncidentID, Kind: inc.Reason, Safety: safety}
}
