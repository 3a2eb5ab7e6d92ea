package schemas

// TaskAttempts is the codec of KindTaskAttempt: one row per attempt emitted
// by dispatch (pipeline §6).
var TaskAttempts = newCodec(KindTaskAttempt, taskAttemptCols)

var taskAttemptCols = []column[TaskAttempt]{
	str("attempt_id", func(r *TaskAttempt) *string { return &r.AttemptID }),
	str("run_id", func(r *TaskAttempt) *string { return &r.RunID }),
	str("task_id", func(r *TaskAttempt) *string { return &r.TaskID }),
	str("task_version", func(r *TaskAttempt) *string { return &r.TaskVersion }),
	str("domain", func(r *TaskAttempt) *string { return &r.Domain }),
	str("split", func(r *TaskAttempt) *string { return &r.Split }),
	str("env_version", func(r *TaskAttempt) *string { return &r.EnvVersion }),
	str("group_id", func(r *TaskAttempt) *string { return &r.GroupID }),
	i32("group_size", func(r *TaskAttempt) *int32 { return &r.GroupSize }),
	i32("member", func(r *TaskAttempt) *int32 { return &r.Member }),
	i32("attempt", func(r *TaskAttempt) *int32 { return &r.Attempt }),
	i64("seed", func(r *TaskAttempt) *int64 { return &r.Seed }),
	i64("policy_version", func(r *TaskAttempt) *int64 { return &r.PolicyVersion }),
	str("contract_hash", func(r *TaskAttempt) *string { return &r.ContractHash }),
	i64("dispatched_at_us", func(r *TaskAttempt) *int64 { return &r.DispatchedAt }),
}
