package envsvc

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/trajflow/trajflow/connectors/state"
	"github.com/trajflow/trajflow/operators/rollout"
)

// ServeOptions configure ListenAndServe: the service's data directory (the
// Badger store of episodes and transitions, and the capability key unless
// KeyFile names one), its task families, and the Config caps.
type ServeOptions struct {
	Addr     string // host:port; port 0 picks a free one
	DataDir  string // required
	KeyFile  string // default DataDir/capability.key, created when missing
	Families []string
	// SyncWrites fsyncs every transition before it is acknowledged.
	SyncWrites bool
	// Config carries the caps (MaxEpisodes, StepTimeout,
	// MaxObservationBytes, DefaultLease, MaxLease); its Registries, Key,
	// Store and Logger are set by ListenAndServe.
	Config Config
	Logger *slog.Logger
	// ReadTimeout bounds the reading of one request, body included
	// (default 30 s; bodies are at most Config.MaxRequestBytes, 1 MiB):
	// a client that sends slower is disconnected. IdleTimeout closes a
	// kept-alive connection without a request (default 2 min).
	ReadTimeout, IdleTimeout time.Duration
	// ShutdownGrace is how long a stopping service waits for requests in
	// flight (default 5 s); then it closes the connections left and says
	// how many on the log.
	ShutdownGrace time.Duration
	// FreeSpace, when set, replaces statfs(2) for the store's free-space
	// check (state.Options.FreeSpace).
	FreeSpace func(dir string) (uint64, error)

	connState func(net.Conn, http.ConnState) // observes connections (tests)
}

// ErrConfig is wrapped by ListenAndServe's errors about its options (an
// unknown family, no data directory): configuration, not operation.
var ErrConfig = errors.New("envsvc: configuration")

// ListenAndServe runs the environment service until ctx ends: it opens
// the store, loads (or creates) the capability key, resumes the live
// episodes, listens on o.Addr, calls ready with the address it listens on
// and the number of episodes resumed, and shuts down gracefully.
func ListenAndServe(ctx context.Context, o ServeOptions, ready func(addr string, resumed int)) error {
	if o.DataDir == "" {
		return fmt.Errorf("%w: no data directory: transitions are persisted before they are acknowledged", ErrConfig)
	}
	var regs []*rollout.Registry
	for _, f := range o.Families {
		r, err := rollout.NewFamilyRegistry(f)
		if err != nil {
			return fmt.Errorf("%w: family %q: %w", ErrConfig, f, err)
		}
		regs = append(regs, r)
	}
	if len(regs) == 0 {
		return fmt.Errorf("%w: no task family to serve", ErrConfig)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if err := os.MkdirAll(o.DataDir, 0o755); err != nil {
		return fmt.Errorf("envsvc: data directory %s: %w", o.DataDir, err)
	}
	kf := o.KeyFile
	if kf == "" {
		kf = filepath.Join(o.DataDir, "capability.key")
	}
	key, created, err := EnsureKeyFile(kf)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if created {
		o.Logger.Info("capability key created", "file", kf)
	}
	store, err := state.Open(filepath.Join(o.DataDir, "badger"), state.Options{SyncWrites: o.SyncWrites, Logger: o.Logger, FreeSpace: o.FreeSpace})
	if err != nil {
		return err
	}
	defer store.Close()
	cfg := o.Config
	cfg.Registries, cfg.Key, cfg.Store, cfg.Logger = regs, key, store, o.Logger
	srv, err := NewServer(cfg)
	if err != nil {
		return err
	}
	defer srv.Close()
	ln, err := net.Listen("tcp", o.Addr)
	if err != nil {
		return fmt.Errorf("envsvc: listen %s: %w", o.Addr, err)
	}
	var conns atomic.Int64 // open connections
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout: cmp.Or(o.ReadTimeout, 30*time.Second), IdleTimeout: cmp.Or(o.IdleTimeout, 2*time.Minute),
		ConnState: func(c net.Conn, st http.ConnState) {
			switch st {
			case http.StateNew:
				conns.Add(1)
			case http.StateClosed, http.StateHijacked:
				conns.Add(-1)
			}
			if o.connState != nil {
				o.connState(c, st)
			}
		}}
	if ready != nil {
		ready(ln.Addr().String(), srv.Live())
	}
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
	grace := cmp.Or(o.ShutdownGrace, 5*time.Second)
	sctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		if !errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("envsvc: shutdown: %w", err)
		}
		// Requests still reading (or being answered) after the grace:
		// cut them. Their actions, if any ran, are persisted; the clients
		// ask their status.
		n := conns.Load()
		if err := hs.Close(); err != nil {
			return fmt.Errorf("envsvc: shutdown: closing %d connections: %w", n, err)
		}
		o.Logger.Warn("shutdown: connections still open after the grace were closed", "connections", n, "grace", grace)
	}
	<-errc
	return nil
}
