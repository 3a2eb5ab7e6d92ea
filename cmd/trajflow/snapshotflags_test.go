package main

import (
	"os"
	"path/filepath"
	"testing"
)

// TestSnapshotCommandFlagsRefused: census and replay refuse a DIR that
// is not there or holds no run (or several, none named), a --run the DIR
// lacks, and flags that would be ignored, with exit 2 naming what is
// wrong.
func TestSnapshotCommandFlagsRefused(t *testing.T) {
	file, missing := testFile(t)
	empty, two := t.TempDir(), t.TempDir()
	for _, r := range []string{"run=a", "run=b"} {
		if err := os.Mkdir(filepath.Join(two, r), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, cmd := range []string{"census", "replay"} {
		for _, tc := range []refusalCase{
			{[]string{cmd, missing}, []string{missing, "no such file"}},
			{[]string{cmd, empty}, []string{"no run=<run> directory in " + empty}},
			{[]string{cmd, two}, []string{two, "[run=a run=b]: name one"}},
			{[]string{cmd, two, "--run", "c"}, []string{"run c", filepath.Join(two, "run=c") + " does not exist"}},
		} {
			wantRefused(t, tc.args, tc.want...)
		}
	}
	for _, tc := range []refusalCase{
		{[]string{"census", two, "--run", "a", "--tasks", "0"}, []string{"--tasks 0"}},
		{[]string{"replay", two, "--run", "a", "--client-config", file}, []string{"--client-config " + file, "only with --to-brokers"}},
		{[]string{"replay", two, "--run", "a", "--to-brokers", "127.0.0.1:9092,,127.0.0.1:9093"}, []string{"--to-brokers", "item 2 is empty"}},
		{[]string{"replay", two, "--run", "a", "--to-brokers", "127.0.0.1"}, []string{"--to-brokers", "HOST:PORT"}},
	} {
		wantRefused(t, tc.args, tc.want...)
	}
}
