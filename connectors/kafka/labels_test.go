package kafka

import (
	"context"
	"net"
	"runtime/pprof"
	"slices"
	"testing"

	kafkago "github.com/segmentio/kafka-go"
)

// roleSeen records the "role" profiler label of each request's context.
type roleSeen struct{ roles []string }

func (r *roleSeen) RoundTrip(ctx context.Context, _ net.Addr, _ kafkago.Request) (kafkago.Response, error) {
	role, _ := pprof.Label(ctx, "role")
	r.roles = append(r.roles, role)
	return nil, nil
}

// TestProfileLabels: requests passed on with the labels of the context
// the transport was built from, whatever context the caller (kafka-go's
// async writer) sends them with; built from an unlabelled context, it adds
// none.
func TestProfileLabels(t *testing.T) {
	var labels []string
	pprof.Do(context.Background(), pprof.Labels("role", "reward", "instance", "reward-1"), func(ctx context.Context) {
		labels = ContextLabels(ctx)
	})
	if !slices.Equal(labels, []string{"instance", "reward-1", "role", "reward"}) && !slices.Equal(labels, []string{"role", "reward", "instance", "reward-1"}) {
		t.Fatalf("ContextLabels = %v, want role reward and instance reward-1", labels)
	}
	seen := &roleSeen{}
	for _, tr := range []ProfileLabels{{Next: seen, Labels: labels}, {Next: seen, Labels: ContextLabels(context.Background())}} {
		if _, err := tr.RoundTrip(context.Background(), nil, nil); err != nil {
			t.Fatal(err)
		}
	}
	if !slices.Equal(seen.roles, []string{"reward", ""}) {
		t.Errorf("requests carried roles %q, want the labelled context's, then none", seen.roles)
	}
}
