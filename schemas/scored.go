package schemas

// ScoredTrajectories is the codec of KindScored: every rewarded column, the
// per-turn rewards, returns, advantages and value targets (list<float32>),
// the `group` statistics struct (pipeline §10) and the estimator name and
// version.
var ScoredTrajectories = newCodec(KindScored, scoredCols)

var groupStatsCols = []column[GroupStats]{
	i32("size", func(g *GroupStats) *int32 { return &g.Size }),
	i32("expected", func(g *GroupStats) *int32 { return &g.Expected }),
	f64("mean", func(g *GroupStats) *float64 { return &g.Mean }),
	f64("std", func(g *GroupStats) *float64 { return &g.Std }),
	f64("min", func(g *GroupStats) *float64 { return &g.Min }),
	f64("max", func(g *GroupStats) *float64 { return &g.Max }),
	boolean("zero_var", func(g *GroupStats) *bool { return &g.ZeroVar }),
	str("filtered", func(g *GroupStats) *string { return &g.Filtered }),
	boolean("incomplete", func(g *GroupStats) *bool { return &g.Incomplete }),
}

var scoredCols = concatCols(
	liftCols(func(s *Scored) *Rewarded { return &s.Rewarded }, rewardedCols),
	[]column[Scored]{
		listF32("turn_rewards", func(s *Scored) *[]float32 { return &s.TurnRewards }),
		listF32("turn_returns", func(s *Scored) *[]float32 { return &s.TurnReturns }),
		listF32("turn_advantages", func(s *Scored) *[]float32 { return &s.TurnAdvantages }),
		listF32("turn_value_targets", func(s *Scored) *[]float32 { return &s.TurnValueTargets }),
		structOf("group", groupStatsCols, func(s *Scored) *GroupStats { return &s.Group }),
		str("estimator", func(s *Scored) *string { return &s.Estimator }),
		str("estimator_version", func(s *Scored) *string { return &s.EstimatorVersion }),
	},
)
