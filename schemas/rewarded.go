package schemas

// RewardedTrajectories is the codec of KindRewarded: every trajectory
// column, then `rewards` (list<struct<reward component columns>>) and
// `reward_total`.
var RewardedTrajectories = newCodec(KindRewarded, rewardedCols)

var rewardedCols = concatCols(
	liftCols(func(r *Rewarded) *Trajectory { return &r.Trajectory }, trajectoryCols),
	[]column[Rewarded]{
		listOf("rewards", structOf("item", rewardComponentCols, self[RewardComponent]),
			func(r *Rewarded) *[]RewardComponent { return &r.Rewards }),
		f64("reward_total", func(r *Rewarded) *float64 { return &r.RewardTotal }),
	},
)
