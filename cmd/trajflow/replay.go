package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/internal/replay"
)

func init() {
	register("replay", "replay DIR: rebuild a run's batches offline from its Parquet snapshots (DIR/run=<run> or DIR/snapshots/run=<run>) "+
		"and compare them byte for byte; a missing or corrupt snapshot file is refused, every one named (--to-brokers ADDR re-emits the snapshot into Kafka)", cmdReplay)
}

func cmdReplay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("replay", stderr)
	runName := fs.String("run", "", "run to replay when DIR holds several")
	cpath := fs.String("contract", "", "learning contract (default: the contract recorded in the snapshot)")
	to := fs.String("to-brokers", "", "re-emit every snapshot topic into the Kafka cluster at ADDR instead of replaying")
	clientCfg := fs.String("client-config", "", "YAML file with TLS/SASL client settings for --to-brokers")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return fmt.Errorf("%w: trajflow replay DIR [--contract FILE] [--to-brokers ADDR]", errUsage)
	}
	if *clientCfg != "" && *to == "" {
		return fmt.Errorf("%w: --client-config %s: only with --to-brokers (replay reads no cluster)", errUsage, *clientCfg)
	}
	brokers, err := brokerList("--to-brokers", *to)
	if err != nil {
		return err
	}
	runDir, err := findRunDir(pos[0], *runName)
	if err != nil {
		return err
	}
	if *cpath == "" {
		fmt.Fprintf(stderr, "no --contract: using the contract recorded in the snapshot (%s)\n", replay.ContractPath(runDir, ""))
	}
	if len(brokers) > 0 {
		return reemit(ctx, runDir, *cpath, brokers, *clientCfg, stdout)
	}
	rep, err := replay.Run(ctx, runDir, *cpath)
	if err != nil {
		return err
	}
	for _, l := range rep.Notes {
		fmt.Fprintln(stdout, l)
	}
	if rep.Diff != "" {
		return fmt.Errorf("%d of %d batches identical; first difference: %s", rep.Identical, rep.Batches, rep.Diff)
	}
	fmt.Fprintf(stdout, "%d batches identical\n", rep.Identical)
	return nil
}

// reemit re-emits the snapshot of runDir into the cluster at brokers
// (--to-brokers), with the TLS/SASL settings of clientCfg, whose own
// brokers, if it lists any, must be the same.
func reemit(ctx context.Context, runDir, cpath string, brokers []string, clientCfg string, stdout io.Writer) error {
	cc := kafka.ClientConfig{}
	if clientCfg != "" {
		var err error
		if cc, err = kafka.LoadClientConfig(clientCfg); err != nil {
			return fmt.Errorf("%w: --client-config: %w", errUsage, err)
		}
		if len(cc.Brokers) > 0 && !slices.Equal(cc.Brokers, brokers) {
			return fmt.Errorf("%w: --to-brokers %s and the brokers %s of --client-config %s: give one of them",
				errUsage, strings.Join(brokers, ","), strings.Join(cc.Brokers, ","), clientCfg)
		}
	}
	cc.Brokers = brokers
	if err := cc.Validate(); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	n, err := replay.Reemit(ctx, runDir, cpath, cc)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%d messages re-emitted to %s\n", n, strings.Join(brokers, ","))
	return nil
}
