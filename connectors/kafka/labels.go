package kafka

import (
	"context"
	"net"
	"runtime/pprof"

	kafkago "github.com/segmentio/kafka-go"
)

// ProfileLabels is a kafka-go transport that gives every request the
// profiler labels Labels (key/value pairs; none: requests pass unchanged)
// and passes it to Next.
//
// Why: kafka-go's async writer sends its batches with a context of its
// own, and the connection goroutine that encodes and sends a request takes
// the profiler labels of that request's context. Without labels there, a
// CPU profile of a process running several producers (the operators of
// trajflow bench or the demo, a bench's raw baseline) charges their
// produce requests' encoding, checksums and socket writes to no one.
type ProfileLabels struct {
	Next   kafkago.RoundTripper
	Labels []string
}

// RoundTrip implements kafkago.RoundTripper.
func (p ProfileLabels) RoundTrip(ctx context.Context, addr net.Addr, req kafkago.Request) (kafkago.Response, error) {
	if len(p.Labels) > 0 {
		ctx = pprof.WithLabels(ctx, pprof.Labels(p.Labels...))
	}
	return p.Next.RoundTrip(ctx, addr, req)
}

// ContextLabels are the profiler labels ctx carries, as key/value pairs
// (for ProfileLabels).
func ContextLabels(ctx context.Context) []string {
	var kv []string
	pprof.ForLabels(ctx, func(k, v string) bool {
		kv = append(kv, k, v)
		return true
	})
	return kv
}
