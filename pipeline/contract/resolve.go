package contract

import (
	"fmt"
	"math"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/operators/pack"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Resolve fills the documented defaults and validates the contract,
// returning every problem together (errors.Join of *FieldError, each
// wrapping ErrInvalid and naming its key path).
//
// Filling happens once per contract: a field is filled when it holds its Go
// zero value and its key was not written in the parsed document. A contract
// that was already resolved, or comes from Default, is only validated, so
// c := Default(); c.Packing.MaxLag = 0; c.Resolve() keeps 0.
func (c *Contract) Resolve() error {
	c.fillDefaults()
	return c.Validate()
}

// fillDefaults applies the defaults (see Resolve) once.
func (c *Contract) fillDefaults() {
	if c.filled {
		return
	}
	c.filled = true
	def := knobDefaults()
	fillZero(reflect.ValueOf(c).Elem(), reflect.ValueOf(def).Elem(), "", c.set)
	for i := range c.Rewards {
		fillZero(reflect.ValueOf(&c.Rewards[i]).Elem(), reflect.ValueOf(defaultReward),
			"rewards["+strconv.Itoa(i)+"]", c.set)
	}
	// Cross-field defaults, after the fields they copy.
	if c.Estimator.MinGroupSize == 0 && !c.set["estimator.min_group_size"] {
		c.Estimator.MinGroupSize = c.Sampler.GroupSize
	}
	if c.Packing.BatchGroups == 0 && !c.set["packing.batch_groups"] {
		c.Packing.BatchGroups = c.Dispatch.GroupsPerUpdate
	}
	// loss.ratio's default is its zero value, left out of the hash: the
	// default written out means the same and hashes the same.
	if c.Loss.Ratio == objective.RatioToken {
		c.Loss.Ratio = ""
	}
}

// fillZero copies each leaf of def into dst where dst holds the zero value,
// the key path was not written, and the default is not zero. Structs are
// walked (inline embeddings at their parent's path); every other kind is a
// leaf.
func fillZero(dst, def reflect.Value, path string, set map[string]bool) {
	for _, f := range fieldsOf(dst.Type()).list {
		p := join(path, f.name)
		dv, fv := def.FieldByIndex(f.index), dst.FieldByIndex(f.index)
		if fv.Kind() == reflect.Struct && fv.Type() != floorType && fv.Type() != stopRuleType {
			fillZero(fv, dv, p, set)
			continue
		}
		if fv.IsZero() && !set[p] && !dv.IsZero() {
			fv.Set(deepCopy(dv))
		}
	}
}

// deepCopy copies slices and maps so a filled contract never shares storage
// with another.
func deepCopy(v reflect.Value) reflect.Value {
	switch v.Kind() {
	case reflect.Slice:
		if v.IsNil() {
			return v
		}
		s := reflect.MakeSlice(v.Type(), v.Len(), v.Len())
		for i := 0; i < v.Len(); i++ {
			s.Index(i).Set(deepCopy(v.Index(i)))
		}
		return s
	case reflect.Map:
		if v.IsNil() {
			return v
		}
		m := reflect.MakeMapWithSize(v.Type(), v.Len())
		it := v.MapRange()
		for it.Next() {
			m.SetMapIndex(it.Key(), deepCopy(it.Value()))
		}
		return m
	case reflect.Struct:
		s := reflect.New(v.Type()).Elem()
		s.Set(v) // unexported fields included
		for i := 0; i < v.NumField(); i++ {
			if s.Field(i).CanSet() {
				s.Field(i).Set(deepCopy(v.Field(i)))
			}
		}
		return s
	}
	return v
}

// Clone returns a deep copy of c, including whether it was resolved.
func (c *Contract) Clone() *Contract {
	out := deepCopy(reflect.ValueOf(c).Elem()).Interface().(Contract)
	if c.set != nil {
		out.set = make(map[string]bool, len(c.set))
		for k, v := range c.set {
			out.set[k] = v
		}
	}
	return &out
}

// Written reports whether the parsed document wrote the key path (for
// example "topics.replication"), as opposed to it holding a default. A
// contract from Default writes nothing.
func (c *Contract) Written(path string) bool { return c.set[path] }

// validator collects field errors.
type validator struct{ errs []error }

func (v *validator) add(path, format string, args ...any) {
	v.errs = append(v.errs, &FieldError{Path: path, Msg: fmt.Sprintf(format, args...)})
}

func finite(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }

func g(x float64) string { return strconv.FormatFloat(x, 'g', -1, 64) }

func (v *validator) positive(path string, x float64) {
	switch {
	case !finite(x):
		v.add(path, "must be finite, got %s", g(x))
	case !(x > 0):
		v.add(path, "must be > 0, got %s", g(x))
	}
}

func (v *validator) nonNegative(path string, x float64) {
	switch {
	case !finite(x):
		v.add(path, "must be finite, got %s", g(x))
	case !(x >= 0):
		v.add(path, "must be >= 0, got %s", g(x))
	}
}

func (v *validator) within(path string, x, lo, hi float64, hiOpen bool) {
	if !finite(x) {
		v.add(path, "must be finite, got %s", g(x))
		return
	}
	ok := x >= lo && x <= hi
	if hiOpen {
		ok = x >= lo && x < hi
	}
	if !ok {
		bracket := "]"
		if hiOpen {
			bracket = ")"
		}
		v.add(path, "must be in [%s, %s%s, got %s", g(lo), g(hi), bracket, g(x))
	}
}

// float32Range refuses a finite x beyond float32's range, which becomes
// ±Inf where why says it is narrowed to float32.
func (v *validator) float32Range(path string, x float64, why string) {
	if finite(x) && math.Abs(x) > math.MaxFloat32 {
		v.add(path, "must be <= %s (%s), got %s", g(math.MaxFloat32), why, g(x))
	}
}

func (v *validator) minInt(path string, x, lo int64) {
	if x < lo {
		v.add(path, "must be >= %d, got %d", lo, x)
	}
}

// MaxCount bounds every count of the contract (sizes, turns, tokens per
// action and episode, retries, epochs, lags, partitions, ...): the
// records keep such counts in int32 fields (a group of sampler.group_size
// is schemas' int32 group_size), and the operators add and multiply them
// in int64 ((packing.max_lag+1) × packing.batch_groups groups in flight),
// which a count up to 2^31-1 cannot overflow.
const MaxCount = math.MaxInt32

// count checks lo <= x <= MaxCount.
func (v *validator) count(path string, x, lo int64) {
	switch {
	case x < lo:
		v.add(path, "must be >= %d, got %d", lo, x)
	case x > MaxCount:
		v.add(path, "must be <= %d, got %d", MaxCount, x)
	}
}

// MaxDurationMS is the longest time.Duration in milliseconds (about 292
// years): the operators turn the contract's millisecond timeouts into
// time.Duration, and a longer one would wrap around to a negative,
// already expired, timeout.
const MaxDurationMS = math.MaxInt64 / int64(time.Millisecond)

// MaxLatencyMedianMS bounds the simulated latency medians: a draw is at
// most e^{MaxZ·sigma} <= e^12 times its median (rollout.LatencyModel), and
// must fit a time.Duration.
const MaxLatencyMedianMS = 3_600_000

// Kafka limits (the protocol's int16 replication factor; a consumer
// fetches max.message.bytes plus 1 MiB in an int32 fetch size).
const (
	maxReplication     = math.MaxInt16
	maxMaxMessageBytes = 1 << 30
)

func (v *validator) oneOf(path, x string, allowed ...string) {
	for _, a := range allowed {
		if x == a {
			return
		}
	}
	v.add(path, "must be one of %s, got %q", strings.Join(allowed, ", "), x)
}

func (v *validator) required(path, x string) {
	if strings.TrimSpace(x) == "" {
		v.add(path, "required")
	}
}

func validRunID(s string) bool {
	if len(s) == 0 || len(s) > 128 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return false
		}
	}
	return true
}

