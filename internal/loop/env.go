package loop

import (
	"context"
	"fmt"
	"time"

	"github.com/trajflow/trajflow/connectors/envsvc"
	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// EnvSummary is the accounting of the environment services of a run: what
// the rollout stage's client counted, next to what the census holds. Every
// client retry is one census event of kind retried, so Retries ==
// Client.TotalRetries() when nothing was lost; an episode the service ended
// on its own (Client.EpisodesLost) or a call that failed after every retry
// (Client.Exhausted) fails its attempt, which the stage runs again: the
// census's InfraFailures.
type EnvSummary struct {
	Addresses []string        `json:"addresses"`
	Client    envsvc.Counters `json:"client"`
	// Retries counts the census's retried events, by reason in
	// RetriesByReason; InfraFailures its failed events with infra set
	// (attempts run again).
	Retries         int            `json:"census_retries"`
	RetriesByReason map[string]int `json:"census_retries_by_reason"`
	InfraFailures   int            `json:"census_infra_failures"`
}

// environment sets the contract's environment artifact of o and the reward
// and validator that go with its family, and the tool timeout and retries.
func environment(c *contract.Contract, o Options) error {
	if o.ToolRetries > 0 {
		c.Sampler.ToolRetries = o.ToolRetries
	}
	if o.ToolTimeoutMS > 0 {
		c.Sampler.ToolTimeoutMS = o.ToolTimeoutMS
	}
	if o.Environment == "" || o.Environment == c.Artifacts.Environment {
		return nil
	}
	reg, err := rollout.RegistryForArtifact(o.Environment)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	if reg.Spec().Observations != rollout.ObsTokens {
		return fmt.Errorf("demo: environment %s: the built-in policy speaks the built-in vocabulary (kv, ledger), not text", o.Environment)
	}
	name := rollout.NewValidator(reg).Name()
	c.Artifacts.Environment = o.Environment
	c.Artifacts.Validator = "builtin:validator/" + name + "@" + rollout.ValidatorVersion
	c.Rewards[0].Name = name
	return nil
}

// dialEnv connects the rollout stage to the environment services of
// r.o.Env (waiting up to 30 s for them); the runner closes the client
// after the operators stopped.
func (r *runner) dialEnv(ctx context.Context) error {
	if len(r.o.Env) == 0 {
		return nil
	}
	dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cl, err := operators.DialEnv(dctx, r.c, r.o.Env, r.o.EnvKeyFile, r.log.With("stage", "rollout"))
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	r.deps.Env = cl
	r.closers = append(r.closers, cl.Close)
	return nil
}

// accountEnv fills the summary's environment accounting from the client
// and the census.
func (r *runner) accountEnv(rep *audit.Report) {
	if r.deps.Env == nil {
		return
	}
	e := &EnvSummary{Addresses: r.o.Env, Client: r.deps.Env.Counters(), RetriesByReason: rep.EnvRetries,
		Retries: rep.Census[schemas.CensusRetried], InfraFailures: rep.InfraFailed}
	r.sum.Env = e
}

// printEnv prints the environment accounting.
func (r *runner) printEnv() {
	e := r.sum.Env
	if e == nil || r.o.Quiet {
		return
	}
	fmt.Fprintf(r.stdout, "environment services %v: client %s; census: %d retried events, %d infrastructure failures\n",
		e.Addresses, e.Client, e.Retries, e.InfraFailures)
}
