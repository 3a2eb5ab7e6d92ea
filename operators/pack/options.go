// Package pack reconstructs training sequences from scored trajectories and
// packs them into token budgets (docs/PIPELINE.md §11), behind a lag-aware
// admission window (docs/PIPELINE.md §15).
package pack

// Overflow rules for a trajectory longer than the token budget (docs/PIPELINE.md §11:
// "context overflow is not solved by silently dropping early observations").
const (
	OverflowReject   = "reject"   // filtered with reason "overlong" and counted
	OverflowTruncate = "truncate" // the tail is cut at the budget; the segment is flagged truncated
)

// Stale policies for samples whose behavior policy is more than MaxLag
// versions behind the trainer.
const (
	StaleDrop      = "drop"       // the whole trajectory is filtered with reason "stale"
	StaleMaskTurns = "mask_stale" // only in-window turns train; stale turns stay as context
)

// Rules for a trajectory whose turns were sampled by several policy
// versions (a partial rollout continued under a newer policy, docs/SYSTEMS.md §7).
const (
	// MultiPolicySegments trains every turn with its own version's
	// behavior log-probs (per-segment ratios; the default).
	MultiPolicySegments = "per_segment"
	// MultiPolicyNewest trains only the turns of the trajectory's newest
	// version; earlier turns stay in the stream as context.
	MultiPolicyNewest = "new_segments"
	// MultiPolicyDiscard filters a trajectory of more than one version
	// (reason FilterMixedPolicy, counted).
	MultiPolicyDiscard = "discard"
)

// Options declares packing and admission.
type Options struct {
	TokenBudget int    `yaml:"token_budget" json:"token_budget"` // tokens per packed row
	BatchTokens int    `yaml:"batch_tokens" json:"batch_tokens"` // window closes when admitted tokens reach this
	BatchGroups int    `yaml:"batch_groups" json:"batch_groups"` // or when this many groups are admitted (0 = off)
	Overflow    string `yaml:"overflow" json:"overflow"`         // OverflowReject / OverflowTruncate
	MaxLag      int64  `yaml:"max_lag" json:"max_lag"`           // admission window in policy versions
	StalePolicy string `yaml:"stale_policy" json:"stale_policy"` // StaleDrop / StaleMaskTurns
	// MultiPolicy is the rule for multi-policy trajectories:
	// MultiPolicySegments ("" is the same), MultiPolicyNewest or
	// MultiPolicyDiscard.
	MultiPolicy string `yaml:"multi_policy" json:"multi_policy,omitempty"`
}