// Validate checks every rule of the contract without filling defaults and
// returns all problems together (errors.Join of *FieldError), or nil.
// Resolve is Validate after the defaults.
func (c *Contract) Validate() error {
	var v validator
	if !validRunID(c.RunID) {
		v.add("run_id", "must be 1..128 characters from [A-Za-z0-9._-], got %q", c.RunID)
	}
	c.validateObjective(&v)
	c.validateBudgets(&v)
	c.validateStopRules(&v)
	c.validateArtifacts(&v)
	c.validateSampler(&v)
	c.validateEstimator(&v)
	c.validateLoss(&v)
	c.validatePacking(&v)
	c.validateRewards(&v)
	c.validateTopics(&v)
	c.validateDispatch(&v)
	c.validateLatency(&v)
	c.validatePolicy(&v)
	c.validateConditionals(&v)
	return joinErrors(v.errs)
}

func (c *Contract) validateObjective(v *validator) {
	o := c.Objective
	v.required("objective.target_distribution", o.TargetDistribution)
	v.required("objective.primary_metric", o.PrimaryMetric)
	for _, k := range sortedKeys(o.Constraints) {
		p := "objective.constraints." + k
		if strings.TrimSpace(k) == "" {
			v.add(p, "metric name must not be empty")
		}
		if !finite(o.Constraints[k]) {
			v.add(p, "must be finite, got %s", g(o.Constraints[k]))
		}
	}
	for _, k := range sortedKeys(o.RegressionFloors) {
		p := "objective.regression_floors." + k
		f := o.RegressionFloors[k]
		if strings.TrimSpace(k) == "" {
			v.add(p, "metric name must not be empty")
		}
		switch {
		case !finite(f.Value):
			v.add(p, "must be finite, got %s", f)
		case f.Relative && !(f.Value > 0):
			v.add(p, "relative floor must be > 0, got %s", f)
		}
	}
	v.nonNegative("objective.kl_limit", o.KLLimit)
}

