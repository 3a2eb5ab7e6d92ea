package schemas

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
)

// This file holds the control-plane documents besides releases and census
// events: pack's window records, incidents and the trainer's update
// records. Each is a JSON document {"kind","version","data"} (jsondoc.go).

// WindowDecision is a record a pack window filtered, with the reason.
type WindowDecision struct {
	RecordID string `json:"record_id"`
	GroupID  string `json:"group_id"`
	Filter   string `json:"filter"`
	// StaleTokens are the stale tokens of a record filtered as stale (the
	// stale_tokens of its census event; 0 for every other filter).
	StaleTokens int64 `json:"stale_tokens,omitempty"`
}

// WindowRecord is the lineage of one closed pack window, on the windows
// topic: what was admitted (in batch order), what was filtered and why,
// and the trainer version the lag rule used. Replay reproduces a batch
// from its admitted ids and trainer version; dispatch learns from Groups
// which groups of a round were decided.
type WindowRecord struct {
	BatchID        string   `json:"batch_id"` // "" when every record was filtered (no batch)
	BatchIndex     int64    `json:"batch_index"`
	RunID          string   `json:"run_id"`
	ContractHash   string   `json:"contract_hash"`
	TrainerVersion int64    `json:"trainer_version"`
	ClosedBy       string   `json:"closed_by"` // "full", "timeout", "flush"
	Admitted       []string `json:"admitted"`
	// AdmittedTokens and AdmittedStaleTokens are, in Admitted's order,
	// the tokens and stale tokens of each admitted record's census event.
	// With the filtered records' decisions they are every census event
	// of the window, which a pack restarted before all of them were
	// acknowledged writes again (same event ids) when the window's inputs
	// are redelivered. Absent in records written before they existed.
	AdmittedTokens      []int64          `json:"admitted_tokens,omitempty"`
	AdmittedStaleTokens []int64          `json:"admitted_stale_tokens,omitempty"`
	Filtered            []WindowDecision `json:"filtered"`
	Tokens              int64            `json:"tokens"`
	TrainedTokens       int64            `json:"trained_tokens"`
	Rows                int              `json:"rows"`
	Efficiency          float64          `json:"efficiency"`
	// Groups are the groups with a member decided in the window (admitted
	// or filtered when added), sorted: the dispatcher knows a round is
	// complete when every group of it appears in some window record.
	Groups []string `json:"groups"`
	// Records is the number of records decided in the window (admitted or
	// filtered when added); RewardMean their mean RewardTotal and
	// SuccessRate the fraction with RewardTotal > 0.
	Records     int     `json:"records"`
	RewardMean  float64 `json:"reward_mean"`
	SuccessRate float64 `json:"success_rate"`
	// MaxLag is the largest policy lag (TrainerVersion minus the oldest
	// behavior version of a segment) among the admitted segments.
	MaxLag int64 `json:"max_lag"`
	// MinLag is TrainerVersion minus the newest behavior version that keeps
	// a trained token of the batch under the stale policy
	// (operators/pack.NewestKept): the trainer's lag rule refuses the batch
	// whole at trainer version v exactly when v - (TrainerVersion - MinLag)
	// > max_lag, which dispatch needs to know to stop counting it in
	// flight. Absent (0) in records written before it existed, which is
	// the bound those records implied.
	MinLag int64 `json:"min_lag,omitempty"`
	// Cost is what the window's decided episodes cost to generate:
	// those admitted and those filtered (docs/SYSTEMS.md §17).
	Cost *WindowCost `json:"cost,omitempty"`
	// FailedEvents are the census events whose failed generation Cost
	// counts (Cost.Failed), by event id: a restarted pack counts none of
	// them again.
	FailedEvents []string `json:"failed_events,omitempty"`
}

