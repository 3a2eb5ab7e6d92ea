package schemas

// ScoredTrajectories is the codec of KindScored: every rewarded column,
// then turn_rewards, turn_returns, turn_advantages and turn_value_targets
// (list<float32>, one entry per turn), the `group` statistics struct
// recorded before filtering (docs/PIPELINE.md §10), and estimator,
// estimator_version.
var ScoredTrajectories = newCodec[Scored](KindScored)
