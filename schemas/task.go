package schemas

// TaskAttempts is the codec of KindTaskAttempt: one row per attempt emitted
// by dispatch (docs/PIPELINE.md §6), one column per field of TaskAttempt.
var TaskAttempts = newCodec[TaskAttempt](KindTaskAttempt)
