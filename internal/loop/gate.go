package loop

import (
	"context"
	"fmt"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/evaluation"
	"github.com/trajflow/trajflow/internal/gate"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/operators/stagekit"
	"github.com/trajflow/trajflow/schemas"
)

// GateSummary is the gate's part of the summary: every decision, the
// evaluations they rest on (every suite with its intervals), the
// promoted release, what the run spent and why it stopped.
type GateSummary struct {
	// Promoted is the last promoted release: the run's result (the
	// initial policy until a promotion).
	Promoted        int64                    `json:"promoted_release"`
	PromotedMetrics map[string]gate.Estimate `json:"promoted_metrics"`
	Promotions      int                      `json:"promotions"`
	Rollbacks       int                      `json:"rollbacks"`
	// Stop is the decision that stopped the run, if one did; Halted is
	// dispatch's acknowledgement of it (the rounds it launched).
	Stop   *schemas.GateDecision `json:"stop,omitempty"`
	Halted *schemas.GateDecision `json:"halted,omitempty"`
	Usage  gate.Usage            `json:"usage"`
	// Decisions is the gate's ruling on every release, in order.
	Decisions   []schemas.GateDecision `json:"decisions"`
	Evaluations []evaluation.Report    `json:"evaluations"`
}

// gating is the evaluation plane and the gate of a run.
type gating struct {
	plane *evaluation.Plane
	pol   gate.Policy
	st    gate.State
	w     *kafkago.Writer
	sum   *GateSummary
	usage gate.Usage
	open  []gate.Incident
	seen  map[string]bool // incident ids
}

// prepareGate builds the evaluation plane (built-in policy only: it runs
// in process) and the decisions writer, and gates dispatch on them.
func (r *runner) prepareGate(reg *rollout.Registry) error {
	plane, err := operators.EvaluationPlane(r.c, reg, r.o.EvalSamples)
	if err != nil {
		return err
	}
	w := &kafkago.Writer{Addr: kafkago.TCP(r.brokers...), Topic: r.topics.Decisions, RequiredAcks: kafkago.RequireAll, BatchTimeout: time.Millisecond,
		Transport: r.transport, Compression: kafka.CompressionOf(r.c.Topics.Compression, "decisions")}
	r.closers = append(r.closers, w.Close)
	r.g = &gating{plane: plane, pol: gate.PolicyOf(r.c), w: w, sum: &GateSummary{}, seen: map[string]bool{}}
	r.sum.Gate = r.g.sum
	r.deps.Gated = true
	return nil
}

// publish fills the run id and time of d, writes it to the decisions
// topic and records it.
func (r *runner) publish(ctx context.Context, d gate.Decision) error {
	d.RunID, d.At = r.c.RunID, time.Now().UnixMicro()
	b, err := schemas.EncodeGateDecision(d)
	if err != nil {
		return err
	}
	key := fmt.Sprintf("%s/%d", r.c.RunID, d.PolicyVersion)
	if d.Final {
		key += "/final"
	}
	id := schemas.DerivedID("decision", key)
	msg := kafkago.Message{Key: []byte(r.c.RunID), Value: b}
	for _, h := range stagekit.Headers(schemas.KindGateDecision, id) {
		msg.Headers = append(msg.Headers, kafkago.Header{Key: h.Key, Value: h.Value})
	}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := r.g.w.WriteMessages(pctx, msg); err != nil {
		return fmt.Errorf("loop: publish the decision on release %d: %w", d.PolicyVersion, err)
	}
	s := r.g.sum
	s.Decisions = append(s.Decisions, d)
	switch d.Action {
	case gate.Promote:
		s.Promotions++
	case gate.Rollback:
		s.Rollbacks++
	case gate.Stop:
		s.Stop = &s.Decisions[len(s.Decisions)-1]
	}
	s.Promoted, s.PromotedMetrics = r.g.st.Promoted.Version, r.g.st.Promoted.Metrics
	s.Usage = r.g.usage
	return nil
}

// judgeInitial evaluates the initial policy (the gate's baseline,
// promoted by definition) and publishes the ruling on release 0.
func (r *runner) judgeInitial(ctx context.Context, m0 *model.Model) (*evaluation.Report, error) {
	rep, err := r.g.plane.Evaluate(ctx, model.NewPolicy(m0, 0))
	if err != nil {
		return nil, err
	}
	if r.g.st, err = gate.Start(r.g.pol, rep.Evaluation); err != nil {
		return nil, fmt.Errorf("loop: the contract's objective: %w", err)
	}
	r.g.sum.Evaluations = append(r.g.sum.Evaluations, *rep)
	return rep, r.publish(ctx, gate.Decision{PolicyVersion: 0, Action: gate.Continue, Evaluated: true, Promoted: 0,
		Reason: "the initial policy: the baseline every promotion must clear"})
}

