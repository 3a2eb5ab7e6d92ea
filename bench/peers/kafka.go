package peers

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// KafkaAuto is the value of Config.Kafka (--kafka) that asks the command to
// start its own Apache Kafka with the project's script (StartLocalKafka)
// for the trajflow-kafka rows, and to stop it after the last run.
const KafkaAuto = "auto"

// LocalKafka is a single-node Apache Kafka (KRaft) started by the
// project's script, deploy/local/kafka.sh, in a home of its own and on
// free ports, so that a broker the user already runs with the same script
// is left alone.
type LocalKafka struct {
	// Addr is the PLAINTEXT bootstrap address; Pid the broker JVM's
	// process id (its CPU time belongs to the trajflow-kafka rows).
	Addr string
	Pid  int

	script string
	env    []string
	log    io.Writer
}

// StartLocalKafka runs `script clean` (a stale broker of home stopped, its
// data deleted; the jars stay cached in home) and `script up` with
// KAFKA_HOME=home and three free ports. The script fetches the broker
// from Maven Central the first time (java 17+ and mvn on PATH). Stop the
// broker with Stop.
func StartLocalKafka(ctx context.Context, script, home string, log io.Writer) (*LocalKafka, error) {
	var err error
	if script, err = filepath.Abs(script); err != nil {
		return nil, err
	}
	if home, err = filepath.Abs(home); err != nil {
		return nil, err
	}
	if _, err := os.Stat(script); err != nil {
		return nil, fmt.Errorf("peers: --kafka %s: the Kafka script: %w", KafkaAuto, err)
	}
	ports, err := FreePorts(3)
	if err != nil {
		return nil, err
	}
	k := &LocalKafka{Addr: "127.0.0.1:" + strconv.Itoa(ports[0]), script: script, log: log,
		env: append(os.Environ(), "KAFKA_HOME="+home, "KAFKA_PORT="+strconv.Itoa(ports[0]),
			"KAFKA_SASL_PORT="+strconv.Itoa(ports[1]), "KAFKA_CONTROLLER_PORT="+strconv.Itoa(ports[2]))}
	if err := k.run(ctx, "clean"); err != nil {
		return nil, err
	}
	if err := k.run(ctx, "up"); err != nil {
		_ = k.Stop()
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(home, "kafka.pid"))
	if err == nil {
		k.Pid, err = strconv.Atoi(strings.TrimSpace(string(b)))
	}
	if err != nil {
		_ = k.Stop()
		return nil, fmt.Errorf("peers: the pid of the broker %s started: %w", script, err)
	}
	return k, nil
}

// Stop stops the broker (SIGTERM, SIGKILL after 30 s) and deletes its data;
// it does not depend on the caller's context, which may be cancelled.
func (k *LocalKafka) Stop() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	return k.run(ctx, "clean")
}

func (k *LocalKafka) run(ctx context.Context, verb string) error {
	cmd := exec.CommandContext(ctx, "bash", k.script, verb)
	cmd.Env = k.env
	cmd.Stdout, cmd.Stderr = k.log, k.log
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("peers: %s %s: %w", k.script, verb, err)
	}
	return nil
}

// FreePorts picks n distinct free TCP ports on 127.0.0.1. They are closed
// again before it returns, for the processes that bind them.
func FreePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	ports := make([]int, n)
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("peers: free port: %w", err)
		}
		ls = append(ls, l)
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return ports, nil
}
