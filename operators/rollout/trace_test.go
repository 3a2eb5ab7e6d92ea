package rollout

import (
	"context"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/trajflow/trajflow/operators/stagekit"
)

// Each turn of the agent loop is a generation span under the caller's
// span, and each environment step a span in its attempt's trace (the
// trace id every record of the attempt carries).
func TestAgentLoopSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	ctx, root := tp.Tracer("test").Start(context.Background(), "process")
	reg := testRegistry(t)
	atts := attemptsOf(reg, reg.Train()[:2], 2)
	trajs, err := reg.RunEpisodes(ctx, randomPolicy(t, 2), atts, DefaultSettings(reg), fixedLimits())
	if err != nil {
		t.Fatal(err)
	}
	root.End()
	turns, steps := 0, map[string]int{}
	for _, tr := range trajs {
		turns = max(turns, len(tr.Turns))
		steps[tr.RecordID] = len(tr.Turns)
	}
	gen := 0
	got := map[string]int{}
	for _, s := range rec.Ended() {
		switch s.Name() {
		case "rollout generate":
			gen++
			if s.Parent().SpanID() != root.SpanContext().SpanID() || s.SpanContext().TraceID() != root.SpanContext().TraceID() {
				t.Errorf("generation span not under the caller's span")
			}
		case "rollout env step":
			var id string
			for _, a := range s.Attributes() {
				if a.Key == "trajflow.attempt_id" {
					id = a.Value.AsString()
				}
			}
			if want := stagekit.TraceParent(id)[3:35]; s.SpanContext().TraceID().String() != want {
				t.Errorf("env step of %s in trace %s, want the attempt's %s", id, s.SpanContext().TraceID(), want)
			}
			got[id]++
		}
	}
	if turns == 0 || gen != turns {
		t.Errorf("%d generation spans for %d turns", gen, turns)
	}
	for id, n := range steps {
		if got[id] != n {
			t.Errorf("attempt %s: %d env step spans for %d turns", id, got[id], n)
		}
	}
}
