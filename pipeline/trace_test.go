package pipeline

import (
	"context"
	"encoding/hex"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/trajflow/trajflow/internal/otlptest"
)

// Every record an operator processes is a span exported over OTLP, in
// the trace and under the span its traceparent names; a record without
// one starts a trace of its own.
func TestOperatorSpansJoinTheRecordsTrace(t *testing.T) {
	recv := otlptest.NewOTLPReceiver(t)
	exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(recv.URL()+"/v1/traces"))
	if err != nil {
		t.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	addr := startCluster(t, "in", "out", "quarantine")
	const traceID, parentID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(addr), Topic: "in", RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond, Transport: tr}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = w.WriteMessages(ctx,
		kafka.Message{Key: []byte("k"), Value: []byte("a"), Headers: []kafka.Header{{Key: "traceparent", Value: []byte("00-" + traceID + "-" + parentID + "-01")}}},
		kafka.Message{Key: []byte("k"), Value: []byte("b")})
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(addr)
	cfg.TracerProvider = tp
	op, err := NewOperator(cfg, upper{})
	if err != nil {
		t.Fatal(err)
	}
	runUntil(t, op, func() bool { return len(recv.Spans()) >= 2 })
	if err := tp.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	var joined, own int
	for _, s := range recv.Spans() {
		if s.GetName() != "upper process" || s.GetKind() != tracepb.Span_SPAN_KIND_CONSUMER {
			t.Errorf("span %q kind %v", s.GetName(), s.GetKind())
		}
		switch hex.EncodeToString(s.GetTraceId()) {
		case traceID:
			joined++
			if p := hex.EncodeToString(s.GetParentSpanId()); p != parentID {
				t.Errorf("span of the traced record has parent %s, want %s", p, parentID)
			}
		default:
			own++
			if len(s.GetParentSpanId()) != 0 {
				t.Errorf("span of the untraced record has a parent")
			}
		}
	}
	if joined != 1 || own != 1 {
		t.Fatalf("%d spans in the record's trace, %d of their own; want 1 and 1", joined, own)
	}
}
