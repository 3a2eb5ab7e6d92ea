// Package gate is the gate operator (docs/PIPELINE.md §17): it applies the
// learning contract's objective, stop rules and budgets to every
// evaluation record of the evaluations topic, in release order, and puts
// its decision — promote, continue, rollback or stop, with its evidence —
// on the decisions topic, where dispatch (a round at a release waits for
// the ruling on it; a stop halts it) and the trainer (a rollback
// republishes the promoted release's parameters) act on it. The rules are
// internal/gate's, the same functions `trajflow demo` rules with.
//
// Budgets count the census (rollout tokens and environment time of every
// completed episode, and the time of every try that failed for a reason of
// the infrastructure: gate.CountCensus) and the evaluation records (optimizer tokens and
// step time of every update). Open incidents are followed from the
// incidents topic as a side input.
//
// State: every decision carries the gate's state after it (Resume); a
// restarted gate reads the decisions topic back, resumes from its last
// decision and skips the evaluations it already ruled on. A census event
// that counted toward the budgets is held (its offset not committed) until
// the next decision, which carries the count, is written: after a crash
// the events not yet in a decision are redelivered and counted again.
package gate

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/trajflow/trajflow/internal/gate"
	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// StageConfig configures the gate operator.
type StageConfig struct {
	Policy gate.Policy
	Topics pipeline.Topics
	RunID  string
	// RebuildScan is how many records of the decisions topic are read
	// back at start (default 1000).
	RebuildScan int64
}

// Stage is the gate operator.
type Stage struct {
	cfg StageConfig

	st      gate.State
	usage   gate.Usage
	started bool  // release 0 ruled on
	last    int64 // newest version ruled on (-1: none)
	final   bool  // the ruling on last was a final evaluation's
	counted map[string]bool
	held    []pipeline.Ref // census events counted since the last decision

	mu   sync.Mutex // guards open and seen (Side runs concurrently)
	open []gate.Incident
	seen map[string]bool
}

// NewStage validates cfg and returns the stage.
func NewStage(cfg StageConfig) (*Stage, error) {
	if cfg.RunID == "" {
		return nil, errors.New("gate: no run id")
	}
	if len(cfg.Policy.StopRules) == 0 {
		return nil, errors.New("gate: the contract declares no stop rule")
	}
	if cfg.RebuildScan <= 0 {
		cfg.RebuildScan = 1000
	}
	return &Stage{cfg: cfg, last: -1, counted: map[string]bool{}, seen: map[string]bool{}}, nil
}

// Name implements pipeline.Stage.
func (*Stage) Name() string { return "gate" }

// Topics implements pipeline.Stage: the evaluations and census topics.
func (s *Stage) Topics() []string { return s.cfg.Topics.Names(pipeline.InputsOf(s.Name())) }

// SideTopics implements pipeline.SideInputs: the incidents topic.
func (s *Stage) SideTopics() []string { return s.cfg.Topics.Names(pipeline.SideInputsOf(s.Name())) }

