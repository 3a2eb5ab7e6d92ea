package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/schemas"
)

// TestNoContractNotice: every command that takes --contract says on
// stderr which contract it uses when none is given.
func TestNoContractNotice(t *testing.T) {
	const notice = "no --contract: using the built-in demo contract (testdata/contracts/demo.yaml)"
	_, c := testContractFile(t)
	dir := t.TempDir()
	in := filepath.Join(dir, "trajectories.arrow")
	testWriteBatches(t, schemas.Trajectories, in, synthGroups(c, 0, 1, 0))
	cases := [][]string{
		{"stage", "validate", "--in", in, "--out", filepath.Join(dir, "valid.arrow")},
		// train without --releases stops at once with a configuration error.
		{"run", "train", "--brokers", "127.0.0.1:1", "--state", t.TempDir()},
		{"topics", "create", "--brokers", "127.0.0.1:1", "--wait", "1s"},
	}
	for _, args := range cases {
		var stdout, stderr bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		run(ctx, args, &stdout, &stderr)
		cancel()
		if !strings.Contains(stderr.String(), notice) {
			t.Errorf("trajflow %s: stderr %q lacks %q", strings.Join(args[:2], " "), stderr.String(), notice)
		}
	}
}

// TestRunConfigurationErrors: an unknown stage, a bad --device or a
// missing required directory exits with status 2 at once (never retried
// by the restart loop), naming the problem; `run --help` lists the stages.
func TestRunConfigurationErrors(t *testing.T) {
	cases := []struct {
		args []string
		want []string
	}{
		{[]string{"run", "bogus"}, operators.Names()},
		{[]string{"run", "train", "--brokers", "127.0.0.1:1", "--state", t.TempDir()}, []string{"--releases"}},
		{[]string{"run", "train", "--device", "gpu", "--brokers", "127.0.0.1:1", "--state", t.TempDir()}, []string{"--device", "cpu or cuda"}},
	}
	for _, tc := range cases {
		var stdout, stderr bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		start := time.Now()
		code := run(ctx, tc.args, &stdout, &stderr)
		took := time.Since(start)
		cancel()
		if code != 2 || took > 2*time.Second {
			t.Errorf("trajflow %v: exit %d after %v, want 2 at once; stderr %s", tc.args, code, took, stderr.String())
		}
		for _, w := range tc.want {
			if !strings.Contains(stderr.String(), w) {
				t.Errorf("trajflow %v: stderr lacks %q: %s", tc.args, w, stderr.String())
			}
		}
	}
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"run", "--help"}, &stdout, &stderr); code != 0 {
		t.Fatalf("run --help: exit %d", code)
	}
	help := stdout.String() + stderr.String()
	for _, s := range operators.Specs() {
		if !strings.Contains(help, s.Name) || !strings.Contains(help, s.Doc) {
			t.Errorf("run --help lacks stage %s (%s):\n%s", s.Name, s.Doc, help)
		}
	}
	if !strings.Contains(help, "-device") {
		t.Errorf("run --help lacks --device:\n%s", help)
	}
}