func (c *Contract) validateBudgets(v *validator) {
	b := c.Budgets
	v.minInt("budgets.rollout_tokens", b.RolloutTokens, 1)
	v.minInt("budgets.optimizer_tokens", b.OptimizerTokens, 1)
	v.positive("budgets.environment_hours", b.EnvironmentHours)
	v.positive("budgets.accelerator_hours", b.AcceleratorHours)
}

func (c *Contract) validateStopRules(v *validator) {
	if len(c.StopRules) == 0 {
		v.add("stop_rules", "at least one stop rule is required")
	}
	seen := map[string]int{}
	for i, r := range c.StopRules {
		p := "stop_rules[" + strconv.Itoa(i) + "]"
		switch r.Kind {
		case StopSafetyViolation, StopBudgetExhausted:
			if r.N != 0 {
				v.add(p, "%s takes no count, got %d", r.Kind, r.N)
			}
		case StopNoValidationGain, StopKLAboveLimit:
			if r.N < 1 || r.N > maxStopN {
				v.add(p, "%s count must be in [1, %d], got %d", r.Kind, maxStopN, r.N)
			}
		default:
			v.add(p, "unknown stop rule kind %q", r.Kind)
			continue
		}
		if j, dup := seen[r.Kind]; dup {
			v.add(p, "%s already declared at stop_rules[%d]", r.Kind, j)
		}
		seen[r.Kind] = i
		if r.Kind == StopKLAboveLimit && !(c.Objective.KLLimit > 0) {
			v.add("objective.kl_limit", "must be > 0 when %s is a stop rule, got %s", r, g(c.Objective.KLLimit))
		}
	}
}

// floating lists artifact references that move over time.
func floatingRef(id string) bool {
	l := strings.ToLower(id)
	return l == "latest" || l == "head" || strings.HasSuffix(l, ":latest") || strings.HasSuffix(l, "@latest")
}

func (c *Contract) validateArtifacts(v *validator) {
	a := reflect.ValueOf(c.Artifacts)
	for _, f := range fieldsOf(a.Type()).list {
		p := "artifacts." + f.name
		id := a.FieldByIndex(f.index).String()
		switch {
		case id == "":
			v.add(p, "required: an immutable artifact id")
		case strings.ContainsFunc(id, func(r rune) bool { return r <= ' ' || r == 0x7f }):
			v.add(p, "must not contain whitespace or control characters, got %q", id)
		case floatingRef(id):
			v.add(p, "must be immutable, got the floating reference %q", id)
		}
	}
}

