package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/internal/dashboard"
)

func init() {
	register("dashboard", "dashboard [DIR] [--brokers ADDR --run ID] --port N: a run's web dashboard and trajectory viewer, from its snapshot directory or live from the cluster", cmdDashboard)
}

const dashboardUsage = `trajflow dashboard DIR [--port N]                      a run's snapshot directory (trajflow demo --out DIR)
       trajflow dashboard --brokers ADDR [--run ID] [--releases DIR] [--port N]   live from the run's topics
example: trajflow demo --out out/demo && trajflow dashboard out/demo --port 8080`

func cmdDashboard(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("dashboard", stderr)
	var cfg dashboard.Config
	brokers := fs.String("brokers", "", "comma-separated brokers of a running cluster: serve the run live from its topics")
	clientCfg := fs.String("client-config", "", "YAML file with TLS/SASL client settings for --brokers")
	fs.StringVar(&cfg.Run, "run", "", "run id: which run of DIR, or whose topics on the cluster (default: the only run of DIR, the contract's run live)")
	fs.StringVar(&cfg.Contract, "contract", "", "learning contract of a live run (default: the built-in demo contract; a snapshot records its own)")
	fs.StringVar(&cfg.Releases, "releases", "", "release directory (update records, checkpoints; default DIR/releases offline, none live)")
	fs.DurationVar(&cfg.Refresh, "refresh", 5*time.Second, "interval between two reads of a live run")
	fs.IntVar(&cfg.EvalSamples, "eval-samples", 4, "attempts per hidden-eval task when re-measuring releases (the demo's --eval-samples; 0: none)")
	host := fs.String("host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)")
	port := fs.Int("port", 8080, "port to listen on (0: a free port)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	switch {
	case len(pos) > 1 || (len(pos) == 1) == (*brokers != ""):
		return fmt.Errorf("%w: give DIR or --brokers, not both or neither:\n%s", errUsage, dashboardUsage)
	case cfg.EvalSamples < 0 || cfg.EvalSamples > math.MaxInt32:
		return fmt.Errorf("%w: --eval-samples %d: want 0 to %d", errUsage, cfg.EvalSamples, math.MaxInt32)
	case cfg.Refresh <= 0:
		return fmt.Errorf("%w: --refresh %s: want a positive interval", errUsage, cfg.Refresh)
	}
	addr, err := listenAddr(*host, *port)
	if err != nil {
		return err
	}
	if len(pos) == 1 {
		cfg.Dir = pos[0]
	}
	if err := onlyWith(fs, cfg.Dir == "", "reads a live run (--brokers); a snapshot directory records its own", "contract", "refresh", "client-config"); err != nil {
		return err
	}
	if cfg.Releases != "" {
		if err := checkInDir("--releases", cfg.Releases); err != nil {
			return err
		}
	}
	if *clientCfg != "" {
		if cfg.Client, err = kafka.LoadClientConfig(*clientCfg); err != nil {
			return fmt.Errorf("%w: --client-config: %w", errUsage, err)
		}
	}
	if cfg.Brokers, err = brokerList("--brokers", *brokers); err != nil {
		return err
	}
	cfg.Logger = slog.New(slog.NewTextHandler(stderr, nil))
	err = dashboard.Serve(ctx, cfg, addr, stdout)
	if errors.Is(err, dashboard.ErrConfig) {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return err
}