// Start resumes from the last decision of this gate on the decisions
// topic (dispatch's halted records carry no state).
func (s *Stage) Start(ctx context.Context, env *pipeline.Env) error {
	var last *schemas.GateDecision
	err := env.Scan(ctx, s.cfg.Topics.Decisions, s.cfg.RebuildScan, func(m pipeline.Message) error {
		d, err := schemas.DecodeGateDecision(m.Value)
		if err != nil || d.Resume == nil || d.RunID != s.cfg.RunID {
			return nil // not a decision of this gate: nothing to resume from
		}
		if last == nil || d.PolicyVersion > last.PolicyVersion || (d.PolicyVersion == last.PolicyVersion && d.Final) {
			last = &d
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("gate: read back %s: %w", s.cfg.Topics.Decisions, err)
	}
	if last != nil {
		s.st, s.usage, s.started, s.last, s.final = last.Resume.State, last.Resume.Usage, true, last.PolicyVersion, last.Final
		env.Logger.Info("gate resumed from its last decision", "version", last.PolicyVersion, "action", last.Action,
			"promoted", last.Promoted, "stopped", s.st.Stopped)
	}
	return nil
}

// Side implements pipeline.SideInputs: every incident of the run stays
// open (nothing resolves one during a run).
func (s *Stage) Side(_ context.Context, m pipeline.Message) error {
	inc, err := schemas.DecodeIncident(m.Value)
	if err != nil {
		return nil // not an incident: nothing to hold open
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.seen[inc.IncidentID] {
		s.seen[inc.IncidentID] = true
		s.open = append(s.open, gate.IncidentOf(inc))
	}
	return nil
}

// Process implements pipeline.Stage.
func (s *Stage) Process(_ context.Context, m pipeline.Message) (pipeline.Result, error) {
	if m.Topic == s.cfg.Topics.Census {
		return s.census(m)
	}
	rec, err := schemas.DecodeEvaluation(m.Value)
	if err != nil {
		return pipeline.Result{}, stagekit.DecodeRefusal(err)
	}
	if err := stagekit.CheckKindHeaders(&m, schemas.KindEvaluation); err != nil {
		return pipeline.Result{}, err
	}
	if rec.RunID != s.cfg.RunID {
		return pipeline.Result{}, pipeline.Refuse("run_mismatch", "evaluation of run %q on run %q's topic", rec.RunID, s.cfg.RunID)
	}
	v := rec.PolicyVersion
	final := rec.Final && v == s.last && !s.final // the final evaluation of the release last ruled on
	if (v <= s.last && !final) || s.st.Stopped {
		return pipeline.Result{}, nil // ruled on already, or the run stopped
	}
	var d gate.Decision
	if final {
		d, err = s.ruleFinal(rec)
	} else {
		d, err = s.rule(rec)
	}
	if err != nil {
		return pipeline.Result{}, err
	}
	s.last, s.final = v, final
	d.Final = final
	d.RunID, d.At = s.cfg.RunID, rec.At
	d.Resume = &schemas.GateResume{State: s.st, Usage: s.usage}
	b, err := schemas.EncodeGateDecision(d)
	if err != nil {
		return pipeline.Result{}, err
	}
	id := fmt.Sprintf("%s/gate/%d", s.cfg.RunID, v)
	if final {
		id += "/final"
	}
	res := pipeline.Result{Outputs: []pipeline.Output{{Topic: s.cfg.Topics.Decisions, Key: []byte(s.cfg.RunID), Value: b,
		Headers: stagekit.Headers(schemas.KindGateDecision, id)}}, Release: s.held}
	s.held = nil
	return res, nil
}

// rule is the decision on rec: release 0 is the baseline every promotion
// must clear; every later release is judged (gate.Judge).
func (s *Stage) rule(rec schemas.EvaluationRecord) (gate.Decision, error) {
	v := rec.PolicyVersion
	if !s.started {
		if v != 0 || rec.Evaluation == nil {
			return gate.Decision{}, fmt.Errorf("gate: first evaluation is of release %d (evaluated %v): want the evaluation of release 0, the baseline",
				v, rec.Evaluation != nil)
		}
		st, err := gate.Start(s.cfg.Policy, *rec.Evaluation)
		if err != nil {
			return gate.Decision{}, fmt.Errorf("gate: the contract's objective: %w", err)
		}
		s.st, s.started = st, true
		return gate.Decision{PolicyVersion: 0, Action: gate.Continue, Evaluated: true, Promoted: 0,
			Reason: "the initial policy: the baseline every promotion must clear"}, nil
	}
	s.usage.OptimizerTokens += rec.OptimizerTokens
	s.usage.AcceleratorHours += rec.StepSeconds / 3600
	s.mu.Lock()
	open := append([]gate.Incident(nil), s.open...)
	s.mu.Unlock()
	d, st, err := gate.Judge(s.cfg.Policy, s.st, v, rec.KL, s.usage, open, func() (*gate.Evaluation, error) {
		if rec.RolledBackTo != nil {
			return nil, nil // the promoted parameters again
		}
		return rec.Evaluation, nil
	})
	if err != nil {
		return gate.Decision{}, err
	}
	s.st = st
	return d, nil
}

// ruleFinal is the ruling on the final evaluation of the release last
// ruled on (by its KL and budgets): the evaluation alone, as the demo
// rules on its final evaluation (gate.Decide).
func (s *Stage) ruleFinal(rec schemas.EvaluationRecord) (gate.Decision, error) {
	if rec.Evaluation == nil {
		return gate.Decision{}, pipeline.Refuse("final_without_suites", "the final evaluation of release %d has no suites", rec.PolicyVersion)
	}
	s.mu.Lock()
	open := append([]gate.Incident(nil), s.open...)
	s.mu.Unlock()
	d, st, err := gate.Decide(s.cfg.Policy, s.st, *rec.Evaluation, open)
	if err != nil {
		return gate.Decision{}, err
	}
	s.st = st
	return d, nil
}

// census counts a completed episode or a failed try toward the budgets
// and holds it until the next decision carries the count.
func (s *Stage) census(m pipeline.Message) (pipeline.Result, error) {
	ev, err := stagekit.CensusOf(&m)
	if err != nil {
		return pipeline.Result{}, err
	}
	// After a stop no decision follows: nothing is held for one.
	if s.st.Stopped || ev.RunID != s.cfg.RunID || s.counted[ev.EventID] || !gate.CountCensus(&s.usage, ev) {
		return pipeline.Result{}, nil
	}
	s.counted[ev.EventID] = true
	s.held = append(s.held, m.Ref)
	return pipeline.Result{Hold: true}, nil
}
