package kafka

import (
	"context"
	"net"
	"runtime/pprof"

	kafkago "github.com/segmentio/kafka-go"
)

// LabelRequests returns a kafka-go transport that gives every request the
// profiler labels ctx carries and passes it to next; next itself when ctx
// carries none.
//
// Why: kafka-go's async writer sends its batches with a context of its
// own, and the connection goroutine that encodes and sends a request takes
// the profiler labels of that request's context. Without labels there, a
// CPU profile of a process running several producers (the operators of
// trajflow bench or the demo, a bench's raw baseline) charges their
// produce requests' encoding, checksums and socket writes to no one.
func LabelRequests(ctx context.Context, next kafkago.RoundTripper) kafkago.RoundTripper {
	var kv []string
	pprof.ForLabels(ctx, func(k, v string) bool {
		kv = append(kv, k, v)
		return true
	})
	if len(kv) == 0 {
		return next
	}
	return labelled{next: next, labels: pprof.Labels(kv...)}
}

// labelled is LabelRequests' transport; its label set is built once.
type labelled struct {
	next   kafkago.RoundTripper
	labels pprof.LabelSet
}

// RoundTrip implements kafkago.RoundTripper.
func (l labelled) RoundTrip(ctx context.Context, addr net.Addr, req kafkago.Request) (kafkago.Response, error) {
	return l.next.RoundTrip(pprof.WithLabels(ctx, l.labels), addr, req)
}