func (c *Contract) validateSampler(v *validator) {
	s := c.Sampler
	v.positive("sampler.temperature", s.Temperature)
	if s.Temperature > 0 && s.Temperature < 1e-6 { // gpu/model.MinTemperature
		v.add("sampler.temperature", "must be >= 1e-06 (logits divided by less overflow float32; greedy decoding is top_k 1), got %s", g(s.Temperature))
	}
	if !(s.TopP > 0 && s.TopP <= 1) {
		v.add("sampler.top_p", "must be in (0, 1], got %s", g(s.TopP))
	}
	v.count("sampler.top_k", int64(s.TopK), 0)
	v.within("sampler.min_p", s.MinP, 0, 1, true)
	if s.MinP != 0 && finite(s.MinP) && served(c) {
		// The server clients send min_p 0 whatever the contract says
		// (connectors/policy): only the built-in policy applies it.
		v.add("sampler.min_p", "applies to policy.protocol builtin only: the %s client sends min_p 0, so its servers sample without it; set it to 0 or leave it out, got %s", c.Policy.Protocol, g(s.MinP))
	}
	v.count("sampler.max_tokens_per_action", int64(s.MaxTokensPerAction), 1)
	v.count("sampler.max_tokens_per_episode", int64(s.MaxTokensPerEpisode), 1)
	if s.MaxTokensPerAction > 0 && s.MaxTokensPerEpisode > 0 && s.MaxTokensPerEpisode < s.MaxTokensPerAction {
		v.add("sampler.max_tokens_per_episode", "must be >= sampler.max_tokens_per_action (%d), got %d",
			s.MaxTokensPerAction, s.MaxTokensPerEpisode)
	}
	v.count("sampler.max_turns", int64(s.MaxTurns), 1)
	seen := map[int32]int{}
	for i, id := range s.StopTokenIDs {
		p := "sampler.stop_token_ids[" + strconv.Itoa(i) + "]"
		if id < 0 {
			v.add(p, "must be >= 0, got %d", id)
		}
		if j, dup := seen[id]; dup {
			v.add(p, "token %d already listed at index %d", id, j)
		}
		seen[id] = i
	}
	v.count("sampler.group_size", int64(s.GroupSize), 1)
	v.timeout("sampler.tool_timeout_ms", s.ToolTimeoutMS)
	v.count("sampler.tool_retries", int64(s.ToolRetries), 0)
	// A group of the rollout stage times out after (tool timeout + policy
	// timeout) × max_turns (operators.GroupTimeout), a time.Duration.
	tool, pol, turns := s.ToolTimeoutMS, c.Policy.TimeoutMS, int64(max(1, s.MaxTurns))
	if tool >= 1 && tool <= MaxDurationMS && pol >= 1 && pol <= MaxDurationMS && tool+pol > MaxDurationMS/turns {
		path := "sampler.tool_timeout_ms"
		if pol > tool {
			path = "policy.timeout_ms"
		}
		v.add(path, "a group's timeout, (sampler.tool_timeout_ms %d + policy.timeout_ms %d) × sampler.max_turns %d, must be <= %d ms (a time.Duration)",
			tool, pol, turns, MaxDurationMS)
	}
}

// timeout checks a millisecond timeout: >= 1 and a time.Duration.
func (v *validator) timeout(path string, ms int64) {
	switch {
	case ms < 1:
		v.add(path, "must be >= 1, got %d", ms)
	case ms > MaxDurationMS:
		v.add(path, "must be <= %d (milliseconds that fit a time.Duration, about 292 years), got %d", MaxDurationMS, ms)
	}
}

