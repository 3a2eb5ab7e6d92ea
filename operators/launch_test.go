package operators_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

func quiet() operators.Restarts {
	return operators.Restarts{Max: -1, Backoff: time.Millisecond, MaxBackoff: time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
}

// TestRunRestartingRetriesOnlyRuntimeErrors: a failure of the operator is
// retried until it runs; a configuration error is returned at once.
func TestRunRestartingRetriesOnlyRuntimeErrors(t *testing.T) {
	calls := 0
	err := operators.RunRestarting(context.Background(), quiet(), func(context.Context) error {
		calls++
		if calls < 3 {
			return errors.New("brokers unreachable")
		}
		return nil
	})
	if err != nil || calls != 3 {
		t.Fatalf("runtime failures: %d calls, %v; want 3 calls and nil", calls, err)
	}

	calls = 0
	cfgErr := fmt.Errorf("%w: a stage refuses its options", operators.ErrConfig)
	err = operators.RunRestarting(context.Background(), quiet(), func(context.Context) error {
		calls++
		return cfgErr
	})
	if !errors.Is(err, operators.ErrConfig) || calls != 1 {
		t.Fatalf("configuration error: %d calls, %v; want 1 call", calls, err)
	}

	calls = 0
	p := quiet()
	p.Max = 2
	err = operators.RunRestarting(context.Background(), p, func(context.Context) error {
		calls++
		return errors.New("still failing")
	})
	if err == nil || calls != 3 {
		t.Fatalf("bounded restarts: %d calls, %v; want 3 calls and the error", calls, err)
	}
}

// TestLaunchErrorsAreConfigurationErrors: what New and NewOperator refuse
// wraps ErrConfig, so no restart loop retries it.
func TestLaunchErrorsAreConfigurationErrors(t *testing.T) {
	c := contract.Default()
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	d, err := operators.BuiltinDeps(c)
	if err != nil {
		t.Fatal(err)
	}
	cases := map[string]func() error{
		"unknown stage": func() error { _, err := operators.New("bogus", d); return err },
		"train without releases": func() error {
			_, err := operators.NewOperator("train", d, pipeline.Config{Brokers: []string{"127.0.0.1:1"}})
			return err
		},
		"snapshot without a directory": func() error { _, err := operators.New("snapshot", d); return err },
		"no brokers": func() error {
			_, err := operators.NewOperator("validate", d, pipeline.Config{})
			return err
		},
		"unknown device": func() error {
			dd := d
			dd.ReleaseDir, dd.Device = t.TempDir(), "tpu"
			_, err := operators.New("train", dd)
			return err
		},
	}
	for name, f := range cases {
		if err := f(); !errors.Is(err, operators.ErrConfig) {
			t.Errorf("%s: %v, want an error wrapping ErrConfig", name, err)
		}
	}
	if _, err := operators.New("bogus", d); !errors.Is(err, operators.ErrUnknownStage) {
		t.Errorf("unknown stage: %v, want ErrUnknownStage", err)
	}
}
