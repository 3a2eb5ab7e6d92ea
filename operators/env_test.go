package operators_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/env/capability"
	"github.com/trajflow/trajflow/connectors/envsvc"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// TestBuiltinDepsFamily: the contract's artifacts.environment chooses the
// registry of dispatch, rollout and the reward's validator, and the
// vocabulary bound of validate; the demo's contract keeps the kv registry
// of DefaultRegistryConfig.
func TestBuiltinDepsFamily(t *testing.T) {
	for _, tc := range []struct {
		artifact, family, evaluator string
		vocab                       int32
	}{
		{rollout.ArtifactKV, rollout.FamilyKV, rollout.EvalSuccess, rollout.VocabSize},
		{rollout.ArtifactLedger, rollout.FamilyLedger, rollout.EvalLedgerSuccess, rollout.VocabSize},
		{rollout.ArtifactText, rollout.FamilyText, rollout.EvalTextSuccess, 0},
	} {
		c := contract.Default()
		c.Artifacts.Environment = tc.artifact
		d, err := operators.BuiltinDeps(c)
		if err != nil {
			t.Fatal(err)
		}
		if d.Tasks.Family() != tc.family || d.VocabSize != tc.vocab || len(d.Evaluators) != 1 || d.Evaluators[0].Name() != tc.evaluator {
			t.Fatalf("%s: family %s, vocab %d, evaluators %v", tc.artifact, d.Tasks.Family(), d.VocabSize, d.Evaluators)
		}
		p, err := operators.Planner(d)
		if err != nil {
			t.Fatal(err)
		}
		for _, g := range p.Plan(0) {
			if task, ok := d.Tasks.Lookup(g.Task.ID); !ok || task.Split != "train" {
				t.Fatalf("%s: planned %s outside the family's train split", tc.artifact, g.Task.ID)
			}
		}
	}
	d, err := operators.BuiltinDeps(contract.Default())
	if err != nil || d.Tasks.Config() != rollout.DefaultRegistryConfig() {
		t.Fatalf("demo registry %+v %v", d.Tasks.Config(), err)
	}
	c := contract.Default()
	c.Artifacts.Environment = "builtin:env/chess@v1"
	if _, err := operators.BuiltinDeps(c); !errors.Is(err, operators.ErrConfig) {
		t.Fatalf("unknown environment: %v", err)
	}
}

// envService runs an environment service of the given families on
// 127.0.0.1 and writes its key file.
func envService(t *testing.T, families ...string) (url, keyFile string) {
	t.Helper()
	key := bytes.Repeat([]byte{3}, capability.KeySize)
	var regs []*rollout.Registry
	for _, f := range families {
		r, err := rollout.NewFamilyRegistry(f)
		if err != nil {
			t.Fatal(err)
		}
		regs = append(regs, r)
	}
	srv, err := envsvc.NewServer(envsvc.Config{Registries: regs, Key: key})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(func() { hs.Close(); srv.Close() })
	keyFile = filepath.Join(t.TempDir(), "capability.key")
	if err := os.WriteFile(keyFile, []byte(hex.EncodeToString(key)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return hs.URL, keyFile
}

// TestDialEnv: DialEnv checks the services before the run: a service of
// another family, a missing key file and a bad address are configuration
// errors naming what is wrong; a service that does not answer is waited
// for as long as the context lasts.
func TestDialEnv(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := contract.Default()
	c.Artifacts.Environment = rollout.ArtifactLedger
	ledger, key := envService(t, rollout.FamilyLedger)
	kvOnly, _ := envService(t, rollout.FamilyKV)
	cl, err := operators.DialEnv(ctx, c, []string{ledger}, key, nil)
	if err != nil {
		t.Fatal(err)
	}
	cl.Close()
	if _, err := operators.DialEnv(ctx, c, []string{ledger, kvOnly}, key, nil); !errors.Is(err, operators.ErrConfig) || !bytes.Contains([]byte(err.Error()), []byte(kvOnly)) {
		t.Fatalf("a service without the family: %v", err)
	}
	if _, err := operators.DialEnv(ctx, c, []string{ledger}, "", nil); !errors.Is(err, operators.ErrConfig) {
		t.Fatalf("no key file: %v", err)
	}
	if _, err := operators.DialEnv(ctx, c, []string{ledger}, filepath.Join(t.TempDir(), "none"), nil); !errors.Is(err, operators.ErrConfig) {
		t.Fatalf("missing key file: %v", err)
	}
	if _, err := operators.DialEnv(ctx, c, []string{"127.0.0.1:1"}, key, nil); !errors.Is(err, operators.ErrConfig) {
		t.Fatalf("not a URL: %v", err)
	}
	wctx, wcancel := context.WithTimeout(ctx, 1200*time.Millisecond)
	defer wcancel()
	_, err = operators.DialEnv(wctx, c, []string{"http://127.0.0.1:1"}, key, nil)
	if err == nil || errors.Is(err, operators.ErrConfig) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("unreachable service: %v", err)
	}
}

// TestTaskRegistryFollowsContract: without Deps.Tasks the stages build
// the registry of the contract's environment.
func TestTaskRegistryFollowsContract(t *testing.T) {
	c := contract.Default()
	c.Artifacts.Environment = rollout.ArtifactLedger
	reg, err := operators.TaskRegistry(operators.Deps{Contract: c})
	if err != nil || reg.Family() != rollout.FamilyLedger {
		t.Fatalf("%v %v", reg, err)
	}
}
