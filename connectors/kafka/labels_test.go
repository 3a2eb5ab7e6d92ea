package kafka

import (
	"context"
	"net"
	"runtime/pprof"
	"slices"
	"testing"

	kafkago "github.com/segmentio/kafka-go"
)

// roleSeen records the "role" and "instance" profiler labels of each
// request's context.
type roleSeen struct{ roles []string }

func (r *roleSeen) RoundTrip(ctx context.Context, _ net.Addr, _ kafkago.Request) (kafkago.Response, error) {
	role, _ := pprof.Label(ctx, "role")
	inst, _ := pprof.Label(ctx, "instance")
	r.roles = append(r.roles, role+"/"+inst)
	return nil, nil
}

// TestLabelRequests: requests passed on with the labels of the context
// the transport was built from, whatever context the caller (kafka-go's
// async writer) sends them with; built from an unlabelled context, the
// transport is the next one itself and adds none.
func TestLabelRequests(t *testing.T) {
	seen := &roleSeen{}
	var tr kafkago.RoundTripper
	pprof.Do(context.Background(), pprof.Labels("role", "reward", "instance", "reward-1"), func(ctx context.Context) {
		tr = LabelRequests(ctx, seen)
	})
	plain := LabelRequests(context.Background(), seen)
	if plain != kafkago.RoundTripper(seen) {
		t.Errorf("built from an unlabelled context: %T, want the next transport itself", plain)
	}
	for _, tr := range []kafkago.RoundTripper{tr, plain} {
		if _, err := tr.RoundTrip(context.Background(), nil, nil); err != nil {
			t.Fatal(err)
		}
	}
	if !slices.Equal(seen.roles, []string{"reward/reward-1", "/"}) {
		t.Errorf("requests carried labels %q, want the labelled context's, then none", seen.roles)
	}
}
