package schemas

// RewardedTrajectories is the codec of KindRewarded: every trajectory
// column, then `rewards` (list<struct<...>> of the RewardComponent fields)
// and `reward_total`.
var RewardedTrajectories = newCodec[Rewarded](KindRewarded)