// EpisodeCost is what a set of episodes cost to generate, in the units of
// the contract's budgets (docs/SYSTEMS.md §17): RolloutTokens counts every
// token of their streams (prompts, actions, observations), as
// budgets.rollout_tokens does; GenerationHours and EnvironmentHours add up
// their turns' generation and environment latencies (rollout inference
// and environment time, kept apart).
type EpisodeCost struct {
	Episodes         int     `json:"episodes"`
	RolloutTokens    int64   `json:"rollout_tokens"`
	GenerationHours  float64 `json:"generation_hours"`
	EnvironmentHours float64 `json:"environment_hours"`
}

// microsPerHour converts latencies in microseconds to hours.
const microsPerHour = 3.6e9

// TurnsUsage is what an episode's turns used: the tokens of their
// streams (prompts, actions, observations: the unit of
// budgets.rollout_tokens) and their generation and environment time in
// microseconds (a negative latency counts as none).
func TurnsUsage(turns []Turn) (tokens, genUS, envUS int64) {
	for i := range turns {
		t := &turns[i]
		tokens += int64(len(t.PromptIDs) + len(t.ActionIDs) + len(t.ObservationIDs))
		genUS += max(t.GenLatencyUS, 0)
		envUS += max(t.EnvLatencyUS, 0)
	}
	return tokens, genUS, envUS
}

// EpisodeCostOf is the cost of one episode from its turns.
func EpisodeCostOf(turns []Turn) EpisodeCost {
	tokens, gen, env := TurnsUsage(turns)
	return EpisodeCost{Episodes: 1, RolloutTokens: tokens,
		GenerationHours: float64(gen) / microsPerHour, EnvironmentHours: float64(env) / microsPerHour}
}

// Add adds o to c.
func (c *EpisodeCost) Add(o EpisodeCost) {
	c.Episodes += o.Episodes
	c.RolloutTokens += o.RolloutTokens
	c.GenerationHours += o.GenerationHours
	c.EnvironmentHours += o.EnvironmentHours
}

// WindowCost is the cost of the generation pack accounted in its windows:
// the episodes decided in the window, admitted to the batch or filtered
// (rejected generation), and the failed generation the census reported
// while the window was open (Failed, see FailureCost). On a packed
// batch's HeaderWindowCost it covers every window of the batch's index:
// the window that closed the batch and the windows before it that
// filtered every record and so packed no batch; Windows counts them.
type WindowCost struct {
	Windows  int         `json:"windows,omitempty"`
	Admitted EpisodeCost `json:"admitted"`
	Filtered EpisodeCost `json:"filtered"`
	Failed   EpisodeCost `json:"failed"`
}

// Add adds o to c.
func (c *WindowCost) Add(o WindowCost) {
	c.Windows += o.Windows
	c.Admitted.Add(o.Admitted)
	c.Filtered.Add(o.Filtered)
	c.Failed.Add(o.Failed)
}

// Refused is the cost of a batch the trainer refused whole (no token
// within the lag bound, or the optimizer could not take it): what it
// admitted joins its failed generation, what it filtered stays rejected.
func (c WindowCost) Refused() WindowCost {
	r := WindowCost{Windows: c.Windows, Filtered: c.Filtered, Failed: c.Failed}
	r.Failed.Add(c.Admitted)
	return r
}

// FailureCost is the cost a census event reports as failed generation
// (docs/SYSTEMS.md §17), and false for any other event: an attempt
// refused for good after it ran (quarantined by rollout, validate,
// reward, advantage or pack) is one episode with the rollout tokens and
// time its event carries; a try that failed for a reason of the
// infrastructure and was run again (failed or timed_out, infra) costs its
// time. Times go to EnvironmentHours: the census measures an attempt's
// time as a whole, the unit of budgets.environment_hours.
func FailureCost(ev CensusEvent) (EpisodeCost, bool) {
	c := EpisodeCost{RolloutTokens: max(ev.Tokens, 0), EnvironmentHours: float64(max(ev.LatencyUS, 0)) / microsPerHour}
	switch ev.Kind {
	case CensusQuarantined:
		switch ev.Stage {
		case "rollout", "validate", "reward", "advantage", "pack":
			c.Episodes = 1
			return c, true
		}
	case CensusFailed, CensusTimedOut:
		if ev.Infra {
			return c, true
		}
	}
	return EpisodeCost{}, false
}

