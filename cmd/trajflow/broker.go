package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

func init() {
	register("broker", "run the embedded Kafka-protocol broker (--port, --data)", cmdBroker)
	register("topics", "topics create --brokers ADDR [--contract FILE]: create every topic of a run (default contract: the built-in demo)", cmdTopics)
}

func cmdBroker(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("broker", stderr)
	host := fs.String("host", "127.0.0.1", "address to listen on and advertise")
	port := fs.Int("port", 9092, "port (0 picks a free one)")
	data := fs.String("data", "", "data directory (empty: in memory)")
	retBytes := fs.Int64("retention-bytes", 0, "per-partition retention in bytes (0: unbounded)")
	retAge := fs.Duration("retention", 7*24*time.Hour, "retention age (0: Kafka's default, 7 days; negative: unbounded)")
	maxMsg := fs.Int("max-message-bytes", kafka.DefaultMaxMessageBytes, "largest record batch accepted (0: the default)")
	level := fs.String("log-level", "info", "log level: debug, info, warn or error")
	tcpOnly := fs.Bool("tcp-only", false, "listen on TCP alone: no local socket beside a loopback address (trajflow's clients of this host then use TCP too)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	cfg, err := brokerConfig(pos, *host, *port, *data, *retBytes, *maxMsg)
	if err != nil {
		return err
	}
	if cfg.Logger, err = newLogger(stderr, *level); err != nil {
		return err
	}
	cfg.Retention, cfg.TCPOnly = kafka.RetentionPolicy{Bytes: *retBytes, Age: *retAge}, *tcpOnly
	b, err := kafka.StartBroker(ctx, cfg)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "broker listening on %s\n", b.Addr())
	if s := b.LocalSocket(); s != "" {
		fmt.Fprintf(stdout, "local socket %s (trajflow's clients of this host connect there)\n", s)
	}
	<-ctx.Done()
	return b.Close()
}

// brokerConfig checks the broker's flags: no argument, a concrete host
// (it is advertised), a port, a data directory that is not a file, sizes
// that are not negative.
func brokerConfig(pos []string, host string, port int, data string, retBytes int64, maxMsg int) (kafka.BrokerConfig, error) {
	if err := noArgs("broker", pos); err != nil {
		return kafka.BrokerConfig{}, err
	}
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
		return kafka.BrokerConfig{}, fmt.Errorf("%w: --host %q: want a concrete IP address (the broker advertises it to clients)", errUsage, host)
	}
	addr, err := listenAddr(host, port)
	if err != nil {
		return kafka.BrokerConfig{}, err
	}
	if data != "" {
		if err := checkOutDir("--data", data); err != nil {
			return kafka.BrokerConfig{}, err
		}
	}
	return kafka.BrokerConfig{Addr: addr, DataDir: data, MaxMessageBytes: maxMsg}, firstBad(
		flagCheck{retBytes < 0, fmt.Sprintf("--retention-bytes %d: want 0 (unbounded) or more", retBytes)},
		flagCheck{maxMsg < 0, fmt.Sprintf("--max-message-bytes %d: want 0 (the default) or more", maxMsg)},
	)
}

// clientFlags are the Kafka connection flags shared by every command that
// talks to a broker.
type clientFlags struct {
	brokers *string
	config  *string
	// fs is the command line of the flags (nil: --brokers counts as
	// given when it is not empty).
	fs *flag.FlagSet
}

func addClientFlags(fs *flag.FlagSet) clientFlags {
	return clientFlags{
		brokers: fs.String("brokers", "127.0.0.1:9092", "comma-separated bootstrap brokers, HOST:PORT each (a --client-config that lists brokers replaces the default)"),
		config:  fs.String("client-config", "", "YAML file with TLS/SASL client settings (connectors/kafka.ClientConfig)"),
		fs:      fs,
	}
}

// load is the client configuration of the flags: --client-config's, with
// --brokers unless the file lists brokers. Both naming different brokers
// is refused, as is a malformed list or address.
func (c clientFlags) load() (kafka.ClientConfig, error) {
	var cc kafka.ClientConfig
	if *c.config != "" {
		var err error
		if cc, err = kafka.LoadClientConfig(*c.config); err != nil {
			return cc, fmt.Errorf("%w: --client-config: %w", errUsage, err)
		}
	}
	bs, err := brokerList("--brokers", *c.brokers)
	if err != nil {
		return cc, err
	}
	given := *c.brokers != ""
	if c.fs != nil {
		given = isSet(c.fs, "brokers")
	}
	switch {
	case len(cc.Brokers) == 0:
		cc.Brokers = bs
	case given && !slices.Equal(bs, cc.Brokers):
		return cc, fmt.Errorf("%w: --brokers %s and the brokers %s of --client-config %s: give one of them",
			errUsage, *c.brokers, strings.Join(cc.Brokers, ","), *c.config)
	}
	if len(cc.Brokers) == 0 {
		return cc, fmt.Errorf("%w: no brokers (--brokers)", errUsage)
	}
	if err := cc.Validate(); err != nil {
		return cc, fmt.Errorf("%w: %w", errUsage, err)
	}
	return cc, nil
}

