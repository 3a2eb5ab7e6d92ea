package schemas

// Trajectories is the codec of KindTrajectory: one row per finalized
// attempt (pipeline §7). Turns is list<struct<turn columns>>; token ids
// are list<int32> and log-probs list<float32>, exactly as sampled.
var Trajectories = newCodec(KindTrajectory, trajectoryCols)

var turnCols = []column[Turn]{
	i32("index", func(t *Turn) *int32 { return &t.Index }),
	listI32("prompt_ids", func(t *Turn) *[]int32 { return &t.PromptIDs }),
	listI32("action_ids", func(t *Turn) *[]int32 { return &t.ActionIDs }),
	listF32("action_logprobs", func(t *Turn) *[]float32 { return &t.ActionLogprobs }),
	i64("policy_version", func(t *Turn) *int64 { return &t.PolicyVersion }),
	str("decision", func(t *Turn) *string { return &t.Decision }),
	str("decision_reason", func(t *Turn) *string { return &t.DecisionReason }),
	listI32("observation_ids", func(t *Turn) *[]int32 { return &t.ObservationIDs }),
	f32("value", func(t *Turn) *float32 { return &t.Value }),
	i64("gen_latency_us", func(t *Turn) *int64 { return &t.GenLatencyUS }),
	i64("env_latency_us", func(t *Turn) *int64 { return &t.EnvLatencyUS }),
}

var trajectoryCols = []column[Trajectory]{
	str("record_id", func(r *Trajectory) *string { return &r.RecordID }),
	str("run_id", func(r *Trajectory) *string { return &r.RunID }),
	str("task_id", func(r *Trajectory) *string { return &r.TaskID }),
	str("task_version", func(r *Trajectory) *string { return &r.TaskVersion }),
	str("domain", func(r *Trajectory) *string { return &r.Domain }),
	str("split", func(r *Trajectory) *string { return &r.Split }),
	str("env_version", func(r *Trajectory) *string { return &r.EnvVersion }),
	str("group_id", func(r *Trajectory) *string { return &r.GroupID }),
	i32("group_size", func(r *Trajectory) *int32 { return &r.GroupSize }),
	i32("member", func(r *Trajectory) *int32 { return &r.Member }),
	i32("attempt", func(r *Trajectory) *int32 { return &r.Attempt }),
	i64("seed", func(r *Trajectory) *int64 { return &r.Seed }),
	str("contract_hash", func(r *Trajectory) *string { return &r.ContractHash }),
	str("sampler_id", func(r *Trajectory) *string { return &r.SamplerID }),
	str("parser_version", func(r *Trajectory) *string { return &r.ParserVersion }),
	str("tokenizer_hash", func(r *Trajectory) *string { return &r.TokenizerHash }),
	str("status", func(r *Trajectory) *string { return &r.Status }),
	str("end", func(r *Trajectory) *string { return &r.End }),
	str("end_reason", func(r *Trajectory) *string { return &r.EndReason }),
	f32("bootstrap_value", func(r *Trajectory) *float32 { return &r.BootstrapValue }),
	str("artifacts", func(r *Trajectory) *string { return &r.Artifacts }),
	i64("started_at_us", func(r *Trajectory) *int64 { return &r.StartedAt }),
	i64("finished_at_us", func(r *Trajectory) *int64 { return &r.FinishedAt }),
	listOf("turns", structOf("item", turnCols, self[Turn]), func(r *Trajectory) *[]Turn { return &r.Turns }),
}
