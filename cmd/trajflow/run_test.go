package main

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/bench"
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
		// A state directory that is a file stops the operator at once,
		// after the contract is read.
		{"run", "train", "--brokers", "127.0.0.1:1", "--releases", t.TempDir(), "--state", in},
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
		// A health address no listener takes: the command line's mistake,
		// not a failure up would restart for ever.
		{[]string{"run", "validate", "--brokers", "127.0.0.1:1", "--health", "127.0.0.1:99999"}, []string{"--health", "invalid port"}},
		{[]string{"run", "validate", "--brokers", "127.0.0.1:1", "--health", "bogus"}, []string{`--health "bogus"`, "HOST:PORT"}},
		{[]string{"run", "validate", "--brokers", "127.0.0.1:1", "--health", ""}, []string{`--health ""`}},
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

// TestOperatorLinger: --linger is the operator runtime's producer batch
// timeout, `trajflow up` hands its --linger to every operator it starts,
// and a negative one is a command-line error.
func TestOperatorLinger(t *testing.T) {
	parse := func(args ...string) (*operatorEnv, error) {
		fs := newFlags("run", &bytes.Buffer{})
		of := addOperatorFlags(fs)
		if _, err := parseFlags(fs, append([]string{"--brokers", "127.0.0.1:9"}, args...)); err != nil {
			t.Fatal(err)
		}
		env, err := of.env("validate", &bytes.Buffer{})
		if err == nil {
			t.Cleanup(env.cleanup)
		}
		return env, err
	}
	env, err := parse()
	if err != nil || env.cfg.BatchTimeout != 0 {
		t.Fatalf("no --linger: batch timeout %v (want 0, the runtime's default), err %v", env.cfg.BatchTimeout, err)
	}
	f := &fleetProcs{brokers: "127.0.0.1:9", out: t.TempDir(), level: "info", linger: 25 * time.Millisecond}
	args := f.args("pack", "127.0.0.1:0")
	i := slices.Index(args, "--linger")
	if i < 0 || i+1 >= len(args) {
		t.Fatalf("up's operator command line %q has no --linger", args)
	}
	if env, err = parse(args[i : i+2]...); err != nil || env.cfg.BatchTimeout != 25*time.Millisecond {
		t.Fatalf("--linger %s: batch timeout %v, err %v", args[i+1], env.cfg.BatchTimeout, err)
	}
	if _, err := parse("--linger", "-1ms"); !errors.Is(err, errUsage) || !strings.Contains(err.Error(), "--linger") {
		t.Fatalf("--linger -1ms: err %v, want a usage error naming --linger", err)
	}
	if args := (&fleetProcs{out: t.TempDir()}).args("pack", "127.0.0.1:0"); slices.Contains(args, "--linger") {
		t.Fatalf("up without --linger passes one: %q", args)
	}
}

// TestRunFlagsRefused: a log level, a duration, a size or a count that
// means nothing, a flag of another stage, a malformed broker list or
// address, a tracing endpoint that is no URL and a client config that is
// not there exit 2 at once naming the flag, before the operator starts.
func TestRunFlagsRefused(t *testing.T) {
	_, missing := testFile(t)
	for _, c := range []refusalCase{
		{[]string{"validate", "--log-level", "bogus"}, []string{`--log-level "bogus"`}},
		{[]string{"advantage", "--partial-group-timeout", "-1s"}, []string{"--partial-group-timeout -1s"}},
		{[]string{"pack", "--window-max-wait", "-1s"}, []string{"--window-max-wait -1s"}},
		{[]string{"snapshot", "--snapshot-roll-bytes", "-1"}, []string{"--snapshot-roll-bytes -1"}},
		{[]string{"snapshot", "--snapshot-roll-interval", "-1s"}, []string{"--snapshot-roll-interval -1s"}},
		{[]string{"validate", "--restarts", "-2"}, []string{"--restarts -2"}},
		{[]string{"eval", "--eval-samples", "4294967297"}, []string{"--eval-samples 4294967297"}},
		{[]string{"validate", "--partial-group-timeout", "1s"}, []string{"--partial-group-timeout 1s", "advantage", "not of validate"}},
		{[]string{"validate", "--window-max-wait", "1s"}, []string{"--window-max-wait 1s", "pack"}},
		{[]string{"validate", "--snapshot-dir", t.TempDir()}, []string{"--snapshot-dir", "snapshot"}},
		{[]string{"validate", "--eval-samples", "7"}, []string{"--eval-samples 7", "eval"}},
		{[]string{"validate", "--gated"}, []string{"--gated", "dispatch"}},
		{[]string{"validate", "--device", "cpu"}, []string{"--device cpu", "train"}},
		{[]string{"train", "--device", "cuda:x"}, []string{`--device "cuda:x"`}},
		{[]string{"train"}, []string{"run train needs --releases"}},
		{[]string{"eval"}, []string{"run eval needs --releases"}},
		{[]string{"snapshot"}, []string{"run snapshot needs --snapshot-dir"}},
		{[]string{"validate", "--otlp-endpoint", "::bad"}, []string{`--otlp-endpoint "::bad"`}},
		{[]string{"validate", "--client-config", missing}, []string{"--client-config"}},
		{[]string{"validate", "--brokers", "127.0.0.1:1,,"}, []string{"--brokers", "item 2 is empty"}},
		{[]string{"validate", "--brokers", "nohost"}, []string{`--brokers "nohost"`}},
		{[]string{"validate", "--brokers", "127.0.0.1:99999"}, []string{"--brokers", "99999"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			args := append([]string{"run", c.args[0], "--brokers", "127.0.0.1:1", "--state", t.TempDir()}, c.args[1:]...)
			wantRefused(t, args, c.want...)
		})
	}
}

// TestRunStageFlagsOfCallers: the operator command lines that trajflow up
// and bench --processes write give every stage only flags it reads (run
// refuses another stage's).
func TestRunStageFlagsOfCallers(t *testing.T) {
	check := func(who string, args []string) {
		t.Helper()
		fs := newFlags("run", &bytes.Buffer{})
		of := addOperatorFlags(fs)
		pos, err := parseFlags(fs, args[1:])
		if err != nil || len(pos) != 1 {
			t.Fatalf("%s: %q: %v", who, args, err)
		}
		if err := of.check(pos[0]); err != nil {
			t.Errorf("%s: run %s refuses its command line %q: %v", who, pos[0], args, err)
		}
	}
	f := &fleetProcs{brokers: "127.0.0.1:9", out: t.TempDir(), level: "info", gated: true, evalSamples: 4, linger: time.Millisecond}
	for _, name := range operators.Names() {
		check("up", f.args(name, "127.0.0.1:0"))
	}
	procs := bench.TrajflowRun("trajflow", "bench.yaml", time.Second, 2*time.Second)
	for _, stage := range bench.Stages {
		check("bench --processes", procs(stage, "i", t.TempDir(), []string{"127.0.0.1:9"}).Args[1:])
	}
}