func cmdTopics(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("topics create", stderr)
	cf := addClientFlags(fs)
	path := fs.String("contract", "", "learning contract (default: the built-in demo contract)")
	rf := fs.Int("replication-factor", 0, "replicas per partition (0: the contract's topics.replication when written, else 3 on 3 or more brokers, 1 on one)")
	minISR := fs.Int("min-insync-replicas", 0, "topic min.insync.replicas (0: 2 with 3 or more replicas, else 1)")
	unsafe := fs.Bool("allow-unsafe-replication", false, "accept replication that cannot survive the loss of one broker")
	wait := fs.Duration("wait", time.Minute, "how long to wait for a broker at --brokers to answer (one just started in the background)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 || pos[0] != "create" {
		return fmt.Errorf("%w: trajflow topics create --brokers ADDR [--contract FILE]", errUsage)
	}
	if err := firstBad(
		flagCheck{*rf < 0, fmt.Sprintf("--replication-factor %d: want 0 (the default) or more", *rf)},
		flagCheck{*minISR < 0, fmt.Sprintf("--min-insync-replicas %d: want 0 (the default) or more", *minISR)},
		flagCheck{*wait <= 0, fmt.Sprintf("--wait %v: want a positive duration", *wait)},
	); err != nil {
		return err
	}
	cc, err := cf.load()
	if err != nil {
		return err
	}
	c, err := contractFlag(*path, stderr)
	if err != nil {
		return err
	}
	return createTopics(ctx, cc, c, topicOptions{factor: *rf, minISR: *minISR, unsafe: *unsafe, wait: *wait}, stdout, stderr)
}

// topicOptions are the flags of topics create.
type topicOptions struct {
	factor, minISR int
	unsafe         bool
	wait           time.Duration
}

// createTopics waits for the cluster of cc, plans the replication and
// creates every topic of the run of c, printing each.
func createTopics(ctx context.Context, cc kafka.ClientConfig, c *contract.Contract, o topicOptions, stdout, stderr io.Writer) error {
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return err
	}
	specs := operators.TopicSpecs(c, topics)
	brokers, err := waitForBrokers(ctx, cc, o.wait, stderr)
	if err != nil {
		return err
	}
	repl, why, err := kafka.PlanReplication(operators.ReplicationRequest(c, len(brokers), o.factor, o.minISR, o.unsafe))
	if err != nil {
		return fmt.Errorf("topics create: %w", err)
	}
	fmt.Fprintf(stdout, "replication: %s\n", why)
	repl.Apply(specs)
	if err := kafka.CreateTopics(ctx, cc, cc.Brokers, specs); err != nil {
		return err
	}
	for _, s := range specs {
		fmt.Fprintf(stdout, "%-40s partitions=%d replication=%d min.insync.replicas=%d max.message.bytes=%d compacted=%v\n",
			s.Name, s.Partitions, s.ReplicationFactor, s.MinInsyncReplicas, s.MaxMessageBytes, s.Compacted)
	}
	return nil
}

// waitForBrokers lists the brokers of the cluster at cc.Brokers, retrying
// until one answers with at least one broker or wait has passed; a broker
// that refuses the client's credentials or certificate (kafka.Refused),
// or a server that answers in another protocol (kafka.ErrNotKafka), ends
// it at once, since waiting does not change that answer. It says
// on stderr that it waits, and its error names the addresses, the last
// cause and what to check.
func waitForBrokers(ctx context.Context, cc kafka.ClientConfig, wait time.Duration, stderr io.Writer) ([]kafka.BrokerInfo, error) {
	addrs := strings.Join(cc.Brokers, ",")
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	start := time.Now()
	backoff := 100 * time.Millisecond
	var told time.Time
	for {
		brokers, err := kafka.ListBrokers(wctx, cc, cc.Brokers)
		if err == nil && len(brokers) > 0 {
			if !told.IsZero() {
				fmt.Fprintf(stderr, "broker at %s answered after %s\n", addrs, time.Since(start).Round(100*time.Millisecond))
			}
			return brokers, nil
		}
		if err == nil {
			err = errors.New("the cluster lists no broker yet")
		}
		if kafka.Refused(err) {
			return nil, fmt.Errorf("the broker at %s refused this client: %w; check the credentials and CA of --client-config", addrs, err)
		}
		if errors.Is(err, kafka.ErrNotKafka) {
			return nil, brokerUnreachable(addrs, 0, err)
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("waiting for a broker at %s: %w (last: %w)", addrs, ctx.Err(), err)
		}
		if time.Since(told) >= 10*time.Second {
			fmt.Fprintf(stderr, "waiting up to %s for a Kafka broker at %s: %v\n", wait, addrs, err)
			told = time.Now()
		}
		t := time.NewTimer(backoff)
		select {
		case <-wctx.Done():
			t.Stop()
			return nil, brokerUnreachable(addrs, wait, err)
		case <-t.C:
		}
		backoff = min(2*backoff, time.Second)
	}
}

// brokerUnreachable is the error of a cluster that did not answer within
// wait (0: at once, without waiting): the addresses, the cause and what to
// check.
func brokerUnreachable(addrs string, wait time.Duration, err error) error {
	hint := "is a broker running there (trajflow broker --port N, or your cluster)? Check --brokers"
	if wait > 0 { // the command waited: it has --wait
		hint += ", or wait longer with --wait"
	}
	switch {
	case errors.Is(err, kafka.ErrNotKafka):
		hint = "a server of another protocol listens there: check the port in --brokers"
	case strings.Contains(err.Error(), "ApiVersions"):
		hint = "something accepts connections there but does not answer the Kafka protocol: check the port in --brokers"
	}
	within := ""
	if wait > 0 {
		within = " within " + wait.String()
	}
	return fmt.Errorf("no Kafka broker answered at %s%s: %w; %s", addrs, within, err, hint)
}
