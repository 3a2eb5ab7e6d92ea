// Command trajflow runs the trajflow data plane: operators over Kafka, the
// embedded broker, the demo, replay, census and benchmarks.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"

	"github.com/trajflow/trajflow/operators"
)

// command is one subcommand.
type command struct {
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

var commands = map[string]command{}

func register(name, summary string, run func(ctx context.Context, args []string, stdout, stderr io.Writer) error) {
	commands[name] = command{summary: summary, run: run}
}

// errUsage marks a command-line mistake (exit status 2).
var errUsage = errors.New("usage")

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: trajflow COMMAND [flags]")
	fmt.Fprintln(w, "\ncommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-18s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nRun 'trajflow COMMAND -h' for the flags of a command.")
}

func main() {
	ctx, stop := signalContext()
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// signalContext returns a context that the first SIGINT or SIGTERM
// cancels: the command then stops in order (operators finish their
// batch and commit, servers answer what they hold). That first signal
// also gives both signals back their default action, so a second one
// ends the process at once — which loses no data, as kill -9 loses none
// (docs/GUARANTEES.md). A supervisor that forwards signals to its
// children starts them in their own process group, so that a terminal's
// Ctrl-C does not reach them twice.
func signalContext() (context.Context, context.CancelFunc) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	context.AfterFunc(ctx, stop)
	return ctx, stop
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stdout)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "trajflow: unknown command %q\n\n", args[0])
		usage(stderr)
		return 2
	}
	err := cmd.run(ctx, args[1:], stdout, stderr)
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage), errors.Is(err, operators.ErrConfig):
		// A command-line mistake or a configuration a stage refuses.
		fmt.Fprintf(stderr, "trajflow %s: %s\n", args[0], strings.TrimPrefix(err.Error(), args[0]+": "))
		return 2
	default:
		fmt.Fprintf(stderr, "trajflow %s: %s\n", args[0], strings.TrimPrefix(err.Error(), args[0]+": "))
		return 1
	}
}

// isSet reports whether the command line set flag name.
func isSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// newFlags returns a FlagSet that reports errors instead of exiting.
func newFlags(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("trajflow "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { printHelp(fs, name) }
	return fs
}

// parseFlags parses args, allowing flags after positional arguments.
func parseFlags(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, fmt.Errorf("%w: %v", errUsage, err)
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}