// EncodeWindowCost is the value of HeaderWindowCost.
func EncodeWindowCost(c WindowCost) ([]byte, error) {
	b, err := json.Marshal(c)
	if err != nil {
		return nil, fmt.Errorf("schemas: window cost: %w", err)
	}
	return b, nil
}

// DecodeWindowCost reads a HeaderWindowCost value: one JSON object with
// no unknown field, non-negative counts and finite, non-negative hours.
// Errors wrap ErrDecode and name the header and the field.
func DecodeWindowCost(b []byte) (WindowCost, error) {
	fail := func(format string, a ...any) (WindowCost, error) {
		return WindowCost{}, fmt.Errorf("%w: header %s: %s", ErrDecode, HeaderWindowCost, fmt.Sprintf(format, a...))
	}
	var c WindowCost
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return fail("%v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return fail("data after the object")
	}
	if c.Windows < 0 {
		return fail("windows %d < 0", c.Windows)
	}
	if err := c.Admitted.check(); err != nil {
		return fail("admitted.%v", err)
	}
	if err := c.Filtered.check(); err != nil {
		return fail("filtered.%v", err)
	}
	if err := c.Failed.check(); err != nil {
		return fail("failed.%v", err)
	}
	return c, nil
}

func (c EpisodeCost) check() error {
	switch {
	case c.Episodes < 0:
		return fmt.Errorf("episodes %d < 0", c.Episodes)
	case c.RolloutTokens < 0:
		return fmt.Errorf("rollout_tokens %d < 0", c.RolloutTokens)
	case !(c.GenerationHours >= 0) || math.IsInf(c.GenerationHours, 0):
		return fmt.Errorf("generation_hours %v not a finite non-negative number", c.GenerationHours)
	case !(c.EnvironmentHours >= 0) || math.IsInf(c.EnvironmentHours, 0):
		return fmt.Errorf("environment_hours %v not a finite non-negative number", c.EnvironmentHours)
	}
	return nil
}

// UpdateCost is the cost ledger of one update (docs/SYSTEMS.md §17), in
// the units of the contract's budgets: Rollout is the generation of the
// episodes admitted to the batch (those the lag rule then excluded at the
// update included: StaleTokens says how many of their tokens), Rejected
// the generation pack filtered in the batch's windows (zero variance,
// stale, over length, ...), Failed the generation that failed before it
// could be decided (refused by a stage or lost to the infrastructure, as
// the census reports it: WindowCost.Failed) and the batches the trainer
// refused whole since its previous update (WindowCost.Refused), Training
// the optimizer's work. Windows is
// the number of pack windows the batch's cost header covered; a batch
// without that header (written by an older pack, or by hand) has Windows
// 0 and no rollout, rejected or failed cost of its own.
type UpdateCost struct {
	Windows  int          `json:"windows"`
	Rollout  EpisodeCost  `json:"rollout"`
	Rejected EpisodeCost  `json:"rejected"`
	Failed   EpisodeCost  `json:"failed"`
	Training TrainingCost `json:"training"`
}

// Add adds o to c (a run's ledger is the sum of its updates').
func (c *UpdateCost) Add(o UpdateCost) {
	c.Windows += o.Windows
	c.Rollout.Add(o.Rollout)
	c.Rejected.Add(o.Rejected)
	c.Failed.Add(o.Failed)
	c.Training.OptimizerTokens += o.Training.OptimizerTokens
	c.Training.AcceleratorHours += o.Training.AcceleratorHours
}

// TrainingCost is an update's optimizer work: OptimizerTokens the trained
// tokens times the optimizer passes over them (budgets.optimizer_tokens),
// AcceleratorHours the update's step time (budgets.accelerator_hours).
type TrainingCost struct {
	OptimizerTokens  int64   `json:"optimizer_tokens"`
	AcceleratorHours float64 `json:"accelerator_hours"`
}

