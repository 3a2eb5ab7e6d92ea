package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// wantRefused runs trajflow args and fails unless it exits with status 2
// at once, its last line on stderr names every want, and it printed
// nothing on stdout (it started nothing).
func wantRefused(t *testing.T, args []string, want ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var stdout, stderr bytes.Buffer
	start := time.Now()
	code := run(ctx, args, &stdout, &stderr)
	took := time.Since(start)
	if code != 2 || took > 3*time.Second {
		t.Errorf("trajflow %q: exit %d after %v, want 2 at once; stderr:\n%s", args, code, took.Round(time.Millisecond), stderr.String())
		return
	}
	lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
	last := lines[len(lines)-1]
	for _, w := range want {
		if !strings.Contains(last, w) {
			t.Errorf("trajflow %q: the error line %q lacks %q", args, last, w)
		}
	}
	if stdout.Len() != 0 {
		t.Errorf("trajflow %q started before refusing: stdout %q", args, stdout.String())
	}
}

// refusalCase is one command line a command refuses, and what its error
// line must name.
type refusalCase struct {
	args []string
	want []string
}

// testFile is a file in a temporary directory, and a path under a
// directory that does not exist.
func testFile(t *testing.T) (file, missing string) {
	t.Helper()
	dir := t.TempDir()
	file = filepath.Join(dir, "file")
	if err := os.WriteFile(file, []byte("x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return file, filepath.Join(dir, "missing", "x")
}

// TestFlagListsAndAddresses: a comma list refuses empty and repeated
// items; a broker address wants HOST:PORT with a port of 1 to 65535.
func TestFlagListsAndAddresses(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []string
		err  string
	}{
		{"", nil, ""},
		{" a, b ", []string{"a", "b"}, ""},
		{"a,,b", nil, "item 2 is empty"},
		{"a,", nil, "item 2 is empty"},
		{",a", nil, "item 1 is empty"},
		{"a,b,a", nil, `"a" is given twice`},
	} {
		got, err := listFlag("--x", c.in)
		if c.err == "" && (err != nil || !slices.Equal(got, c.want)) {
			t.Errorf("listFlag(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
		if c.err != "" && (!errors.Is(err, errUsage) || !strings.Contains(err.Error(), c.err) || !strings.Contains(err.Error(), "--x")) {
			t.Errorf("listFlag(%q): err %v, want a usage error naming --x and %q", c.in, err, c.err)
		}
	}
	for addr, ok := range map[string]bool{"127.0.0.1:9092": true, "[::1]:1": true, "kafka:65535": true,
		"nohost": false, ":9092": false, "h:0": false, "h:65536": false, "h:-1": false, "h:x": false} {
		if _, err := brokerList("--brokers", addr); (err == nil) != ok || (err != nil && !strings.Contains(err.Error(), "--brokers")) {
			t.Errorf("brokerList(%q): err %v, want ok %v", addr, err, ok)
		}
	}
}
