package schemas

// Trajectories is the codec of KindTrajectory: one row per finalized
// attempt (docs/PIPELINE.md §7). Turns is list<struct<...>> of the Turn fields;
// token ids are list<int32> and log-probs list<float32>, exactly as
// sampled (docs/PIPELINE.md §5, §7).
var Trajectories = newCodec[Trajectory](KindTrajectory)