func (c *Contract) validateEstimator(v *validator) {
	e := c.Estimator
	v.oneOf("estimator.name", e.Estimator, advantage.GRPO, advantage.RLOO, advantage.GAE)
	v.oneOf("estimator.std_mode", e.StdMode, advantage.StdSample, advantage.StdPopulation)
	v.nonNegative("estimator.epsilon", e.Epsilon)
	v.within("estimator.gamma", e.Gamma, 0, 1, false)
	v.within("estimator.lambda", e.Lambda, 0, 1, false)
	v.oneOf("estimator.zero_variance", e.ZeroVariance, advantage.ZeroVarKeep, advantage.ZeroVarDrop, advantage.ZeroVarPenalizeFailed)
	if e.ZeroVariance == advantage.ZeroVarPenalizeFailed && e.Estimator == advantage.GAE {
		v.add("estimator.zero_variance", "penalize_failed needs a group-relative estimator (grpo or rloo), not gae")
	}
	v.count("estimator.min_group_size", int64(e.MinGroupSize), 1)
	if e.MinGroupSize > c.Sampler.GroupSize {
		v.add("estimator.min_group_size", "must be <= sampler.group_size (%d), got %d", c.Sampler.GroupSize, e.MinGroupSize)
	}
	switch e.Estimator {
	case advantage.GRPO, advantage.RLOO:
		// A group-relative baseline needs another member (docs/PIPELINE.md §10).
		if c.Sampler.GroupSize < 2 {
			v.add("sampler.group_size", "must be >= 2 for estimator %s, got %d", e.Estimator, c.Sampler.GroupSize)
		}
	}
	// One return has zero variance, so with drop a group of one member is
	// always filtered: with G = 1 (only GAE allows it) nothing would ever
	// train. With G >= 2 and min_group_size 1 only a partial group closed
	// with a single member is dropped (counted as zero_variance); the
	// groups of two or more train, so that combination stays legal.
	if e.ZeroVariance == advantage.ZeroVarDrop && c.Sampler.GroupSize == 1 {
		v.add("estimator.zero_variance", "drop filters every group when sampler.group_size is 1 (a single return has zero variance, so nothing would train); use keep, or sampler.group_size >= 2")
	}
	if e.Estimator == advantage.RLOO && e.MinGroupSize == 1 {
		v.add("estimator.min_group_size", "must be >= 2 for estimator rloo (leave-one-out needs another member), got 1")
	}
	seen := map[string]int{}
	for i, r := range e.BootstrapReasons {
		p := "estimator.bootstrap_truncations[" + strconv.Itoa(i) + "]"
		if strings.TrimSpace(r) == "" {
			v.add(p, "must not be empty")
		}
		if j, dup := seen[r]; dup {
			v.add(p, "%q already listed at index %d", r, j)
		}
		seen[r] = i
	}
}

