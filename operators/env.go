package operators

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/trajflow/trajflow/connectors/envsvc"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// rolloutEnv gives the rollout stage the environment service client of d,
// if any, and its retries for the census.
func rolloutEnv(d Deps, cfg *rollout.StageConfig) {
	if d.Env == nil {
		return
	}
	c := d.Env
	cfg.Env = c
	cfg.EnvRetries = func() map[string]int64 { return c.Counters().Retries }
}

// DialEnv returns the client of the environment services at urls
// (`trajflow serve env`), minting capability tokens with the run key in
// keyFile (the services' --key-file, by default DATA/capability.key of
// the first one), with the tool timeout and retries of c
// (envsvc.ContractOptions). It waits until every service answers its
// health check — logging the ones that do not yet, as long as ctx lasts —
// and refuses (ErrConfig) a service that does not serve the family of
// c.Artifacts.Environment or speaks another protocol version, and a key
// file that is missing or malformed. The caller closes the client.
func DialEnv(ctx context.Context, c *contract.Contract, urls []string, keyFile string, log *slog.Logger) (*envsvc.Client, error) {
	if len(urls) == 0 {
		return nil, fmt.Errorf("%w: environment service: no address", ErrConfig)
	}
	if keyFile == "" {
		return nil, fmt.Errorf("%w: environment service %s: no capability key file (--env-key-file: the service's --key-file, by default DATA/capability.key)",
			ErrConfig, strings.Join(urls, ","))
	}
	family, err := rollout.FamilyOfArtifact(c.Artifacts.Environment)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if log == nil {
		log = slog.Default()
	}
	o := envsvc.ContractOptions(c)
	o.Logger = log
	cl, err := envsvc.Dial(urls, keyFile, o)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if err := waitEnv(ctx, cl, urls, family, log); err != nil {
		cl.Close()
		return nil, err
	}
	return cl, nil
}

// waitEnv polls the services' health until every one answers, then checks
// that each serves family.
func waitEnv(ctx context.Context, cl *envsvc.Client, urls []string, family string, log *slog.Logger) error {
	for first := true; ; first = false {
		hs, err := cl.Health(ctx)
		if err == nil {
			for i, h := range hs {
				if !slices.Contains(h.Families, family) {
					return fmt.Errorf("%w: environment service %s serves %v, not the contract's family %q", ErrConfig, urls[i], h.Families, family)
				}
			}
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("environment services %v not ready: %w (%w)", urls, err, ctx.Err())
		}
		if first {
			log.Warn("waiting for the environment services", "addresses", urls, "err", err)
		}
		t := time.NewTimer(500 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("environment services %v not ready: %w (%w)", urls, err, ctx.Err())
		case <-t.C:
		}
	}
}
