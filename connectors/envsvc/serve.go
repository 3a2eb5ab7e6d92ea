package envsvc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
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
		return err
	}
	if created {
		o.Logger.Info("capability key created", "file", kf)
	}
	store, err := state.Open(filepath.Join(o.DataDir, "badger"), state.Options{SyncWrites: o.SyncWrites, Logger: o.Logger})
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
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 5 * time.Second}
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
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		return err
	}
	<-errc
	return nil
}
