package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/evaluation"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// TestContractValidateSamplerID: `trajflow contract validate` prints as
// sampler_id the id the rollout stage records: it equals the SamplerID of
// trajectories the rollout stage's episode runner produces for the same
// contract (the demo's, and one with temperature and min-p changed), and
// differs from the hash of the contract's sampler section, which is
// printed under its own name.
func TestContractValidateSamplerID(t *testing.T) {
	minp := contract.Default()
	minp.Sampler.Temperature, minp.Sampler.MinP = 0.8, 0.05
	for name, c := range map[string]*contract.Contract{"demo": contract.Default(), "min_p": minp} {
		t.Run(name, func(t *testing.T) {
			file := testkit.ContractFile(t, c)
			var out, errb bytes.Buffer
			if rc := run(context.Background(), []string{"contract", "validate", file}, &out, &errb); rc != 0 {
				t.Fatalf("exit %d: %s", rc, errb.String())
			}
			printed := regexp.MustCompile(`(?m)^# sampler_id: (sha256:[0-9a-f]{64}) `).FindStringSubmatch(out.String())
			section := regexp.MustCompile(`(?m)^# sampler section hash: (sha256:[0-9a-f]{64})$`).FindStringSubmatch(out.String())
			if printed == nil || section == nil {
				t.Fatalf("output has no sampler_id or sampler section hash:\n%s", out.String())
			}

			// A trajectory of the rollout stage for the same contract.
			rc, err := loadContract(file)
			if err != nil {
				t.Fatal(err)
			}
			deps, err := operators.BuiltinDeps(rc)
			if err != nil {
				t.Fatal(err)
			}
			reg, err := operators.TaskRegistry(deps)
			if err != nil {
				t.Fatal(err)
			}
			mc, seed := operators.ModelConfig(rc)
			m, err := gpu.InitialModel(mc, seed)
			if err != nil {
				t.Fatal(err)
			}
			atts := rollout.Attempts(rc.RunID, reg.Train()[0], 0, 2, rc.Seed, 0, rc.Hash())
			trajs, err := reg.RunEpisodes(context.Background(), model.NewPolicy(m, 0), atts, operators.RolloutSettings(rc, reg), operators.RolloutLimits(rc))
			if err != nil {
				t.Fatal(err)
			}
			for _, tr := range trajs {
				if tr.SamplerID != printed[1] {
					t.Fatalf("trajectory sampler_id %s, contract validate printed %s", tr.SamplerID, printed[1])
				}
			}
			if section[1] != rc.SamplerID() || section[1] == printed[1] {
				t.Fatalf("sampler section hash %s (contract %s), sampler_id %s", section[1], rc.SamplerID(), printed[1])
			}
		})
	}
}

// TestContractValidateEveryTestdataContract: every valid contract of
// testdata/contracts validates, those of an environment that is not built
// in (synthetic rollouts: bench, conformance) included; the invalid_*
// ones are refused.
func TestContractValidateEveryTestdataContract(t *testing.T) {
	files, err := filepath.Glob("../../testdata/contracts/*.yaml")
	if err != nil || len(files) < 4 {
		t.Fatalf("contracts %v (%v)", files, err)
	}
	for _, f := range files {
		var out, errb bytes.Buffer
		rc := run(context.Background(), []string{"contract", "validate", f}, &out, &errb)
		if strings.HasPrefix(filepath.Base(f), "invalid_") {
			if rc == 0 {
				t.Errorf("%s: validated", f)
			}
			continue
		}
		if rc != 0 {
			t.Errorf("%s: exit %d: %s", f, rc, errb.String())
		} else if !bytes.Contains(out.Bytes(), []byte("# sampler_id: sha256:")) {
			t.Errorf("%s: no sampler_id:\n%s", f, out.String())
		}
	}
}

