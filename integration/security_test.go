//go:build integration

package integration

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
)

// saslClientConfig writes a client config YAML for the broker's SASL_SSL
// listener and returns its path.
func saslClientConfig(t *testing.T, mech, password, caFile string) string {
	t.Helper()
	addr := os.Getenv("TRAJFLOW_KAFKA_SASL")
	if addr == "" {
		t.Fatal("TRAJFLOW_KAFKA_SASL is not set (make test-integration sets it)")
	}
	tls := "tls: {enable: true}"
	if caFile != "" {
		tls = fmt.Sprintf("tls: {enable: true, ca_file: %q}", caFile)
	}
	y := fmt.Sprintf("brokers: [%q]\nclient_id: trajflow-it\n%s\nsasl: {mechanism: %s, username: trajflow, password: %q}\n", addr, tls, mech, password)
	p := filepath.Join(t.TempDir(), "client.yaml")
	if err := os.WriteFile(p, []byte(y), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func brokerSecrets(t *testing.T) (password, ca string) {
	t.Helper()
	home := kafkaHome(t)
	pw, err := os.ReadFile(filepath.Join(home, "client", "password"))
	if err != nil {
		t.Fatalf("broker credentials (make kafka-up): %v", err)
	}
	return strings.TrimSpace(string(pw)), filepath.Join(home, "tls", "ca.pem")
}

// TestKafkaTLSSASL connects over the SASL_SSL listener with each mechanism
// from a client config file; a wrong password and an unverifiable
// certificate are refused.
func TestKafkaTLSSASL(t *testing.T) {
	realKafka(t)
	password, ca := brokerSecrets(t)
	path, _ := runContract(t, uniqueRun("sasl"), "")
	tests := []struct {
		name, mech, password, ca string
		ok                       bool
		errHas                   string
	}{
		{"plain", "plain", password, ca, true, ""},
		{"scram-sha-256", "scram-sha-256", password, ca, true, ""},
		{"scram-sha-512", "scram-sha-512", password, ca, true, ""},
		{"wrong password", "scram-sha-512", "not-the-password", ca, false, "SASL"},
		{"certificate not trusted", "plain", password, "", false, "certificate"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfgPath := saslClientConfig(t, tc.mech, tc.password, tc.ca)
			cc, err := kafka.LoadClientConfig(cfgPath)
			if err != nil {
				t.Fatal(err)
			}
			d, err := cc.Dialer()
			if err != nil {
				t.Fatal(err)
			}
			d.Timeout = 10 * time.Second
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			conn, err := d.DialContext(ctx, "tcp", cc.Brokers[0])
			if err == nil {
				_, err = conn.Brokers()
				conn.Close()
			}
			if tc.ok != (err == nil) {
				t.Fatalf("dial: %v (want ok=%v)", err, tc.ok)
			}
			if !tc.ok && !strings.Contains(err.Error(), tc.errHas) {
				t.Errorf("error %q does not mention %q", err, tc.errHas)
			}
			if err != nil && strings.Contains(err.Error(), tc.password) {
				t.Errorf("error leaks the password: %v", err)
			}
			// The CLI path: topics create with --client-config.
			out, cerr := exec.Command(binPath, "topics", "create", "--client-config", cfgPath, "--contract", path).CombinedOutput()
			if tc.ok != (cerr == nil) {
				t.Fatalf("trajflow topics create: %v (want ok=%v)\n%s", cerr, tc.ok, out)
			}
			// A refusal is final: it is reported as one, not waited out
			// as an unreachable broker.
			if !tc.ok && !bytes.Contains(out, []byte("refused this client")) {
				t.Errorf("trajflow topics create did not report the refusal:\n%s", out)
			}
			if bytes.Contains(out, []byte(tc.password)) {
				t.Errorf("trajflow topics create printed the password:\n%s", out)
			}
		})
	}
}

// TestKafkaSecretNeverLeaks plants the SASL password, runs every operator
// over SASL_SSL (SCRAM-SHA-512) at debug log level, once more with a wrong
// password (the failure path logs its errors), and searches every output
// for it: process logs, /metrics of each operator, every record (keys,
// values, headers) of every topic of the run, and the snapshot directory.
func TestKafkaSecretNeverLeaks(t *testing.T) {
	start := time.Now()
	addr := realKafka(t)
	password, ca := brokerSecrets(t)
	path, c := runContract(t, uniqueRun("secret"), "")
	run := startRun(t, c, addr)
	cfgPath := saslClientConfig(t, "scram-sha-512", password, ca)

	f := newFleet(t, addr, path)
	f.clientConfig = cfgPath
	f.extraArgs = []string{"--log-level", "debug"}
	snapDir := t.TempDir()
	names := []string{"validate", "reward", "advantage", "pack"}
	if slices.Contains(operators.Names(), "snapshot") {
		names = append(names, "snapshot")
	}
	var procs []*proc
	for _, n := range names {
		if n == "snapshot" {
			f.extraArgs = append(f.extraArgs, "--snapshot-dir", snapDir, "--snapshot-roll-interval", "1s")
		}
		procs = append(procs, f.start(n, n+"-0"))
	}
	ids := run.Produce(t, synthFor(run, 120), 0, 40)
	counts, rep := settle(t, run, ids, 90*time.Second)
	checkCounts(t, run, counts, rep)
	checkNoneRefused(t, counts, rep)

	// /metrics of every operator while it runs.
	var metrics bytes.Buffer
	for _, p := range procs {
		ha, err := healthAddr(p, 10*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", p.inst, err)
		}
		resp, err := http.Get("http://" + ha + "/metrics")
		if err != nil {
			t.Fatalf("%s metrics: %v", p.inst, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		metrics.Write(b)
	}
	if !bytes.Contains(metrics.Bytes(), []byte("trajflow_")) {
		t.Fatalf("no trajflow metrics scraped:\n%.500s", metrics.String())
	}

	// The failure path: an operator with a wrong password logs its errors.
	wrong := "Wr0ng-" + password[:6] + "-planted"
	bad := newFleet(t, addr, path)
	bad.clientConfig = saslClientConfig(t, "scram-sha-512", wrong, ca)
	bad.extraArgs = []string{"--log-level", "debug", "--restarts", "0"}
	bp := bad.start("validate", "validate-badpw")
	select {
	case <-bp.done:
	case <-time.After(20 * time.Second):
		bad.stop("validate-badpw")
	}
	f.stopAll()

	// Every record of every topic of the run.
	var records bytes.Buffer
	cfg := run.Config("secret-scan", "")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	topics := []string{run.Topics.Tasks, run.Topics.Trajectories, run.Topics.Valid, run.Topics.Rewarded, run.Topics.Scored,
		run.Topics.Batches, run.Topics.Quarantine, run.Topics.Census, run.Topics.Incidents, run.Topics.Policy, run.Topics.Windows}
	nrec := 0
	for _, topic := range topics {
		err := pipeline.ScanTail(ctx, &cfg, topic, 0, func(m pipeline.Message) error {
			nrec++
			records.Write(m.Key)
			records.Write(m.Value)
			for _, h := range m.Headers {
				records.WriteString(h.Key)
				records.Write(h.Value)
			}
			return nil
		})
		if err != nil && !strings.Contains(err.Error(), "Unknown Topic") {
			t.Fatalf("scan %s: %v", topic, err)
		}
	}
	var snaps bytes.Buffer
	nsnap := 0
	_ = filepath.WalkDir(snapDir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			b, _ := os.ReadFile(p)
			snaps.Write(b)
			nsnap++
		}
		return nil
	})
	logs := f.logs() + bad.logs()
	if !strings.Contains(bad.logs(), "SASL Authentication") {
		t.Errorf("the wrong-password operator logged no authentication failure:\n%s", tail(bp.log, 6))
	}
	for _, secret := range []string{password, wrong} {
		for name, out := range map[string][]byte{"logs": []byte(logs), "metrics": metrics.Bytes(), "topics": records.Bytes(), "snapshots": snaps.Bytes()} {
			if bytes.Contains(out, []byte(secret)) {
				t.Errorf("the SASL password appears in the %s", name)
			}
		}
	}
	t.Logf("searched %d bytes of logs, %d bytes of metrics, %d records (%d bytes), %d snapshot files (%d bytes): no secret",
		len(logs), metrics.Len(), nrec, records.Len(), nsnap, snaps.Len())
	record(t, scenarioResult{Name: "SASL_SSL (SCRAM-SHA-512) run, secret search", Broker: "Apache Kafka 4.1", Counts: counts, Reasons: reasons(rep.Quarantined), Elapsed: time.Since(start)})
}

func TestKafkaEvaluatorFailures(t *testing.T) { evaluatorScenario(t, realKafka(t), "Apache Kafka 4.1") }

func TestKafkaBadInput(t *testing.T) { badInputScenario(t, realKafka(t), "Apache Kafka 4.1") }
