package main

import (
	"context"
	"fmt"
	"io"
	"sort"
)

// serveCommands are the sub-commands of `trajflow serve`, one per end
// trajflow serves over the network (registerServe adds one from its own
// file's init).
var serveCommands = map[string]command{}

func registerServe(name, summary string, run func(ctx context.Context, args []string, stdout, stderr io.Writer) error) {
	serveCommands[name] = command{summary: summary, run: run}
}

func init() {
	register("serve", "serve KIND: serve a built-in end over the network (serve policy --protocol sglang|vllm|llamacpp ...)", cmdServe)
}

func serveUsage(w io.Writer) {
	fmt.Fprintln(w, "usage: trajflow serve KIND [flags]")
	fmt.Fprintln(w, "\nkinds:")
	names := make([]string, 0, len(serveCommands))
	for n := range serveCommands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-10s %s\n", n, serveCommands[n].summary)
	}
}

func cmdServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		serveUsage(stderr)
		if len(args) == 0 {
			return fmt.Errorf("%w: trajflow serve KIND", errUsage)
		}
		return nil
	}
	sub, ok := serveCommands[args[0]]
	if !ok {
		serveUsage(stderr)
		return fmt.Errorf("%w: unknown kind %q", errUsage, args[0])
	}
	return sub.run(ctx, args[1:], stdout, stderr)
}
