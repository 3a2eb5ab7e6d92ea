package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// The checks of this file refuse a flag's value before a command starts
// anything: each error wraps errUsage (exit status 2) and names the flag
// and the value.

// flagCheck is one refusal: when bad, msg names the flag and its value.
type flagCheck struct {
	bad bool
	msg string
}

// firstBad is the usage error of the first bad check, or nil.
func firstBad(checks ...flagCheck) error {
	for _, c := range checks {
		if c.bad {
			return fmt.Errorf("%w: %s", errUsage, c.msg)
		}
	}
	return nil
}

// listFlag splits the comma-separated list of flag name: "" is the empty
// list; an empty item ("a,,b", a leading or trailing comma) or an item
// given twice is refused.
func listFlag(name, value string) ([]string, error) {
	if strings.TrimSpace(value) == "" {
		return nil, nil
	}
	var out []string
	for i, p := range strings.Split(value, ",") {
		p = strings.TrimSpace(p)
		switch {
		case p == "":
			return nil, fmt.Errorf("%w: %s %q: item %d is empty (a doubled, leading or trailing comma)", errUsage, name, value, i+1)
		case slices.Contains(out, p):
			return nil, fmt.Errorf("%w: %s %q: %q is given twice", errUsage, name, value, p)
		}
		out = append(out, p)
	}
	return out, nil
}

// brokerList is the list of Kafka addresses of flag name: HOST:PORT
// each, the port 1 to 65535.
func brokerList(name, value string) ([]string, error) {
	addrs, err := listFlag(name, value)
	if err != nil {
		return nil, err
	}
	for _, a := range addrs {
		if err := checkHostPort(a, false); err != nil {
			return nil, fmt.Errorf("%w: %s %q: %w", errUsage, name, a, err)
		}
	}
	return addrs, nil
}

// checkHostPort checks a HOST:PORT address: a host and a port of 1 to
// 65535 (0 too when zeroOK).
func checkHostPort(addr string, zeroOK bool) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return errors.New("want HOST:PORT")
	}
	if host == "" {
		return errors.New("want HOST:PORT: no host")
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 0 || n > 65535 || (n == 0 && !zeroOK) {
		return fmt.Errorf("port %q is not a port (1 to 65535)", port)
	}
	return nil
}

// logLevel reads the --log-level of a command: debug, info, warn or
// error (slog's names, optionally with an offset such as info+2).
func logLevel(value string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(value)); err != nil {
		return 0, fmt.Errorf("%w: --log-level %q: want debug, info, warn or error", errUsage, value)
	}
	return l, nil
}

// newLogger is a text logger on w at the --log-level level.
func newLogger(w io.Writer, level string) (*slog.Logger, error) {
	l, err := logLevel(level)
	if err != nil {
		return nil, err
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})), nil
}

// listenAddr is the address a server listens on: --host, which must be
// given (0.0.0.0 listens on every interface) and resolve, and --port, 0
// (a free port) to 65535.
func listenAddr(host string, port int) (string, error) {
	if port < 0 || port > 65535 {
		return "", fmt.Errorf("%w: --port %d is not a port (0 picks a free one, else 1 to 65535)", errUsage, port)
	}
	if strings.TrimSpace(host) == "" {
		return "", fmt.Errorf("%w: --host %q: want an address to listen on (0.0.0.0: every interface)", errUsage, host)
	}
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	if _, err := net.ResolveTCPAddr("tcp", addr); err != nil {
		return "", fmt.Errorf("%w: --host %q: %w", errUsage, host, err)
	}
	return addr, nil
}

// checkInt32 refuses a count flag below lo or past what its int32 field
// holds.
func checkInt32(name string, v, lo int) error {
	if v < lo || v > math.MaxInt32 {
		return fmt.Errorf("%w: %s %d: want %d to %d", errUsage, name, v, lo, math.MaxInt32)
	}
	return nil
}

