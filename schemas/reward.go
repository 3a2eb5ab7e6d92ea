package schemas

// RewardComponents is the codec of KindRewardComponent: one row per
// separately kept, versioned reward term (pipeline §8).
var RewardComponents = newCodec(KindRewardComponent, rewardComponentCols)

var rewardComponentCols = []column[RewardComponent]{
	str("trajectory_id", func(r *RewardComponent) *string { return &r.TrajectoryID }),
	str("name", func(r *RewardComponent) *string { return &r.Name }),
	str("version", func(r *RewardComponent) *string { return &r.Version }),
	f64("raw", func(r *RewardComponent) *float64 { return &r.Raw }),
	f64("weight", func(r *RewardComponent) *float64 { return &r.Weight }),
	str("transform", func(r *RewardComponent) *string { return &r.Transform }),
	f64("value", func(r *RewardComponent) *float64 { return &r.Value }),
	str("scope", func(r *RewardComponent) *string { return &r.Scope }),
	i32("turn", func(r *RewardComponent) *int32 { return &r.Turn }),
	i32("span_start", func(r *RewardComponent) *int32 { return &r.SpanStart }),
	i32("span_end", func(r *RewardComponent) *int32 { return &r.SpanEnd }),
	str("evaluator_version", func(r *RewardComponent) *string { return &r.EvaluatorVersion }),
	str("evidence", func(r *RewardComponent) *string { return &r.Evidence }),
	str("error", func(r *RewardComponent) *string { return &r.Error }),
	f64("uncertainty", func(r *RewardComponent) *float64 { return &r.Uncertainty }),
}