// UpdateCostOf is the ledger of an update from its batch's cost header
// (nil when the batch had none) and its training work.
func UpdateCostOf(w *WindowCost, t TrainingCost) UpdateCost {
	u := UpdateCost{Training: t}
	if w != nil {
		u.Windows, u.Rollout, u.Rejected, u.Failed = w.Windows, w.Admitted, w.Filtered, w.Failed
	}
	return u
}

// EncodeWindow returns the JSON document of a window record.
func EncodeWindow(w WindowRecord) ([]byte, error) { return encodeDoc(KindWindowRecord, &w) }

// DecodeWindow reads a document written by EncodeWindow.
func DecodeWindow(b []byte) (WindowRecord, error) {
	w, err := decodeDoc[WindowRecord](KindWindowRecord, b)
	if err != nil {
		return w, err
	}
	for _, f := range []struct {
		name string
		n    int
	}{{"admitted_tokens", len(w.AdmittedTokens)}, {"admitted_stale_tokens", len(w.AdmittedStaleTokens)}} {
		if f.n != 0 && f.n != len(w.Admitted) {
			return WindowRecord{}, fmt.Errorf("%w: %s: %s has %d entries for %d admitted records", ErrDecode, KindWindowRecord, f.name, f.n, len(w.Admitted))
		}
	}
	return w, nil
}

// Incident is a safety or integrity incident (docs/PIPELINE.md §8, §9: "trigger an
// incident path"), on the incidents topic.
type Incident struct {
	IncidentID string `json:"incident_id"`
	RunID      string `json:"run_id"`
	AttemptID  string `json:"attempt_id"`
	TaskID     string `json:"task_id"`
	Stage      string `json:"stage"`
	Reason     string `json:"reason"`
	Detail     string `json:"detail"`
	Source     string `json:"source"` // topic/partition@offset of the offending record
	At         int64  `json:"at_us"`
}

// EncodeIncident returns the JSON document of an incident.
func EncodeIncident(i Incident) ([]byte, error) { return encodeDoc(KindIncident, &i) }

// DecodeIncident reads a document written by EncodeIncident.
func DecodeIncident(b []byte) (Incident, error) { return decodeDoc[Incident](KindIncident, b) }

// ObjectiveStats are the statistics of the policy objective over a batch
// (docs/PIPELINE.md §13): gpu/objective computes them (objective.Stats has this
// layout).
type ObjectiveStats struct {
	// Loss = PolicyLoss + KLCoef*KL (only when KL is placed in the loss)
	//        - EntropyCoef*Entropy.
	Loss float64 `json:"loss"`
	// PolicyLoss = -Σ_t c_t · min(r_t A_t, clip(r_t) A_t) over masked t,
	// where c_t is the normalization weight of token t.
	PolicyLoss float64 `json:"policy_loss"`
	// KL = Σ_t c_t k(ref_t - cur_t) with the declared estimator; 0 without
	// reference log-probs.
	KL float64 `json:"kl"`
	// Entropy = Σ_t c_t H_t of the current policy at masked positions
	// (nats).
	Entropy float64 `json:"entropy"`
	// Tokens and Sequences are the masked tokens, and the sequences with at
	// least one.
	Tokens    int64 `json:"tokens"`
	Sequences int64 `json:"sequences"`
	// ApproxKLOld = 0.5 · mean over masked tokens of (cur - old)^2.
	ApproxKLOld float64 `json:"approx_kl_old"`
	// Ratio statistics of r = exp(clamped cur - old) over masked tokens.
	RatioMean float64 `json:"ratio_mean"`
	RatioMin  float64 `json:"ratio_min"`
	RatioMax  float64 `json:"ratio_max"`
	// LogRatioClamped counts masked tokens whose log ratio was clamped.
	LogRatioClamped int64 `json:"log_ratio_clamped"`
	// Clip counts and fractions by advantage sign (docs/PIPELINE.md §13).
	PosTokens   int64   `json:"pos_tokens"`
	NegTokens   int64   `json:"neg_tokens"`
	ClippedPos  int64   `json:"clipped_pos"`
	ClippedNeg  int64   `json:"clipped_neg"`
	ClipFracPos float64 `json:"clip_frac_pos"`
	ClipFracNeg float64 `json:"clip_frac_neg"`
	// Off-policy corrections (loss.off_policy): the mean and largest
	// importance weight to the behavior policy over masked tokens (tis:
	// min(π/μ, is_cap); decoupled: π_prox/μ, capped), and how many
	// tokens the cap truncated. 0 without a correction.
	ISWeightMean float64 `json:"is_weight_mean,omitempty"`
	ISWeightMax  float64 `json:"is_weight_max,omitempty"`
	ISTruncated  int64   `json:"is_truncated,omitempty"`
}

