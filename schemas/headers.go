package schemas

// Kafka record headers. Every name a trajflow record carries is declared
// here, with its meaning; `trajflow schemas` prints them.
const (
	// HeaderKind and HeaderVersion name the record kind and its version
	// (they must agree with the body: a record whose headers disagree with
	// its body is quarantined as header_mismatch).
	HeaderKind    = "trajflow-kind"
	HeaderVersion = "trajflow-version"
	// HeaderID is the record's deterministic id: a pure function of its
	// content's ids, so a redelivered input reproduces it.
	HeaderID = "trajflow-id"
	// HeaderTrace is the W3C trace context; the trace id is the attempt's
	// id (docs/SYSTEMS.md §15), so every record of one attempt joins one trace.
	HeaderTrace = "traceparent"
	// HeaderRound names the update round of a tasks message (dispatch).
	HeaderRound = "trajflow-round"
	// HeaderAbsent declares group members refused upstream (validate,
	// reward) that will never reach the advantage stage: a JSON object
	// from group id to the refused member indices, keys sorted, indices
	// ascending and distinct, e.g. {"g-17":[2,5]} (docs/PIPELINE.md §9 "group
	// completeness or declared partial-group policy").
	HeaderAbsent = "trajflow-absent-members"
	// HeaderSourceRow is the row index a quarantined single row had in its
	// original multi-row message.
	HeaderSourceRow = "trajflow-source-row"
	// HeaderWindowCost is, on a packed batch, the cost of the episodes
	// decided in the pack windows of its batch index (WindowCost as JSON):
	// metadata outside the batch's bytes, which stay a pure function of
	// the admitted records while latencies are measured.
	HeaderWindowCost = "trajflow-window-cost"
)

// Quarantine headers: a quarantine record holds the refused record's key,
// bytes and headers as they were, plus these.
const (
	HeaderReason          = "trajflow-reason" // machine-readable refusal code
	HeaderDetail          = "trajflow-detail" // what is wrong, naming the field
	HeaderStage           = "trajflow-stage"  // the stage that refused it
	HeaderSourceTopic     = "trajflow-source-topic"
	HeaderSourcePartition = "trajflow-source-partition"
	HeaderSourceOffset    = "trajflow-source-offset"
)

// HeaderDoc describes every header, in the order `trajflow schemas`
// prints them.
var HeaderDoc = []struct{ Name, Doc string }{
	{HeaderKind, "record kind (must agree with the body)"},
	{HeaderVersion, "schema version of the kind (must agree with the body)"},
	{HeaderID, "deterministic record id (a function of the content's ids)"},
	{HeaderTrace, "W3C traceparent; trace id = the attempt id"},
	{HeaderRound, "update round of a tasks message"},
	{HeaderAbsent, `group members refused upstream, JSON {"group id":[member,...]}`},
	{HeaderSourceRow, "row index of a quarantined row in its original message"},
	{HeaderWindowCost, `packed batch: cost of its windows' episodes, JSON {"windows","admitted","filtered"}`},
	{HeaderReason, "quarantine: refusal reason code"},
	{HeaderDetail, "quarantine: what is wrong, naming the field"},
	{HeaderStage, "quarantine: the refusing stage"},
	{HeaderSourceTopic, "quarantine: topic of the refused record"},
	{HeaderSourcePartition, "quarantine: partition of the refused record"},
	{HeaderSourceOffset, "quarantine: offset of the refused record"},
}