func (c *Contract) validateLoss(v *validator) {
	l := c.Loss
	v.within("loss.clip_low", l.ClipLow, 0, 1, true)
	v.nonNegative("loss.clip_high", l.ClipHigh)
	v.oneOf("loss.normalization", l.Normalization, objective.TokenMean, objective.SeqMeanTokenSum, objective.SeqMeanTokenMean, objective.TokenSum)
	switch {
	case l.Normalization == objective.TokenSum && l.NormTokens <= 0:
		v.add("loss.norm_tokens", "must be > 0 with loss.normalization %s (the constant the token sum is divided by), got %d", objective.TokenSum, l.NormTokens)
	case l.Normalization != objective.TokenSum && l.NormTokens != 0:
		v.add("loss.norm_tokens", "must be 0 unless loss.normalization is %s (got %q, %d)", objective.TokenSum, l.Normalization, l.NormTokens)
	}
	v.oneOf("loss.kl_placement", l.KLPlacement, objective.KLNone, objective.KLLoss, objective.KLReward)
	v.oneOf("loss.kl_estimator", l.KLEstimator, objective.K1, objective.K2, objective.K3)
	if l.KLPlacement == objective.KLReward {
		v.add("loss.kl_placement", "%q is not implemented: no reward evaluator computes a KL penalty; use loss (the trainer computes the reference log-probs) or none", l.KLPlacement)
	}
	if l.KLPlacement == objective.KLLoss {
		v.positive("loss.kl_coef", l.KLCoef)
		// The reference's log-probs are taken under the behavior transform,
		// as the current ones (docs/PIPELINE.md §12); a truncating sampler
		// would give a sampled token outside the reference's top-k or
		// nucleus probability 0, an infinite KL.
		if s := c.Sampler; s.TopK > 0 || s.TopP < 1 || s.MinP > 0 {
			v.add("loss.kl_placement", "loss with a truncating sampler (top_k %d, top_p %s, min_p %s) is not implemented: a sampled token outside the reference's truncated distribution has an infinite KL; use top_k 0, top_p 1, min_p 0", s.TopK, g(s.TopP), g(s.MinP))
		}
	} else if l.KLCoef != 0 {
		v.add("loss.kl_coef", "must be 0 unless loss.kl_placement is loss (got placement %q, coefficient %s)", l.KLPlacement, g(l.KLCoef))
	}
	v.nonNegative("loss.entropy_coef", l.EntropyCoef)
	v.float32Range("loss.entropy_coef", l.EntropyCoef, "the CUDA trainer passes it to its kernels as a float32")
	v.nonNegative("loss.max_log_ratio", l.MaxLogRatio)
	v.oneOf("loss.off_policy", l.OffPolicy, objective.OffPolicyNone, objective.OffPolicyTIS, objective.OffPolicyDecoupled)
	switch {
	case math.IsNaN(l.ISCap) || math.IsInf(l.ISCap, 0) || (l.ISCap != 0 && l.ISCap < 1):
		v.add("loss.is_cap", "must be 0 (no cap) or a finite cap >= 1 (on policy the weight is 1), got %s", g(l.ISCap))
	case l.OffPolicy == objective.OffPolicyTIS && l.ISCap == 0:
		v.add("loss.is_cap", "must be set (>= 1) with loss.off_policy %s: truncated importance sampling needs its cap", objective.OffPolicyTIS)
	case l.OffPolicy == objective.OffPolicyNone && l.ISCap != 0:
		v.add("loss.is_cap", "must be 0 with loss.off_policy none (nothing to truncate), got %s", g(l.ISCap))
	}
	if l.Ratio != "" {
		v.oneOf("loss.ratio", l.Ratio, objective.RatioToken, objective.RatioSequence)
	}
	if l.Ratio == objective.RatioSequence && l.Corrected() {
		v.add("loss.ratio", "%q with loss.off_policy %s is not implemented: use off_policy none, or the token ratio", objective.RatioSequence, l.OffPolicy)
	}
	o := l.Optimizer
	v.positive("loss.optimizer.lr", o.LR)
	v.float32Range("loss.optimizer.lr", o.LR, "an Adam step moves a parameter by about lr, and the parameters are float32: a larger one turns them into ±Inf")
	v.within("loss.optimizer.beta1", o.Beta1, 0, 1, true)
	v.within("loss.optimizer.beta2", o.Beta2, 0, 1, true)
	v.positive("loss.optimizer.eps", o.Eps)
	v.nonNegative("loss.optimizer.grad_clip", o.GradClip)
	v.count("loss.optimizer.epochs", int64(o.Epochs), 1)
	v.count("loss.optimizer.minibatches", int64(o.Minibatches), 1)
}

func (c *Contract) validatePacking(v *validator) {
	p := c.Packing
	v.minInt("packing.token_budget", int64(p.TokenBudget), 1)
	if p.TokenBudget > math.MaxInt32 {
		v.add("packing.token_budget", "must be <= %d (packed rows are int32-indexed), got %d", math.MaxInt32, p.TokenBudget)
	}
	if p.BatchTokens < p.TokenBudget || p.BatchTokens < 1 {
		v.add("packing.batch_tokens", "must be >= packing.token_budget (%d) and > 0, got %d", p.TokenBudget, p.BatchTokens)
	}
	v.count("packing.batch_groups", int64(p.BatchGroups), 0)
	v.oneOf("packing.overflow", p.Overflow, pack.OverflowReject, pack.OverflowTruncate)
	v.count("packing.max_lag", p.MaxLag, 0)
	v.oneOf("packing.stale_policy", p.StalePolicy, pack.StaleDrop, pack.StaleMaskTurns)
	v.oneOf("packing.multi_policy", p.MultiPolicy, pack.MultiPolicySegments, pack.MultiPolicyNewest, pack.MultiPolicyDiscard)
}

