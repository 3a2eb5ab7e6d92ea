//go:build integration

package integration

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/testkit"
)

// TestKafkaFleetUpSASL starts a whole fleet with `trajflow up
// --client-config` on the broker's SASL_SSL listener (SCRAM-SHA-512, a
// private CA): every operator, the final report and `trajflow status`
// reach the cluster through the file alone, the fleet ends with a summary
// whose batches equal the in-process demo's for the same run id, and the
// password appears in no output and not in fleet.json.
func TestKafkaFleetUpSASL(t *testing.T) {
	realKafka(t)
	password, ca := brokerSecrets(t)
	cfgPath := saslClientConfig(t, "scram-sha-512", password, ca)
	run := uniqueRun("upsasl")
	path := testkit.ContractWithRunID(t, "../testdata/contracts/demo.yaml", run)
	dir := t.TempDir()
	const rounds = 2
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	out := filepath.Join(dir, "fleet")
	// No --brokers: the addresses come from the client config.
	up := exec.CommandContext(ctx, binPath, "up", "--client-config", cfgPath, "--contract", path,
		"--rounds", strconv.Itoa(rounds), "--eval-samples", "1", "--out", out, "--log-level", "debug")
	b, err := up.CombinedOutput()
	if err != nil {
		t.Fatalf("trajflow up --client-config: %v\n%s", err, b)
	}
	var got loop.Summary
	testkit.ReadJSON(t, filepath.Join(out, loop.SummaryFile), &got)
	if got.Lost != 0 || got.DuplicatesAdmitted != 0 || got.AttemptsLaunched != rounds*16*16 || got.Updates != rounds {
		sum, _ := os.ReadFile(filepath.Join(out, loop.SummaryFile))
		t.Fatalf("fleet: %d updates, launched %d, lost %d, duplicates %d (want %d updates, %d launched)\n%s\nsummary:\n%s\noperator logs (ends):\n%s",
			got.Updates, got.AttemptsLaunched, got.Lost, got.DuplicatesAdmitted, rounds, rounds*16*16, b, sum, logEnds(out, 12))
	}
	want, err := loop.Run(ctx, loop.Options{Updates: rounds, Seed: 1, RunID: run, EvalSamples: 1, Quiet: true, Out: t.TempDir()}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got.BatchHashes, want.BatchHashes) {
		t.Fatalf("fleet batches differ from the demo's:\n%v\n%v", got.BatchHashes, want.BatchHashes)
	}
	// status reads the client config from fleet.json.
	st, err := exec.CommandContext(ctx, binPath, "status", "--out", out).CombinedOutput()
	if err != nil || !strings.Contains(string(st), "run "+run) {
		t.Fatalf("trajflow status --out: %v\n%s", err, st)
	}
	fj, err := os.ReadFile(filepath.Join(out, "fleet.json"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(fj), `"client_config"`) {
		t.Errorf("fleet.json does not name the client config:\n%s", fj)
	}
	everything := string(b) + string(st) + string(fj)
	logs, _ := filepath.Glob(filepath.Join(out, "logs", "*.log"))
	for _, l := range logs {
		lb, _ := os.ReadFile(l)
		everything += string(lb)
	}
	if len(logs) < 8 {
		t.Errorf("%d operator logs, want the whole fleet's", len(logs))
	}
	if strings.Contains(everything, password) {
		t.Errorf("the SASL password appears in the output of up, status, fleet.json or an operator log")
	}
}

// logEnds is the last n lines of every operator log of the fleet in out.
func logEnds(out string, n int) string {
	logs, _ := filepath.Glob(filepath.Join(out, "logs", "*.log"))
	var sb strings.Builder
	for _, l := range logs {
		fmt.Fprintf(&sb, "== %s\n%s\n", filepath.Base(l), tail(l, n))
	}
	return sb.String()
}
