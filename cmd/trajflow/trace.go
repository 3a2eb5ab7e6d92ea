package main

import (
	"context"
	"fmt"
	"os"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/trajflow/trajflow/internal/buildinfo"
	"github.com/trajflow/trajflow/operators/stagekit"
)

// tracing returns the tracer provider of an operator process: spans are
// exported over OTLP/HTTP to endpoint (a URL such as
// http://127.0.0.1:4318/v1/traces), or to the endpoint the standard
// OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
// variables name; nil (no spans) when neither is set. shutdown flushes
// the spans still queued.
func tracing(ctx context.Context, endpoint, service string) (*sdktrace.TracerProvider, error) {
	if endpoint == "" && os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
		return nil, nil
	}
	var opts []otlptracehttp.Option
	if endpoint != "" {
		opts = append(opts, otlptracehttp.WithEndpointURL(endpoint))
	}
	exp, err := otlptracehttp.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("%w: --otlp-endpoint %q: %w", errUsage, endpoint, err)
	}
	bi := buildinfo.Read()
	res := resource.NewSchemaless(attribute.String("service.name", service), attribute.String("service.version", bi.Version))
	// The attempt spans get ids derived from the attempt (one connected
	// trace per attempt across processes: stagekit.StartAttempt).
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res),
		sdktrace.WithIDGenerator(stagekit.IDGenerator())), nil
}
