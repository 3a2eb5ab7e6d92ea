package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/trajflow/trajflow/connectors/envsvc"
	"github.com/trajflow/trajflow/connectors/state"
	"github.com/trajflow/trajflow/operators/rollout"
)

func init() {
	registerServe("env", "the environment service over the built-in task families (--port N --data DIR)", cmdServeEnv)
}

// cmdServeEnv runs the environment service (connectors/envsvc) over the
// built-in task families until ctx ends.
func cmdServeEnv(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("serve env", stderr)
	host := fs.String("host", "127.0.0.1", "address to listen on")
	port := fs.Int("port", 8642, "port to listen on (0: any free port, printed)")
	data := fs.String("data", "", "data directory (Badger): episodes and transitions, persisted before acknowledgement (required)")
	keyFile := fs.String("key-file", "", "capability run key, 32 bytes hex; default DATA/capability.key, created when missing")
	families := fs.String("families", "kv,ledger,text", "task families to serve (default registries of each)")
	maxEpisodes := fs.Int("max-episodes", 1024, "episode slots")
	stepTimeout := fs.Duration("step-timeout", 5*time.Second, "cap on one step's execution and persistence")
	maxObs := fs.Int("max-observation-bytes", 64<<10, "cap on one observation (JSON bytes)")
	lease := fs.Duration("lease", 10*time.Second, "lease of an allocation that asks for none")
	maxLease := fs.Duration("max-lease", 2*time.Minute, "longest lease a request may ask")
	syncWrites := fs.Bool("sync-writes", true, "fsync every transition before acknowledging it")
	logLevel := fs.String("log-level", "info", "debug, info, warn, error")
	if _, err := parseFlags(fs, args); err != nil {
		return err
	}
	if *data == "" {
		return fmt.Errorf("%w: --data DIR is required (transitions are persisted before they are acknowledged)", errUsage)
	}
	if *port < 0 || *port > 65535 {
		return fmt.Errorf("%w: --port %d", errUsage, *port)
	}
	log := newLogger(stderr, *logLevel)
	if err := os.MkdirAll(*data, 0o755); err != nil {
		return fmt.Errorf("--data %s: %w", *data, err)
	}
	kf := *keyFile
	if kf == "" {
		kf = filepath.Join(*data, "capability.key")
	}
	key, created, err := envsvc.EnsureKeyFile(kf)
	if err != nil {
		return err
	}
	if created {
		log.Info("capability key created", "file", kf)
	}
	var regs []*rollout.Registry
	for _, f := range splitList(*families) {
		r, err := rollout.NewFamilyRegistry(f)
		if err != nil {
			return fmt.Errorf("%w: --families: %v", errUsage, err)
		}
		regs = append(regs, r)
	}
	if len(regs) == 0 {
		return fmt.Errorf("%w: --families is empty", errUsage)
	}
	store, err := state.Open(filepath.Join(*data, "badger"), state.Options{SyncWrites: *syncWrites, Logger: log})
	if err != nil {
		return err
	}
	defer store.Close()
	srv, err := envsvc.NewServer(envsvc.Config{
		Registries: regs, Key: key, Store: store, MaxEpisodes: *maxEpisodes, StepTimeout: *stepTimeout,
		MaxObservationBytes: *maxObs, DefaultLease: *lease, MaxLease: *maxLease, Logger: log,
	})
	if err != nil {
		return err
	}
	defer srv.Close()
	ln, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		return err
	}
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 5 * time.Second}
	fmt.Fprintf(stdout, "trajflow env service (protocol %d) listening on http://%s, data %s, %d live episodes resumed\n",
		envsvc.ProtocolVersion, ln.Addr(), *data, srv.Live())
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		if !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		return err
	}
	<-errc
	return nil
}