// checkFinite refuses a float flag that is NaN, infinite or below lo
// (or equal to it when open).
func checkFinite(name string, v, lo float64, open bool) error {
	if math.IsNaN(v) || math.IsInf(v, 0) || v < lo || (open && v == lo) {
		want := fmt.Sprintf("a finite number >= %g", lo)
		if open {
			want = fmt.Sprintf("a finite number > %g", lo)
		}
		return fmt.Errorf("%w: %s %v: want %s", errUsage, name, v, want)
	}
	return nil
}

// checkInFile refuses an input file flag naming no readable regular file.
func checkInFile(name, path string) error {
	st, err := os.Stat(path)
	switch {
	case err != nil:
		return fmt.Errorf("%w: %s %q: %w", errUsage, name, path, errors.Unwrap(err))
	case st.IsDir():
		return fmt.Errorf("%w: %s %q is a directory, not a file", errUsage, name, path)
	}
	return nil
}

// checkOutFile refuses an output file flag that names a directory or lies
// in a directory that does not exist ("" is no file).
func checkOutFile(name, path string) error {
	if path == "" {
		return nil
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return fmt.Errorf("%w: %s %q is a directory, not a file", errUsage, name, path)
	}
	dir := filepath.Dir(path)
	st, err := os.Stat(dir)
	switch {
	case err != nil:
		return fmt.Errorf("%w: %s %q: directory %s: %w", errUsage, name, path, dir, errors.Unwrap(err))
	case !st.IsDir():
		return fmt.Errorf("%w: %s %q: %s is not a directory", errUsage, name, path, dir)
	}
	return nil
}

// checkOutDir refuses an output directory flag that is empty or names a
// file (a directory that does not exist yet is created by the command).
func checkOutDir(name, path string) error {
	if strings.TrimSpace(path) == "" {
		return fmt.Errorf("%w: %s %q: want a directory", errUsage, name, path)
	}
	st, err := os.Stat(path)
	switch {
	case err == nil && !st.IsDir():
		return fmt.Errorf("%w: %s %q is a file, not a directory", errUsage, name, path)
	case err != nil && !errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%w: %s %q: %w", errUsage, name, path, err)
	}
	return nil
}

// checkInDir refuses a flag that must name an existing directory.
func checkInDir(name, path string) error {
	st, err := os.Stat(path)
	switch {
	case err != nil:
		return fmt.Errorf("%w: %s %q: %w", errUsage, name, path, errors.Unwrap(err))
	case !st.IsDir():
		return fmt.Errorf("%w: %s %q is not a directory", errUsage, name, path)
	}
	return nil
}

// onlyWith refuses the flags of names that the command line set while
// applies is false: why says what they need ("--x: needs ...").
func onlyWith(fs *flag.FlagSet, applies bool, why string, names ...string) error {
	if applies {
		return nil
	}
	for _, n := range names {
		if isSet(fs, n) {
			return fmt.Errorf("%w: --%s %s: %s", errUsage, n, fs.Lookup(n).Value, why)
		}
	}
	return nil
}

// onlyFlags refuses every flag the command line set but those of
// allowed: why says what the flags given make of the command.
func onlyFlags(fs *flag.FlagSet, why string, allowed ...string) error {
	var extra []string
	fs.Visit(func(f *flag.Flag) {
		if !slices.Contains(allowed, f.Name) {
			extra = append(extra, "--"+f.Name)
		}
	})
	if len(extra) > 0 {
		return fmt.Errorf("%w: %s: %s would do nothing", errUsage, why, strings.Join(extra, ", "))
	}
	return nil
}

// noArgs refuses positional arguments of a command that takes none.
func noArgs(cmd string, pos []string) error {
	if len(pos) != 0 {
		return fmt.Errorf("%w: trajflow %s takes no arguments (got %q)", errUsage, cmd, pos)
	}
	return nil
}

// checkOTLP refuses an --otlp-endpoint that is not an http(s) URL with a
// host ("" is none).
func checkOTLP(endpoint string) error {
	if endpoint == "" {
		return nil
	}
	u, err := url.Parse(endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%w: --otlp-endpoint %q: want an http(s) URL, e.g. http://127.0.0.1:4318/v1/traces", errUsage, endpoint)
	}
	return nil
}
