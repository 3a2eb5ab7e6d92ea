package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"

	"github.com/trajflow/trajflow/internal/evaluation"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

func init() {
	register("schemas", "print every topic, record schema, JSON document and header (--json)", cmdSchemas)
	register("contract", "contract validate FILE: print the resolved learning contract and its hash (contract show: the built-in one)", cmdContract)
}

// cmdSchemas prints every topic of a run (the pipeline's topology, control
// plane included), every Arrow schema, JSON document kind, the quarantine
// record and every header; --json writes the same as one JSON document
// (schemas.Catalog: topics[], arrow[], json[], quarantine, headers[]).
func cmdSchemas(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("schemas", stderr)
	asJSON := fs.Bool("json", false, "print one JSON document: topics[], arrow[], json[], quarantine, headers[]")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return fmt.Errorf("%w: trajflow schemas [--json] takes no arguments (got %q)", errUsage, pos)
	}
	var topics []schemas.TopicDoc
	snapshot := pipeline.InputsOf(pipeline.SnapshotStage)
	for _, t := range pipeline.Topology() {
		consumers := t.Consumers
		if slices.Contains(snapshot, t.Short) {
			consumers = append(slices.Clip(consumers), pipeline.SnapshotStage)
		}
		topics = append(topics, schemas.TopicDoc{
			Topic: t.Short, Kind: t.Kind, Plane: t.Plane, Partitions: t.Partitions, Compacted: t.Compacted, Key: t.Key,
			Producers: t.Producers, Consumers: consumers, SideInputs: t.Side, ReadBack: t.Scanned, Doc: t.Doc,
		})
	}
	cat := schemas.NewCatalog(topics)
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(cat)
	}
	return cat.WriteText(stdout)
}

func cmdContract(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("contract validate", stderr)
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	var file string
	switch {
	case len(pos) == 2 && pos[0] == "validate":
		file = pos[1]
	case len(pos) == 1 && pos[0] == "show":
		// The built-in demo contract, resolved: a file to start from for
		// a user who has the binary or the image and no checkout.
	default:
		return fmt.Errorf("%w: trajflow contract validate FILE | trajflow contract show", errUsage)
	}
	c, err := loadContract(file)
	if err != nil {
		return err
	}
	if err := evaluation.CheckObjective(c.Objective); err != nil {
		return fmt.Errorf("%w: contract %s: %w", operators.ErrConfig, file, err)
	}
	y, err := c.YAML()
	if err != nil {
		return err
	}
	// The sampler id every trajectory and release of the run records is
	// that of the resolved sampler settings of the rollout stage
	// (operators.RolloutSettings: the sampler section plus the task
	// grammar), not the hash of the sampler section.
	deps, err := operators.BuiltinDeps(c)
	if err != nil {
		return fmt.Errorf("contract %s: %w", file, err)
	}
	// The reward stage resolves every reward component to its evaluator:
	// a name or version no evaluator has is refused here, not when the
	// run's reward operator starts.
	if _, err := operators.New("reward", deps); err != nil {
		return fmt.Errorf("contract %s: %w", file, err)
	}
	settings, err := operators.SamplerSettings(deps)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "# resolved learning contract\n# hash: %s\n# sampler_id: %s (recorded by every trajectory and release)\n# sampler section hash: %s\n",
		c.Hash(), settings.ID(), c.SamplerID())
	fmt.Fprintf(stdout, "# curriculum version: %s (seed, target distribution, task corpus, splits, dispatch; recorded by every release)\n# reward version: %s (rewards, validator, reward model; recorded by every release)\n",
		c.CurriculumVersion(), c.RewardVersion())
	fmt.Fprintf(stdout, "# policy: %s (not hashed: where the policy runs; trajectories on a server record its identity in sampler_id)\n", policySummary(c.Policy))
	_, err = stdout.Write(y)
	return err
}

// loadContract loads and resolves a contract; "" gives the built-in demo
// contract.
func loadContract(path string) (*contract.Contract, error) {
	var c *contract.Contract
	if path == "" {
		c = contract.Default()
	} else {
		var err error
		if c, err = contract.Load(path); err != nil {
			// A contract that cannot be read or parsed is a configuration
			// error (exit status 2), like one that does not resolve.
			return nil, fmt.Errorf("%w: %w", operators.ErrConfig, err)
		}
	}
	if err := c.Resolve(); err != nil {
		return nil, fmt.Errorf("%w: contract %s: %w", operators.ErrConfig, path, err)
	}
	return c, nil
}

// policySummary is one line on the contract's policy section.
func policySummary(p contract.Policy) string {
	if p.Protocol == contract.PolicyBuiltin {
		return "builtin, in process"
	}
	mode := ""
	if p.Protocol == contract.PolicyLlamaCpp {
		mode = ", single-model servers"
		if p.Router {
			mode = ", routers (models policy-vNNNNNNNN)"
		}
	}
	return fmt.Sprintf("%s on %d replica(s) %v%s, timeout %d ms, %d retries", p.Protocol, len(p.Endpoints), p.Endpoints, mode, p.TimeoutMS, p.Retries)
}