func (c *Contract) validateRewards(v *validator) {
	if len(c.Rewards) == 0 {
		v.add("rewards", "at least one reward component is required")
	}
	seen := map[string]int{}
	hasKL := false
	for i, r := range c.Rewards {
		p := "rewards[" + strconv.Itoa(i) + "]"
		v.required(p+".name", r.Name)
		if j, dup := seen[r.Name]; dup && r.Name != "" {
			v.add(p+".name", "%q already declared at rewards[%d]", r.Name, j)
		}
		seen[r.Name] = i
		v.required(p+".version", r.Version)
		if !finite(r.Weight) {
			v.add(p+".weight", "must be finite, got %s", g(r.Weight))
		}
		v.oneOf(p+".transform", r.Transform, TransformIdentity, TransformClip, TransformTanh, TransformNegate)
		if len(r.RawRange) > 0 && (len(r.RawRange) != 2 || !finite(r.RawRange[0]) || !finite(r.RawRange[1]) || r.RawRange[0] > r.RawRange[1]) {
			v.add(p+".raw_range", "want two finite numbers [lo, hi] with lo <= hi, got %v", r.RawRange)
		}
		if r.Transform == TransformClip {
			if !finite(r.ClipMin) || !finite(r.ClipMax) || !(r.ClipMin < r.ClipMax) {
				v.add(p+".clip_max", "transform clip needs finite clip_min < clip_max, got [%s, %s]", g(r.ClipMin), g(r.ClipMax))
			}
		} else {
			if r.ClipMin != 0 {
				v.add(p+".clip_min", "only used by transform clip (transform is %q)", r.Transform)
			}
			if r.ClipMax != 0 {
				v.add(p+".clip_max", "only used by transform clip (transform is %q)", r.Transform)
			}
		}
		v.oneOf(p+".scope", r.Scope, schemas.ScopeTrajectory, schemas.ScopeTurn, schemas.ScopeSpan)
		if r.Name == RewardKL {
			hasKL = true
			switch c.Loss.KLPlacement {
			case objective.KLLoss:
				// docs/PIPELINE.md §8: KL in reward or in loss, never both.
				v.add(p+".name", "a %q reward component with loss.kl_placement loss applies KL twice (in reward or in loss, never both)", RewardKL)
			case objective.KLNone:
				v.add(p+".name", "a %q reward component needs loss.kl_placement reward, got none", RewardKL)
			}
		}
	}
	if c.Loss.KLPlacement == objective.KLReward && !hasKL {
		v.add("loss.kl_placement", "reward placement needs a reward component named %q (its weight is the KL coefficient)", RewardKL)
	}
}

func (c *Contract) validateTopics(v *validator) {
	t := c.Topics
	v.count("topics.partitions", int64(t.Partitions), 1)
	v.minInt("topics.replication", int64(t.Replication), 1)
	if t.Replication > maxReplication {
		v.add("topics.replication", "must be <= %d (Kafka's replication factor is an int16), got %d", maxReplication, t.Replication)
	}
	if t.RetentionMS != -1 && t.RetentionMS < 1 {
		v.add("topics.retention_ms", "must be > 0 or -1 (unlimited), got %d", t.RetentionMS)
	}
	v.minInt("topics.max_message_bytes", int64(t.MaxMessageBytes), 1)
	if t.MaxMessageBytes > maxMaxMessageBytes {
		v.add("topics.max_message_bytes", "must be <= %d (1 GiB: consumers fetch a message plus 1 MiB in Kafka's int32 fetch size), got %d", maxMaxMessageBytes, t.MaxMessageBytes)
	}
	for _, short := range sortedKeys(t.Compression) {
		p := "topics.compression." + short
		if _, ok := pipeline.TopicInfoOf(short); !ok {
			v.add(p, "no topic %q in the topology (trajflow schemas lists them)", short)
		}
		v.oneOf(p, t.Compression[short], kafka.CompressionCodecs...)
	}
}