// TestContractValidateRefusesUnimplemented: the valid testdata contracts
// still validate; a key the build does not implement is refused by
// `trajflow contract validate` with a message that says so.
func TestContractValidateRefusesUnimplemented(t *testing.T) {
	for _, f := range []string{"bench.yaml", "conformance.yaml"} { // environments of their own: no sampler id to print
		c, err := loadContract(filepath.Join("..", "..", "testdata", "contracts", f))
		if err == nil {
			err = evaluation.CheckObjective(c.Objective)
		}
		if err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
	for _, f := range []string{"demo.yaml", "minimal.yaml"} {
		var out, errb bytes.Buffer
		if rc := run(context.Background(), []string{"contract", "validate", filepath.Join("..", "..", "testdata", "contracts", f)}, &out, &errb); rc != 0 {
			t.Errorf("%s: exit %d: %s", f, rc, errb.String())
		}
	}
	kl := contract.Default()
	kl.Loss.KLPlacement, kl.Loss.KLCoef = "loss", 0.05
	var out, errb bytes.Buffer
	if rc := run(context.Background(), []string{"contract", "validate", testkit.ContractFile(t, kl)}, &out, &errb); rc != 0 {
		t.Errorf("kl in loss: exit %d: %s", rc, errb.String())
	}
	klReward := contract.Default()
	klReward.Loss.KLPlacement = "reward"
	metric := contract.Default()
	metric.Objective.Constraints["p95_episode_cost_usd"] = 0.2
	typo := contract.Default()
	typo.Rewards[0].Name = "kv_sucess"
	version := contract.Default()
	version.Rewards[0].Version = "v999"
	for name, c := range map[string]struct {
		c    *contract.Contract
		want string
	}{
		"kl in reward":      {klReward, `loss.kl_placement: "reward" is not implemented`},
		"unmeasured metric": {metric, `objective.constraints.p95_episode_cost_usd: metric "p95_episode_cost_usd" is not implemented`},
		"no such evaluator": {typo, `no evaluator registered under this name: component "kv_sucess"`},
		"evaluator version": {version, `component "` + version.Rewards[0].Name + `" declared "v999"`},
	} {
		file := testkit.ContractFile(t, c.c)
		var out, errb bytes.Buffer
		if rc := run(context.Background(), []string{"contract", "validate", file}, &out, &errb); rc != 2 || !strings.Contains(errb.String(), c.want) {
			t.Errorf("%s: exit %d, stderr %q; want exit 2 and a refusal saying %q", name, rc, errb.String(), c.want)
		}
	}
}

// TestContractShow: `trajflow contract show` prints the built-in contract
// resolved; saved to a file, it validates to the same hash, and a run of
// it is the built-in contract's (the hash the demo's records carry).
func TestContractShow(t *testing.T) {
	var out, errb bytes.Buffer
	if rc := run(context.Background(), []string{"contract", "show"}, &out, &errb); rc != 0 {
		t.Fatalf("contract show: exit %d: %s", rc, errb.String())
	}
	c := contract.Default()
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "# hash: "+c.Hash()+"\n") {
		t.Fatalf("contract show does not print the built-in contract's hash %s:\n%s", c.Hash(), out.String())
	}
	file := filepath.Join(t.TempDir(), "run.yaml")
	if err := os.WriteFile(file, out.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	var again bytes.Buffer
	if rc := run(context.Background(), []string{"contract", "validate", file}, &again, &errb); rc != 0 {
		t.Fatalf("contract validate of what show printed: exit %d: %s", rc, errb.String())
	}
	if again.String() != out.String() {
		t.Errorf("validate of show's output differs from show's:\n%s\nvs\n%s", again.String(), out.String())
	}
	if rc := run(context.Background(), []string{"contract", "show", file}, &again, &errb); rc != 2 {
		t.Errorf("contract show FILE: exit %d, want 2 (show takes no file)", rc)
	}
}

// TestContractValidateRefusesHostileFiles: a contract file that is not one
// (a directory, a named pipe, a file past contract.MaxFileSize) or a
// contract with a bad value makes `trajflow contract validate` exit 2
// promptly, its message naming the file and, for a value, the key path.
func TestContractValidateRefusesHostileFiles(t *testing.T) {
	tmp := t.TempDir()
	minimal, err := os.ReadFile(filepath.Join("..", "..", "testdata", "contracts", "minimal.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	write := func(name, prefix, suffix string) string {
		f := filepath.Join(tmp, name)
		if err := os.WriteFile(f, []byte(prefix+string(minimal)+suffix), 0o644); err != nil {
			t.Fatal(err)
		}
		return f
	}
	fifo := filepath.Join(tmp, "fifo.yaml")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, file, want string
	}{
		{"directory", tmp, "a directory"},
		{"named pipe", fifo, "a named pipe"},
		{"too large", write("big.yaml", "", "#"+strings.Repeat("x", contract.MaxFileSize)+"\n"), "larger than"},
		{"NaN", write("nan.yaml", "latency: {tool_sigma: .nan}\n", ""), "latency.tool_sigma: must be finite, got NaN"},
		{"1e400", write("huge.yaml", "", "latency: {token_sigma: 1e400}\n"), "latency.token_sigma: must be finite, got 1e400"},
		{"partitions past int32", write("parts.yaml", "", "topics: {partitions: 4294967300}\n"), "topics.partitions: must be <= 2147483647"},
		{"replication past int16", write("repl.yaml", "", "topics: {replication: 40000}\n"), "topics.replication: must be <= 32767"},
		{"integer past int64", write("seed.yaml", "seed: -9223372036854775809\n", ""), "seed: integer -9223372036854775809 out of range"},
		{"wrong case", write("case.yaml", "Seed: 3\n", ""), "Seed: unknown key"},
		{"duplicate key", write("dup.yaml", "seed: 3\nseed: 4\n", ""), "seed: duplicate key"},
		{"two documents", write("two.yaml", "", "---\nrun_id: b\n"), "more than one YAML document"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			done := make(chan int, 1)
			go func() { done <- run(context.Background(), []string{"contract", "validate", tt.file}, &out, &errb) }()
			select {
			case rc := <-done:
				if rc != 2 || !strings.Contains(errb.String(), tt.file) || !strings.Contains(errb.String(), tt.want) {
					t.Errorf("exit %d, stderr %q; want exit 2 naming %s and %q", rc, errb.String(), tt.file, tt.want)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("contract validate %s still running after 10 s", tt.file)
			}
		})
	}
}
