package schemas

// RewardComponents is the codec of KindRewardComponent: one row per
// separately kept, versioned reward term (docs/PIPELINE.md §8).
var RewardComponents = newCodec[RewardComponent](KindRewardComponent)