func (c *Contract) validateDispatch(v *validator) {
	d := c.Dispatch
	v.count("dispatch.tasks_per_update", int64(d.TasksPerUpdate), 1)
	v.count("dispatch.groups_per_update", int64(d.GroupsPerUpdate), 1)
	if d.TasksPerUpdate >= 1 && d.GroupsPerUpdate >= 1 && d.GroupsPerUpdate%d.TasksPerUpdate != 0 {
		v.add("dispatch.groups_per_update", "must be a multiple of dispatch.tasks_per_update (%d), got %d", d.TasksPerUpdate, d.GroupsPerUpdate)
	}
	for _, k := range sortedKeys(d.DomainQuotas) {
		p := "dispatch.domain_quotas." + k
		if strings.TrimSpace(k) == "" {
			v.add(p, "domain name must not be empty")
		}
		if q := d.DomainQuotas[k]; !(q > 0 && q <= 1) {
			v.add(p, "must be in (0, 1], got %s", g(q))
		}
	}
	v.count("dispatch.eval_every", int64(d.EvalEvery), 1)
	if d.Mode != DispatchSync && d.Mode != DispatchAsync {
		v.add("dispatch.mode", "must be %s or %s, got %q", DispatchSync, DispatchAsync, d.Mode)
	}
	v.oneOf("dispatch.partial_rollouts", d.PartialRollouts, PartialFinish, PartialContinue)
}

func (c *Contract) validateLatency(v *validator) {
	l := c.Latency
	for _, m := range []struct {
		path string
		ms   float64
	}{{"latency.tool_median_ms", l.ToolMedianMS}, {"latency.token_median_ms", l.TokenMedianMS}} {
		v.nonNegative(m.path, m.ms)
		if m.ms > MaxLatencyMedianMS && finite(m.ms) {
			v.add(m.path, "must be <= %d (one hour; a draw of up to e^12 times the median must fit a time.Duration), got %s", MaxLatencyMedianMS, g(m.ms))
		}
	}
	v.within("latency.tool_sigma", l.ToolSigma, 0, 3, false)
	v.within("latency.token_sigma", l.TokenSigma, 0, 3, false)
	// A median of 0 draws no latency whatever the sigma
	// (rollout.LatencyModel.Draw): the sigma of an unset median is 0.
	for _, s := range []struct {
		path, median string
		sigma, ms    float64
	}{{"latency.tool_sigma", "latency.tool_median_ms", l.ToolSigma, l.ToolMedianMS}, {"latency.token_sigma", "latency.token_median_ms", l.TokenSigma, l.TokenMedianMS}} {
		if s.sigma != 0 && finite(s.sigma) && s.ms == 0 {
			v.add(s.path, "applies only with %s > 0 (a median of 0 draws no latency, whatever the sigma): set the median or leave the sigma out, got %s", s.median, g(s.sigma))
		}
	}
}

func (c *Contract) validatePolicy(v *validator) {
	p := c.Policy
	v.oneOf("policy.protocol", p.Protocol, PolicyBuiltin, PolicyLlamaCpp, PolicySGLang, PolicyVLLM)
	if p.Protocol == PolicyBuiltin && len(p.Endpoints) > 0 {
		v.add("policy.endpoints", "the builtin policy runs in process: no endpoints (set policy.protocol to llamacpp, sglang or vllm), got %d", len(p.Endpoints))
	}
	if p.Protocol != PolicyBuiltin && p.Protocol != "" && len(p.Endpoints) == 0 {
		v.add("policy.endpoints", "protocol %s needs at least one replica URL", p.Protocol)
	}
	seen := map[string]int{}
	for i, e := range p.Endpoints {
		path := "policy.endpoints[" + strconv.Itoa(i) + "]"
		u, err := url.Parse(e)
		switch {
		case err != nil:
			v.add(path, "not a URL: %v", err)
		case u.Scheme != "http" && u.Scheme != "https":
			v.add(path, "want http://host:port or https://host:port, got %q", e)
		case u.Host == "" || u.Port() == "":
			v.add(path, "want a host and a port, got %q", e)
		case u.User != nil || u.RawQuery != "" || u.Fragment != "" || (u.Path != "" && u.Path != "/"):
			v.add(path, "want a base URL without credentials, path, query or fragment, got %q", e)
		}
		if j, dup := seen[e]; dup {
			v.add(path, "%q already listed at index %d", e, j)
		}
		seen[e] = i
	}
	v.timeout("policy.timeout_ms", p.TimeoutMS)
	v.count("policy.retries", int64(p.Retries), 0)
	v.count("policy.concurrency", int64(p.Concurrency), 1)
	if p.Router && p.Protocol != PolicyLlamaCpp {
		v.add("policy.router", "only for protocol llamacpp (llama-server routers), got protocol %q", p.Protocol)
	}
}
