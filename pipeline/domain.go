package pipeline

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/trajflow/trajflow/schemas"
)

// domainVecs are the metric families of what a run learns and keeps,
// beside the runtime's: which policy version is served and trained, the
// trainer's objective statistics, rewards, packing and lag. Stages report
// them through Env.Metrics. The docs (README, "Health and metrics") map
// them to the names RL frameworks use (verl's actor/pg_clipfrac,
// actor/ppo_kl, actor/entropy, ...).
type domainVecs struct {
	policyVersion *prometheus.GaugeVec
	updates       *prometheus.CounterVec
	loss          *prometheus.GaugeVec
	kl            *prometheus.GaugeVec
	entropy       *prometheus.GaugeVec
	clip          *prometheus.GaugeVec
	stepSeconds   *prometheus.HistogramVec
	reward        *prometheus.HistogramVec
	rewarded      *prometheus.CounterVec
	successes     *prometheus.CounterVec
	packing       *prometheus.GaugeVec
	batchTokens   *prometheus.CounterVec
	lag           *prometheus.HistogramVec
	filtered      *prometheus.CounterVec
}

func newDomainVecs(reg prometheus.Registerer, lbl []string) *domainVecs {
	with := func(extra ...string) []string { return append(append([]string{}, lbl...), extra...) }
	d := &domainVecs{
		policyVersion: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "trajflow_policy_version",
			Help: "Policy version: role=trained, the trainer's last release; role=served, the version rollout generates with."}, with("role")),
		updates: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "trajflow_train_updates_total",
			Help: "Policy updates trained (one per batch)."}, lbl),
		loss: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "trajflow_train_loss",
			Help: "Objective of the last optimizer step of the last update: term=total, policy (verl actor/pg_loss) or kl, the KL to the reference as the loss weighs it (0 unless loss.kl_placement is loss; verl actor/kl_loss)."}, with("term")),
		kl: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "trajflow_train_approx_kl",
			Help: "Approximate KL(behavior || current) over the masked tokens at the last optimizer step (verl actor/ppo_kl)."}, lbl),
		entropy: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "trajflow_train_entropy_nats",
			Help: "Mean token entropy of the current policy at the last optimizer step (verl actor/entropy)."}, lbl),
		clip: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "trajflow_train_clip_ratio",
			Help: "Share of masked tokens whose ratio was clipped at the last optimizer step, by advantage sign (verl actor/pg_clipfrac)."}, with("sign")),
		stepSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "trajflow_train_update_duration_seconds",
			Help: "Time one update (every optimizer step on one batch) took.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}, lbl),
		reward: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "trajflow_reward",
			Help:    "Reward of each scored trajectory, by component (component=total: their sum).",
			Buckets: prometheus.LinearBuckets(-1, 0.25, 9)}, with("component")),
		rewarded: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "trajflow_trajectories_rewarded_total",
			Help: "Trajectories scored."}, lbl),
		successes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "trajflow_trajectories_succeeded_total",
			Help: "Scored trajectories with a total reward above 0 (success = succeeded / rewarded)."}, lbl),
		packing: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "trajflow_pack_efficiency_ratio",
			Help: "Tokens of the last batch over its rows times the token budget."}, lbl),
		batchTokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "trajflow_batch_tokens_total",
			Help: "Tokens packed into batches."}, lbl),
		lag: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "trajflow_admitted_policy_lag_versions",
			Help:    "Policy lag of each admitted trajectory: the trainer's version when its batch closed minus the version that generated it.",
			Buckets: []float64{0, 1, 2, 3, 4, 6, 8, 16}}, lbl),
		filtered: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "trajflow_trajectories_filtered_total",
			Help: "Trajectories the pack window filtered, by reason (stale, zero_variance, ...; the stale share is reason=stale over all decided)."}, with("reason")),
	}
	reg.MustRegister(d.policyVersion, d.updates, d.loss, d.kl, d.entropy, d.clip, d.stepSeconds, d.reward, d.rewarded,
		d.successes, d.packing, d.batchTokens, d.lag, d.filtered)
	return d
}

// Domain reports the domain metrics of one stage; the methods of a nil
// Domain do nothing (a stage driven without metrics).
type Domain struct {
	policyVersion, loss, clip                 *prometheus.GaugeVec
	updates, rewarded, successes, batchTokens prometheus.Counter
	kl, entropy, packing                      prometheus.Gauge
	stepSeconds, lag                          prometheus.Observer
	rewardVec                                 prometheus.ObserverVec
	filteredVec                               *prometheus.CounterVec
}

func (d *domainVecs) forStage(l prometheus.Labels) *Domain {
	return &Domain{
		policyVersion: d.policyVersion.MustCurryWith(l), loss: d.loss.MustCurryWith(l), clip: d.clip.MustCurryWith(l),
		updates: d.updates.With(l), rewarded: d.rewarded.With(l), successes: d.successes.With(l), batchTokens: d.batchTokens.With(l),
		kl: d.kl.With(l), entropy: d.entropy.With(l), packing: d.packing.With(l),
		stepSeconds: d.stepSeconds.With(l), lag: d.lag.With(l),
		rewardVec: d.reward.MustCurryWith(l), filteredVec: d.filtered.MustCurryWith(l),
	}
}

// PolicyVersion sets the version of role ("trained" or "served").
func (d *Domain) PolicyVersion(role string, v int64) {
	if d != nil {
		d.policyVersion.WithLabelValues(role).Set(float64(v))
	}
}

// Update reports one trained update.
func (d *Domain) Update(u schemas.UpdateRecord) {
	if d == nil {
		return
	}
	d.updates.Inc()
	d.policyVersion.WithLabelValues("trained").Set(float64(u.Version))
	d.loss.WithLabelValues("total").Set(u.Last.Loss)
	d.loss.WithLabelValues("policy").Set(u.Last.PolicyLoss)
	d.loss.WithLabelValues("kl").Set(u.Last.KL)
	d.kl.Set(u.Last.ApproxKLOld)
	d.entropy.Set(u.Last.Entropy)
	d.clip.WithLabelValues("positive").Set(u.Last.ClipFracPos)
	d.clip.WithLabelValues("negative").Set(u.Last.ClipFracNeg)
	d.stepSeconds.Observe(u.StepSeconds)
}

// Rewarded reports one scored trajectory.
func (d *Domain) Rewarded(r *schemas.Rewarded) {
	if d == nil {
		return
	}
	d.rewarded.Inc()
	if r.RewardTotal > 0 {
		d.successes.Inc()
	}
	for _, c := range r.Rewards {
		d.rewardVec.WithLabelValues(c.Name).Observe(c.Value)
	}
	d.rewardVec.WithLabelValues("total").Observe(r.RewardTotal)
}

// Batch reports a closed window: its packing efficiency and tokens.
func (d *Domain) Batch(efficiency float64, tokens int64) {
	if d == nil {
		return
	}
	d.packing.Set(efficiency)
	d.batchTokens.Add(float64(tokens))
}

// Admitted reports the policy lag of one admitted trajectory.
func (d *Domain) Admitted(lag int64) {
	if d != nil {
		d.lag.Observe(float64(lag))
	}
}

// Filtered reports one trajectory filtered for reason.
func (d *Domain) Filtered(reason string) {
	if d != nil {
		d.filteredVec.WithLabelValues(reason).Inc()
	}
}
