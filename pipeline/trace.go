package pipeline

import (
	"context"
	"strconv"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/trajflow/trajflow/schemas"
)

// TracerName is the instrumentation scope of the runtime's spans.
const TracerName = "github.com/trajflow/trajflow/pipeline"

// headerCarrier reads a record's headers as a W3C trace-context carrier.
type headerCarrier []Header

func (c headerCarrier) Get(key string) string {
	v := ""
	for _, h := range c {
		if h.Key == key {
			v = string(h.Value)
		}
	}
	return v
}

func (c headerCarrier) Set(string, string) {} // never written through: outputs carry their own traceparent

func (c headerCarrier) Keys() []string {
	out := make([]string, len(c))
	for i, h := range c {
		out[i] = h.Key
	}
	return out
}

// tracer is the operator's tracer: cfg.TracerProvider's, else the global
// one (a no-op unless a program installed one, e.g. trajflow run with
// OTEL_EXPORTER_OTLP_ENDPOINT).
func (o *Operator) tracer() trace.Tracer {
	tp := o.cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(TracerName)
}

type providerKey struct{}

// TracerProvider is the tracer provider of the operator that runs a
// stage's Process or Tick under ctx (Config.TracerProvider), nil when the
// operator was given none: the spans a stage starts itself
// (stagekit.StartAttempt) come from it.
func TracerProvider(ctx context.Context) trace.TracerProvider {
	tp, _ := ctx.Value(providerKey{}).(trace.TracerProvider)
	return tp
}

// withProvider is ctx carrying the operator's configured tracer
// provider, for TracerProvider.
func (o *Operator) withProvider(ctx context.Context) context.Context {
	if o.cfg.TracerProvider == nil {
		return ctx
	}
	return context.WithValue(ctx, providerKey{}, o.cfg.TracerProvider)
}

// startSpan starts the span of the stage's processing of m, a child of
// the span m's traceparent names (the trace id is that of the record:
// its attempt's for the records of one attempt), so that the spans of
// every stage that handled it join one trace across processes.
func (o *Operator) startSpan(ctx context.Context, tr trace.Tracer, m *Message) (context.Context, trace.Span) {
	ctx = propagation.TraceContext{}.Extract(o.withProvider(ctx), headerCarrier(m.Headers))
	return tr.Start(ctx, o.stage.Name()+" process", trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			attribute.String("trajflow.stage", o.stage.Name()),
			attribute.String("messaging.destination.name", m.Topic),
			attribute.String("messaging.kafka.partition", strconv.Itoa(m.Partition)),
			attribute.Int64("messaging.kafka.offset", m.Offset),
			attribute.String("trajflow.record_id", headerCarrier(m.Headers).Get(schemas.HeaderID)),
		))
}

// endSpan ends span with the outcome of Process.
func endSpan(span trace.Span, res *Result, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.SetAttributes(attribute.Int("trajflow.outputs", len(res.Outputs)))
	span.End()
}
