package schemas

// RewardComponents is the codec of KindRewardComponent: one row per
// separately kept, versioned reward term (pipeline §8).
var RewardComponents = newCodec[RewardComponent](KindRewardComponent)
