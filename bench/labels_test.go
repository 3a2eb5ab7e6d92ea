package bench

import (
	"bytes"
	"context"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/pipeline/contract"
)

// goroutinesLabelled is the goroutine profile's entries (stacks) that carry
// the profiler label role=role.
func goroutinesLabelled(role string) []string {
	var b bytes.Buffer
	_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
	var out []string
	for _, entry := range strings.Split(b.String(), "\n\n") {
		if strings.Contains(entry, `"role":"`+role+`"`) {
			out = append(out, entry)
		}
	}
	return out
}

// TestBaselinesLeaveNoLabelledGoroutine: when the raw baselines end,
// nothing they started runs on under their profiler label, where
// --cpu-roles would charge its CPU in the pipeline's window to the
// baseline (kafka-go's connection pool refreshes the metadata in a
// goroutine of its own until its transport is closed).
func TestBaselinesLeaveNoLabelledGoroutine(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a bench of about 10 s")
	}
	c, err := contract.Load("../testdata/contracts/bench.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	afterBaselines = func() {
		// What the baselines' Close calls end may take a moment to return.
		for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if left = goroutinesLabelled("baseline"); len(left) == 0 || time.Now().After(deadline) {
				return
			}
		}
	}
	t.Cleanup(func() { afterBaselines = nil })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := Run(ctx, Config{Contract: c, Warmup: 500 * time.Millisecond, Duration: time.Second, Baseline: 2 * time.Second,
		Baselines: []string{ClientKafkaGo, ClientFranzGo}, MemoryLimit: -1}); err != nil {
		t.Fatal(err)
	}
	if len(left) > 0 {
		t.Errorf("%d goroutines labelled role=baseline after the baselines:\n%s", len(left), strings.Join(left, "\n\n"))
	}
}
