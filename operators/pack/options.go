// Package pack reconstructs training sequences from scored trajectories and
// packs them into token budgets (pipeline document §11), behind a lag-aware
// admission window (DESIGN.md).
package pack

// Overflow rules for a trajectory longer than the token budget (pipeline §11:
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

// Options declares packing and admission.
type Options struct {
	TokenBudget int    `yaml:"token_budget" json:"token_budget"` // tokens per packed row
	BatchTokens int    `yaml:"batch_tokens" json:"batch_tokens"` // window closes when admitted tokens reach this
	BatchGroups int    `yaml:"batch_groups" json:"batch_groups"` // or when this many groups are admitted (0 = off)
	Overflow    string `yaml:"overflow" json:"overflow"`         // OverflowReject / OverflowTruncate
	MaxLag      int64  `yaml:"max_lag" json:"max_lag"`           // admission window in policy versions
	StalePolicy string `yaml:"stale_policy" json:"stale_policy"` // StaleDrop / StaleMaskTurns
}