// Merge returns the Stats of two disjoint calls sharing one set of
// Denominators: normalized terms and counts add, means are re-weighted by
// Tokens, min/max combine, and clip fractions are recomputed from counts.
func (s ObjectiveStats) Merge(o ObjectiveStats) ObjectiveStats {
	m := ObjectiveStats{
		Loss:            s.Loss + o.Loss,
		PolicyLoss:      s.PolicyLoss + o.PolicyLoss,
		KL:              s.KL + o.KL,
		Entropy:         s.Entropy + o.Entropy,
		Tokens:          s.Tokens + o.Tokens,
		Sequences:       s.Sequences + o.Sequences,
		LogRatioClamped: s.LogRatioClamped + o.LogRatioClamped,
		PosTokens:       s.PosTokens + o.PosTokens,
		NegTokens:       s.NegTokens + o.NegTokens,
		ClippedPos:      s.ClippedPos + o.ClippedPos,
		ClippedNeg:      s.ClippedNeg + o.ClippedNeg,
		ISTruncated:     s.ISTruncated + o.ISTruncated,
		ISWeightMax:     math.Max(s.ISWeightMax, o.ISWeightMax),
	}
	switch {
	case s.Tokens == 0:
		m.ApproxKLOld, m.RatioMean, m.RatioMin, m.RatioMax = o.ApproxKLOld, o.RatioMean, o.RatioMin, o.RatioMax
		m.ISWeightMean = o.ISWeightMean
	case o.Tokens == 0:
		m.ApproxKLOld, m.RatioMean, m.RatioMin, m.RatioMax = s.ApproxKLOld, s.RatioMean, s.RatioMin, s.RatioMax
		m.ISWeightMean = s.ISWeightMean
	default:
		ns, no, n := float64(s.Tokens), float64(o.Tokens), float64(m.Tokens)
		m.ApproxKLOld = (s.ApproxKLOld*ns + o.ApproxKLOld*no) / n
		m.ISWeightMean = (s.ISWeightMean*ns + o.ISWeightMean*no) / n
		m.RatioMean = (s.RatioMean*ns + o.RatioMean*no) / n
		m.RatioMin = math.Min(s.RatioMin, o.RatioMin)
		m.RatioMax = math.Max(s.RatioMax, o.RatioMax)
	}
	m.ClipFracPos = fracOf(m.ClippedPos, m.PosTokens)
	m.ClipFracNeg = fracOf(m.ClippedNeg, m.NegTokens)
	return m
}

