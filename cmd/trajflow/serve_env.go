package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/trajflow/trajflow/connectors/envsvc"
)

func init() {
	registerServe("env", "the environment service over the built-in task families (--port N --data DIR)", cmdServeEnv)
}

// cmdServeEnv runs the environment service (connectors/envsvc) over the
// built-in task families until ctx ends.
func cmdServeEnv(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("serve env", stderr)
	host := fs.String("host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)")
	port := fs.Int("port", 8642, "port to listen on (0: any free port, printed)")
	data := fs.String("data", "", "data directory (Badger): episodes and transitions, persisted before acknowledgement (required)")
	keyFile := fs.String("key-file", "", "capability run key, 32 bytes hex; default DATA/capability.key, created when missing")
	families := fs.String("families", "kv,ledger,text", "task families to serve (default registries of each)")
	maxEpisodes := fs.Int("max-episodes", 1024, "episode slots")
	stepTimeout := fs.Duration("step-timeout", 5*time.Second, "cap on one step's execution and persistence")
	maxObs := fs.Int("max-observation-bytes", 64<<10, "cap on one observation (JSON bytes)")
	lease := fs.Duration("lease", 10*time.Second, "lease of an allocation that asks for none (the default is shortened to a shorter --max-lease)")
	maxLease := fs.Duration("max-lease", 2*time.Minute, "longest lease a request may ask")
	syncWrites := fs.Bool("sync-writes", true, "fsync every transition before acknowledging it")
	logLevel := fs.String("log-level", "info", "debug, info, warn, error")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if err := noArgs("serve env", pos); err != nil {
		return err
	}
	if *data == "" {
		return fmt.Errorf("%w: --data DIR is required (transitions are persisted before they are acknowledged)", errUsage)
	}
	if err := checkOutDir("--data", *data); err != nil {
		return err
	}
	if err := checkServeEnvFlags(*maxEpisodes, *maxObs, *stepTimeout, lease, *maxLease, isSet(fs, "lease")); err != nil {
		return err
	}
	addr, err := listenAddr(*host, *port)
	if err != nil {
		return err
	}
	if err := checkKeyFileFlag(*keyFile); err != nil {
		return err
	}
	fams, err := listFlag("--families", *families)
	if err != nil {
		return err
	}
	log, err := newLogger(stderr, *logLevel)
	if err != nil {
		return err
	}
	o := envsvc.ServeOptions{
		Addr: addr, DataDir: *data, KeyFile: *keyFile,
		Families: fams, SyncWrites: *syncWrites, Logger: log,
		Config: envsvc.Config{MaxEpisodes: *maxEpisodes, StepTimeout: *stepTimeout, MaxObservationBytes: *maxObs,
			DefaultLease: *lease, MaxLease: *maxLease},
	}
	err = envsvc.ListenAndServe(ctx, o, func(addr string, resumed int) {
		fmt.Fprintf(stdout, "trajflow env service (protocol %d) listening on http://%s, data %s, %d live episodes resumed\n",
			envsvc.ProtocolVersion, addr, *data, resumed)
	})
	if errors.Is(err, envsvc.ErrConfig) {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return err
}

// checkServeEnvFlags refuses caps that are not positive (zero would not
// mean "the default": the flags show their defaults) and a --lease given
// longer than --max-lease; the default --lease is shortened to a shorter
// --max-lease.
func checkServeEnvFlags(maxEpisodes, maxObs int, stepTimeout time.Duration, leasep *time.Duration, maxLease time.Duration, leaseSet bool) error {
	if !leaseSet && maxLease > 0 {
		*leasep = min(*leasep, maxLease)
	}
	lease := *leasep
	for _, c := range []struct {
		flag string
		ok   bool
		val  any
	}{
		{"--max-episodes", maxEpisodes > 0, maxEpisodes},
		{"--max-observation-bytes", maxObs > 0, maxObs},
		{"--step-timeout", stepTimeout > 0, stepTimeout},
		{"--lease", lease > 0, lease},
		{"--max-lease", maxLease > 0, maxLease},
	} {
		if !c.ok {
			return fmt.Errorf("%w: %s %v: must be positive", errUsage, c.flag, c.val)
		}
	}
	if lease > maxLease {
		return fmt.Errorf("%w: --lease %s is longer than --max-lease %s", errUsage, lease, maxLease)
	}
	return nil
}

// checkKeyFileFlag refuses a --key-file that exists but holds no key, or
// that does not exist in a directory that does not exist either (a
// missing file in an existing directory is created).
func checkKeyFileFlag(path string) error {
	if path == "" {
		return nil
	}
	_, err := envsvc.ReadKeyFile(path)
	switch {
	case err == nil:
		return nil
	case !errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%w: --key-file: %w", errUsage, err)
	}
	dir := filepath.Dir(path)
	if st, err := os.Stat(dir); err != nil {
		return fmt.Errorf("%w: --key-file %s: directory %s: %w", errUsage, path, dir, err)
	} else if !st.IsDir() {
		return fmt.Errorf("%w: --key-file %s: %s is not a directory", errUsage, path, dir)
	}
	return nil
}
