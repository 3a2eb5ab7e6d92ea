package testkit

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/trajflow/trajflow/internal/loop"
)

// Demo runs the demo loop in process (internal/loop) with o, quietly, in a
// temporary output folder unless o.Out names one and with one evaluation
// sample unless o.EvalSamples says otherwise, and returns its summary. It
// fails the test when the loop fails or takes more than 90 s, loses or
// admits twice any attempt, or launches other than 16 groups of 16
// attempts per update or one batch per update.
func Demo(t testing.TB, o loop.Options) *loop.Summary {
	t.Helper()
	if o.Out == "" {
		o.Out = t.TempDir()
	}
	if o.EvalSamples == 0 {
		o.EvalSamples = 1
	}
	o.Quiet = true
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	s, err := loop.Run(ctx, o, io.Discard)
	if err != nil {
		t.Fatalf("demo: %v", err)
	}
	if s.Lost != 0 || s.DuplicatesAdmitted != 0 {
		t.Fatalf("lost %d, duplicates %d", s.Lost, s.DuplicatesAdmitted)
	}
	if s.AttemptsLaunched != o.Updates*16*16 || len(s.BatchHashes) != s.Updates {
		t.Fatalf("%d attempts launched, %d batches for %d updates", s.AttemptsLaunched, len(s.BatchHashes), s.Updates)
	}
	return s
}