func fracOf(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// LagStat is the ratio and KL to the behavior policy of the masked tokens
// at one policy lag (docs/PIPELINE.md §18 gate E, "lag-stratified ratio/KL").
type LagStat struct {
	Lag       int64   `json:"lag"`    // trainer version - behavior version, >= 0
	Tokens    int64   `json:"tokens"` // masked tokens at this lag
	RatioMean float64 `json:"ratio_mean"`
	RatioMin  float64 `json:"ratio_min"`
	RatioMax  float64 `json:"ratio_max"`
	// ApproxKL = 0.5 · mean (cur - old)^2 (the k2 estimator).
	ApproxKL float64 `json:"approx_kl"`
	// K3 = mean (r - 1 - log r), an unbiased, non-negative estimate of
	// KL(behavior || current) on tokens sampled from the behavior policy.
	K3 float64 `json:"k3"`
}

// UpdateMetrics are the metrics of one update (docs/PIPELINE.md §13, §14, §20).
type UpdateMetrics struct {
	// ObjectiveStats over the whole batch.
	ObjectiveStats
	// Lag stratifies ratio and KL by policy lag (trainer version before the
	// update minus behavior version).
	Lag []LagStat `json:"lag"`
	// GradNorm is the global L2 norm of the gradient before clipping;
	// GradScale the factor clipping applied (1 when not clipped).
	GradNorm  float64 `json:"grad_norm"`
	GradScale float64 `json:"grad_scale"`
	// Rows, Segments and InputTokens describe the batch.
	Rows        int   `json:"rows"`
	Segments    int   `json:"segments"`
	InputTokens int64 `json:"input_tokens"`
	// FromVersion is the policy version the gradient was computed at;
	// Version the version the update produced (FromVersion + 1).
	FromVersion int64 `json:"from_version"`
	Version     int64 `json:"version"`
}

// UpdateRecord is written beside every release v >= 1: which batch
// produced it and the update's metrics. It is the trainer's own record of
// progress (the last batch index trained is restored from it) and what
// `trajflow demo` prints.
type UpdateRecord struct {
	Version    int64  `json:"version"`
	BatchID    string `json:"batch_id"`
	BatchIndex int64  `json:"batch_index"`
	// Metrics are those of the first optimizer step of the update, taken
	// at the policy the batch was packed for: the ratio and KL to the
	// behavior policy, stratified by lag. Before the first update of an
	// on-policy run the ratio is exactly 1.
	Metrics UpdateMetrics `json:"metrics"`
	// Last are the objective statistics of the update's last step.
	Last ObjectiveStats `json:"last"`
	// Duplicates counts segments of the batch masked out because their
	// trajectory was already trained.
	Duplicates int `json:"duplicates"`
	// The lag rule at the optimizer step (docs/PIPELINE.md §15): MaxLag and
	// StalePolicy are the contract's packing.max_lag and
	// packing.stale_policy; StaleTokens counts the trained tokens of the
	// batch the rule excluded (their lag, the trainer's version at the
	// update minus the token's behavior version, exceeded MaxLag: masked
	// out, never trained), StaleSegments the segments it left with no
	// trained token (their trajectories, NotTrained, have a census event
	// "filtered" with reason ReasonStaleAtUpdate), StaleLag the excluded
	// tokens by lag and Lag the trained tokens by lag.
	MaxLag        int64      `json:"max_lag"`
	StalePolicy   string     `json:"stale_policy,omitempty"`
	StaleTokens   int64      `json:"stale_tokens"`
	StaleSegments int        `json:"stale_segments"`
	NotTrained    []string   `json:"not_trained,omitempty"`
	StaleLag      []LagCount `json:"stale_lag,omitempty"`
	Lag           []LagCount `json:"lag_tokens,omitempty"`
	// Selection is what the lag rule left of the batch, so that a bias
	// toward short or fresh trajectories shows at every update (systems
	// §6); launched against trained by task, reward and latency is the
	// census's (`trajflow census`). Absent from a trainer that does not
	// write it.
	Selection   *UpdateSelection `json:"selection,omitempty"`
	StepSeconds float64          `json:"step_seconds"`
	// MinibatchOrder is, with loss.optimizer.minibatches > 1, the row
	// indexes of every minibatch of every epoch in the order they were
	// stepped (seeded: gpu.MinibatchOrder); absent with one minibatch.
	MinibatchOrder [][][]int `json:"minibatch_order,omitempty"`
	// RolledBackTo is set on a release that trained nothing: the gate
	// rolled the run back, and this version holds release RolledBackTo's
	// parameters and optimizer state (BatchID is empty). The releases in
	// between stay in the store: the failed branch is kept.
	RolledBackTo *int64 `json:"rolled_back_to,omitempty"`
	// Cost is the update's cost ledger; absent from a trainer that does
	// not write it.
	Cost *UpdateCost `json:"cost,omitempty"`
	// Trainer holds what a trainer records beyond these fields (an
	// external trainer's own details, e.g. the Python trainer's); absent for
	// the built-in one.
	Trainer json.RawMessage `json:"trainer,omitempty"`
}

// UpdateSelection is the selection account of one update: the segments
// (trajectories) of the batch that had a trained token before the lag
// rule, and those left with one after it.
type UpdateSelection struct {
	Segments        int `json:"segments"`
	TrainedSegments int `json:"trained_segments"`
	// Groups and TrainedGroups count the distinct groups of those
	// segments.
	Groups        int `json:"groups"`
	TrainedGroups int `json:"trained_groups"`
	// LengthMean and LengthMeanTrained are the mean segment length in
	// tokens (context and actions) of both.
	LengthMean        float64 `json:"length_mean"`
	LengthMeanTrained float64 `json:"length_mean_trained"`
	// StaleShare is the share of the batch's trained tokens the rule
	// excluded (StaleTokens over the trained tokens before the rule).
	StaleShare float64 `json:"stale_share"`
}

// LagCount is a number of tokens at one policy lag.
type LagCount struct {
	Lag    int64 `json:"lag"`
	Tokens int64 `json:"tokens"`
}

// ReasonStaleAtUpdate is the census reason (kind CensusFiltered, stage
// "train") of a trajectory admitted to a batch whose every trained token
// the lag rule excluded at the optimizer step.
const ReasonStaleAtUpdate = "stale_at_update"

// EncodeUpdate returns the JSON document of an update record.
func EncodeUpdate(u UpdateRecord) ([]byte, error) { return encodeDoc(KindUpdateRecord, &u) }

// DecodeUpdate reads a document written by EncodeUpdate.
func DecodeUpdate(b []byte) (UpdateRecord, error) {
	return decodeDoc[UpdateRecord](KindUpdateRecord, b)
}

// WeightAck is a policy server replica's acknowledgement of a release
// (docs/SYSTEMS.md §8 "have replicas confirm the version they serve"), on the
// weights topic: weight sync loaded the release into the replica with its
// protocol's calls and verified what the replica reports. A failed load is
// acknowledged too (Loaded false, Error set): the replica keeps serving
// what it served, and weight sync tries again.
type WeightAck struct {
	RunID    string `json:"run_id"`
	Replica  string `json:"replica"`  // the replica's name (its base URL)
	Protocol string `json:"protocol"` // llamacpp, sglang or vllm
	// Version is the policy version the replica serves after the load
	// (the release's when Loaded).
	Version int64 `json:"version"`
	Loaded  bool  `json:"loaded"`
	// Model is the model name or path the replica reports; Checksum what it
	// reports of its weights (the release's checkpoint hash, "" when the
	// protocol offers none).
	Model    string  `json:"model"`
	Checksum string  `json:"checksum"`
	Unloaded []int64 `json:"unloaded,omitempty"` // versions a llama.cpp router unloaded
	Error    string  `json:"error,omitempty"`
	At       int64   `json:"at_us"`
}

// EncodeWeightAck returns the JSON document of an acknowledgement.
func EncodeWeightAck(a WeightAck) ([]byte, error) { return encodeDoc(KindWeightAck, &a) }

// DecodeWeightAck reads a document written by EncodeWeightAck.
func DecodeWeightAck(b []byte) (WeightAck, error) { return decodeDoc[WeightAck](KindWeightAck, b) }
