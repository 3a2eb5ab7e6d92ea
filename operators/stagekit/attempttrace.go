package stagekit

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"math/rand/v2"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Attempt traces (docs/SYSTEMS.md §15). Every attempt has one trace, whose
// id is derived from the attempt id, and every stage that handles the
// attempt records one span in it, "STAGE attempt": dispatch's is the
// root, and each later stage's is the child of the span of the stage
// before it (rollout of dispatch, validate of rollout, … train of pack).
// Span ids are derived from the stage and the attempt id, so a stage in
// another process names its parent without anything on the wire, and a
// stage that handles a group or a batch of attempts at once (advantage,
// pack, train) still continues each attempt's own trace. Each attempt
// span links to the span of the record's processing that carried it (the
// runtime's "STAGE process" span, in the record's trace).
//
// The derived span ids need the tracer provider to take ids from the
// context: build it with sdktrace.WithIDGenerator(IDGenerator()), as
// `trajflow run` does. Under another provider the attempt spans still
// share the attempt's trace id (except dispatch's root), but their parent
// links do not resolve.

// TracerName is the instrumentation scope of the attempt spans.
const TracerName = "github.com/trajflow/trajflow/operators"

// AttemptTraceID is the trace id of attempt id: the trace id of
// TraceParent(id).
func AttemptTraceID(attemptID string) trace.TraceID {
	var t trace.TraceID
	_, _ = hex.Decode(t[:], []byte(TraceParent(attemptID)[3:35]))
	return t
}

// AttemptSpanID is the id of stage's span in the trace of attempt id.
func AttemptSpanID(stage, attemptID string) trace.SpanID {
	var s trace.SpanID
	_, _ = hex.Decode(s[:], []byte(schemas.DerivedID("span/"+stage, attemptID)[:16]))
	return s
}

// AttemptParent is the traceparent of stage's span of attempt attemptID:
// the parent a record about the attempt that stage emits (a census event,
// an incident, a quarantined row) names, so that its processing joins
// the attempt's trace under that span.
func AttemptParent(stage, attemptID string) string {
	return "00-" + AttemptTraceID(attemptID).String() + "-" + AttemptSpanID(stage, attemptID).String() + "-01"
}

// wantIDs are the ids the next span started under a context should get.
type wantIDs struct {
	trace trace.TraceID
	span  trace.SpanID
}

type wantKey struct{}

// IDGenerator is the span and trace id generator of trajflow's tracer
// providers: random ids, except for the attempt spans StartAttempt
// starts, which get their derived ids.
func IDGenerator() sdktrace.IDGenerator { return idGenerator{} }

type idGenerator struct{}

func (idGenerator) NewIDs(ctx context.Context) (trace.TraceID, trace.SpanID) {
	if w, ok := ctx.Value(wantKey{}).(wantIDs); ok {
		return w.trace, w.span
	}
	var t trace.TraceID
	for !t.IsValid() {
		binary.BigEndian.PutUint64(t[:8], rand.Uint64())
		binary.BigEndian.PutUint64(t[8:], rand.Uint64())
	}
	return t, randomSpanID()
}

func (idGenerator) NewSpanID(ctx context.Context, traceID trace.TraceID) trace.SpanID {
	if w, ok := ctx.Value(wantKey{}).(wantIDs); ok && w.trace == traceID {
		return w.span
	}
	return randomSpanID()
}

func randomSpanID() trace.SpanID {
	var s trace.SpanID
	for !s.IsValid() {
		binary.BigEndian.PutUint64(s[:], rand.Uint64())
	}
	return s
}

// StartAttempt starts stage's span of attempt attemptID in the attempt's
// trace: its root when after is "" (dispatch), else the child of stage
// after's span of the attempt. The span is made by the operator's tracer
// provider (pipeline.TracerProvider) and links to ctx's span, the
// processing of the record that carries the attempt; when the operator
// has no tracer provider the returned span records nothing and costs
// nothing.
func StartAttempt(ctx context.Context, stage, after, attemptID string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	tp := pipeline.TracerProvider(ctx)
	if tp == nil {
		return ctx, trace.SpanFromContext(context.Background())
	}
	tid := AttemptTraceID(attemptID)
	sctx := context.WithValue(ctx, wantKey{}, wantIDs{tid, AttemptSpanID(stage, attemptID)})
	opts = append(opts, trace.WithAttributes(attribute.String("trajflow.attempt_id", attemptID), attribute.String("trajflow.stage", stage)))
	if cur := trace.SpanContextFromContext(ctx); cur.IsValid() {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: cur}))
	}
	if after == "" {
		opts = append(opts, trace.WithNewRoot())
	} else {
		sctx = trace.ContextWithRemoteSpanContext(sctx, trace.NewSpanContext(trace.SpanContextConfig{
			TraceID: tid, SpanID: AttemptSpanID(after, attemptID), TraceFlags: trace.FlagsSampled, Remote: true,
		}))
	}
	return tp.Tracer(TracerName).Start(sctx, stage+" attempt", opts...)
}

// TraceAttempts records stage's span of each of n attempts (StartAttempt
// with after; id(i) is the i-th attempt's id), from start to now: for a
// stage that handles the attempts of one record together, typically
// deferred at the top of its Process. attrs are set on every span.
func TraceAttempts(ctx context.Context, stage, after string, start time.Time, n int, id func(i int) string, attrs ...attribute.KeyValue) {
	if pipeline.TracerProvider(ctx) == nil {
		return
	}
	for i := range n {
		_, span := StartAttempt(ctx, stage, after, id(i), trace.WithTimestamp(start), trace.WithAttributes(attrs...))
		span.End()
	}
}

// TraceAttempt is TraceAttempts of the one attempt id.
func TraceAttempt(ctx context.Context, stage, after string, start time.Time, id string, attrs ...attribute.KeyValue) {
	TraceAttempts(ctx, stage, after, start, 1, func(int) string { return id }, attrs...)
}
