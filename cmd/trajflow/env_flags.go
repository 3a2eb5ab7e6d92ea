package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/url"

	"github.com/trajflow/trajflow/connectors/envsvc"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// envFlags select the environment services the rollout stage runs its
// episodes against (`trajflow demo`, `trajflow run rollout`). The
// addresses are deployment, not part of the learning contract: a run
// through the services records the same contract hash, and so the same
// batches, as the run in process.
type envFlags struct {
	urls    *string
	keyFile *string
}

func addEnvFlags(fs *flag.FlagSet) envFlags {
	return envFlags{
		urls:    fs.String("env", "", "comma-separated addresses of trajflow serve env services (http://HOST:PORT) the rollout stage runs its episodes against, least-loaded with affinity per episode (default: the environment in process)"),
		keyFile: fs.String("env-key-file", "", "capability key file the services were started with (their --key-file, by default DATA/capability.key); required with --env"),
	}
}

// list returns the addresses, http(s)://HOST:PORT each; a key file
// without addresses, addresses without a key file or a key file that is
// not there is a usage error.
func (f envFlags) list() ([]string, error) {
	urls, err := listFlag("--env", *f.urls)
	if err != nil {
		return nil, err
	}
	for _, u := range urls {
		p, err := url.Parse(u)
		if err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
			return nil, fmt.Errorf("%w: --env %q: want http://HOST:PORT", errUsage, u)
		}
	}
	if len(urls) == 0 && *f.keyFile != "" {
		return nil, fmt.Errorf("%w: --env-key-file without --env", errUsage)
	}
	if len(urls) > 0 && *f.keyFile == "" {
		return nil, fmt.Errorf("%w: --env needs --env-key-file (the services' --key-file, by default DATA/capability.key)", errUsage)
	}
	if len(urls) > 0 {
		if err := checkInFile("--env-key-file", *f.keyFile); err != nil {
			return nil, err
		}
	}
	return urls, nil
}

// check refuses --env for a stage other than rollout (the one that runs
// episodes).
func (f envFlags) check(name string) ([]string, error) {
	urls, err := f.list()
	if err == nil && len(urls) > 0 && name != "rollout" {
		err = fmt.Errorf("%w: --env is a flag of the rollout stage (the stage that runs episodes), not of %s", errUsage, name)
	}
	return urls, err
}

// dial returns the client of the services for stage name, waiting for
// them as long as ctx lasts; nil without --env.
func (f envFlags) dial(ctx context.Context, name string, c *contract.Contract, log *slog.Logger) (*envsvc.Client, error) {
	urls, err := f.check(name)
	if err != nil || len(urls) == 0 {
		return nil, err
	}
	return operators.DialEnv(ctx, c, urls, *f.keyFile, log)
}