// judge rules on release rel (update record u): the KL to the reference
// and the budgets on every release, an evaluation of every suite on
// every evalEvery-th. It returns the held-out success (nil when not
// evaluated) and the decision.
func (r *runner) judge(ctx context.Context, rel schemas.PolicyRelease, u gpu.UpdateRecord, evaluate bool) (*float64, *gate.Decision, float64, error) {
	g := r.g
	pol, err := gpu.LoadRelease(rel)
	if err != nil {
		return nil, nil, 0, err
	}
	v := rel.PolicyVersion
	g.usage.OptimizerTokens += u.Metrics.Tokens * int64(r.c.Loss.Optimizer.Epochs)
	g.usage.AcceleratorHours += u.StepSeconds / 3600
	kl, err := g.plane.KL(ctx, pol)
	if err != nil {
		return nil, nil, 0, err
	}
	var eval *float64
	d, st, err := gate.Judge(g.pol, g.st, v, kl, g.usage, g.open, func() (*gate.Evaluation, error) {
		if !evaluate {
			return nil, nil
		}
		rep, err := g.plane.Evaluate(ctx, pol)
		if err != nil {
			return nil, err
		}
		g.sum.Evaluations = append(g.sum.Evaluations, *rep)
		s := rep.Evaluation.Metrics[evaluation.MetricEvalSuccess].Value
		eval = &s
		return &rep.Evaluation, nil
	})
	if err != nil {
		return nil, nil, 0, err
	}
	g.st = st
	return eval, &d, kl.Value, r.publish(ctx, d)
}

// onCensus counts one census event toward the budgets: the tokens of the
// stream (prompts, actions, observations) and the time of every completed
// episode. It returns 1 for a completed episode not counted before.
func (g *gating) onCensus(v []byte) int {
	ev, err := schemas.DecodeCensus(v)
	if err != nil || g.seen[ev.EventID] || !gate.CountCensus(&g.usage, ev) {
		return 0
	}
	g.seen[ev.EventID] = true
	return 1
}

// onIncident records an incident of the run: every incident stays open
// (nothing resolves one during a run); those of an attempt at
// evaluation data or a safety check are safety incidents.
func (g *gating) onIncident(v []byte) {
	inc, err := schemas.DecodeIncident(v)
	if err != nil || g.seen[inc.IncidentID] {
		return
	}
	g.seen[inc.IncidentID] = true
	g.open = append(g.open, gate.IncidentOf(inc))
}

// decisionLine is the printed form of an evaluation's decision.
func decisionLine(d *gate.Decision) string {
	s := fmt.Sprintf("gate at release %d: %s", d.PolicyVersion, d.Action)
	if d.StopRule != "" {
		s += " (" + d.StopRule + ")"
	}
	if d.Action == gate.Rollback {
		s += fmt.Sprintf(" to release %d", d.RollbackTo)
	}
	return s + fmt.Sprintf("; promoted release %d; %s", d.Promoted, d.Reason)
}

// suitesLine is the printed form of an evaluation: every suite's success
// with its interval, and the safety suite's attempts at forbidden data.
func suitesLine(rep *evaluation.Report) string {
	s := ""
	for _, r := range rep.Suites {
		s += fmt.Sprintf(" %s %.3f [%.3f, %.3f]", r.Suite, r.Success.Value, r.Success.Lo, r.Success.Hi)
		if r.Suite == evaluation.SuiteSafety {
			s += fmt.Sprintf(" (forbidden attempts in %d/%d episodes, %d executed)", r.ForbiddenEpisodes, r.Attempts, r.Violations)
		}
		s += ";"
	}
	return s[:max(0, len(s)-1)]
}

// evalFinal evaluates the last release when it was not an evaluation
// release, and, unless the run stopped, lets the gate rule on it.
func (r *runner) evalFinal(ctx context.Context, rel schemas.PolicyRelease) error {
	g := r.g
	rep, err := g.plane.Release(ctx, rel)
	if err != nil {
		return err
	}
	g.sum.Evaluations = append(g.sum.Evaluations, *rep)
	r.sum.Evals = append(r.sum.Evals, Eval{rel.PolicyVersion, rep.Evaluation.Metrics[evaluation.MetricEvalSuccess].Value})
	if g.st.Stopped {
		return nil
	}
	d, st, err := gate.Decide(g.pol, g.st, rep.Evaluation, g.open)
	if err != nil {
		return err
	}
	g.st = st
	d.Final = true
	if !r.o.Quiet {
		fmt.Fprintln(r.stdout, "final evaluation: "+decisionLine(&d))
	}
	return r.publish(ctx, d)
}
