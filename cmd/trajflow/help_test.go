package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators"
)

// TestHelpOfEveryCommand: `trajflow X --help` exits 0 and prints a usage
// line with the arguments, a description, at least one example and the
// flags, for every command and subcommand; `run --help` lists every
// stage.
func TestHelpOfEveryCommand(t *testing.T) {
	covered := map[string]bool{}
	for name := range helps {
		covered[strings.Fields(name)[0]] = true
	}
	for name := range commands {
		if !covered[name] {
			t.Errorf("command %s has no help entry", name)
		}
	}
	for name, h := range helps {
		args := append(strings.Fields(name), "--help")
		var stdout, stderr bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		code := run(ctx, args, &stdout, &stderr)
		cancel()
		out := stderr.String()
		if code != 0 {
			t.Errorf("trajflow %s --help: exit %d, stderr %q", name, code, out)
			continue
		}
		for _, want := range []string{"usage: trajflow " + h.synopsis, h.about, "examples:\n  trajflow ", "flags:"} {
			if !strings.Contains(out, want) {
				t.Errorf("trajflow %s --help lacks %q:\n%s", name, want, out)
			}
		}
		if strings.Contains(h.synopsis, "FILE") || strings.Contains(h.synopsis, "DIR") || strings.Contains(h.synopsis, "NAME") {
			for _, ex := range h.examples {
				if !strings.HasPrefix(ex, "trajflow "+strings.Fields(name)[0]) && !strings.Contains(ex, "&& trajflow "+strings.Fields(name)[0]) {
					t.Errorf("%s: example %q does not run the command", name, ex)
				}
			}
		}
	}
	var stderr bytes.Buffer
	run(context.Background(), []string{"run", "--help"}, &bytes.Buffer{}, &stderr)
	for _, s := range operators.Specs() {
		if !strings.Contains(stderr.String(), "\n  "+s.Name+" ") {
			t.Errorf("run --help does not list stage %s", s.Name)
		}
	}
}

// TestVersion: `trajflow version` names the module and the Go version and
// says what it knows of the revision.
func TestVersion(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"version"}, &stdout, &stderr); code != 0 {
		t.Fatalf("version: exit %d: %s", code, stderr.String())
	}
	out := stdout.String()
	for _, want := range []string{"trajflow ", "github.com/trajflow/trajflow", "go1.", "revision: "} {
		if !strings.Contains(out, want) {
			t.Errorf("version output lacks %q:\n%s", want, out)
		}
	}
	if code := run(context.Background(), []string{"version", "extra"}, &stdout, &stderr); code != 2 {
		t.Errorf("version extra: exit %d, want 2", code)
	}
}
