package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/bench/peers/zmqpeer"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// trajflowBinary builds the trajflow binary once per test process.
func trajflowBinary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		dir, err := os.MkdirTemp("", "trajflow-bin-")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "trajflow")
		args := []string{"build", "-o", binPath}
		if zmqpeer.LibzmqBuilt { // the binary has what the test binary has
			args = append(args, "-tags", "libzmq")
		}
		if out, err := exec.Command("go", append(args, ".")...).CombinedOutput(); err != nil {
			binErr = &buildError{err, string(out)}
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

type buildError struct {
	err error
	out string
}

func (e *buildError) Error() string { return "go build: " + e.err.Error() + "\n" + e.out }

// servePolicy starts a `trajflow serve policy` process on 127.0.0.1 over
// the releases directory dir and returns its URL; it is stopped (SIGINT)
// when the test ends.
func servePolicy(t *testing.T, protocol, dir string) string {
	t.Helper()
	cmd := exec.Command(trajflowBinary(t), "serve", "policy", "--protocol", protocol, "--port", "0", "--releases", dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = &prefixWriter{t: t, prefix: "serve policy " + protocol}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGINT)
		cmd.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("serve policy %s printed no URL: %v", protocol, err)
	}
	url := regexp.MustCompile(`http://127\.0\.0\.1:[0-9]+`).FindString(line)
	if url == "" {
		t.Fatalf("no URL in %q", line)
	}
	return url
}

// TestDemoOnPolicyServers is the demo with rollout on `trajflow serve
// policy` processes, once per protocol (two SGLang replicas behind the
// gateway), weight sync in the loop: the batches are those of the
// in-process demo with the same seed, byte for byte, and the ratio of the
// first update is exactly 1 (the network path returns the sampler's
// tokens and float32 log-probs).
func TestDemoOnPolicyServers(t *testing.T) {
	const updates = 3
	want := testkit.Demo(t, loop.Options{Updates: updates, Seed: 1})
	for _, tc := range []struct {
		protocol string
		replicas int
	}{{"sglang", 2}, {"vllm", 1}, {"llamacpp", 1}} {
		t.Run(tc.protocol, func(t *testing.T) {
			out := t.TempDir()
			releases := filepath.Join(out, "releases") // the trainer writes here, the servers read here
			if err := os.MkdirAll(releases, 0o755); err != nil {
				t.Fatal(err)
			}
			var urls []string
			for range tc.replicas {
				urls = append(urls, tc.protocol+"://"+strings.TrimPrefix(servePolicy(t, tc.protocol, releases), "http://"))
			}
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			var stdout, stderr bytes.Buffer
			args := []string{"demo", "--out", out, "--updates", "3", "--eval-samples", "1", "--policy", strings.Join(urls, ",")}
			if code := run(ctx, args, &stdout, &stderr); code != 0 {
				t.Fatalf("exit %d: %s\n%s", code, stderr.String(), stdout.String())
			}
			b, err := os.ReadFile(filepath.Join(out, loop.SummaryFile))
			if err != nil {
				t.Fatal(err)
			}
			var s loop.Summary
			if err := json.Unmarshal(b, &s); err != nil {
				t.Fatal(err)
			}
			t.Logf("%s", lastLines(stdout.String(), 2))
			if !reflect.DeepEqual(s.BatchHashes, want.BatchHashes) || len(s.BatchHashes) != updates {
				t.Fatalf("batches on %s servers differ from the in-process demo:\n%v\n%v", tc.protocol, s.BatchHashes, want.BatchHashes)
			}
			if s.Lost != 0 || s.DuplicatesAdmitted != 0 || s.AttemptsLaunched != updates*16*16 {
				t.Fatalf("launched %d, lost %d, duplicates %d", s.AttemptsLaunched, s.Lost, s.DuplicatesAdmitted)
			}
			files, err := pipeline.NewDirReleases(releases)
			if err != nil {
				t.Fatal(err)
			}
			u, err := gpu.ReadUpdate(files, 1)
			if err != nil {
				t.Fatal(err)
			}
			if m := u.Metrics; m.Tokens == 0 || m.RatioMin != 1 || m.RatioMax != 1 || m.RatioMean != 1 || m.ApproxKLOld != 0 {
				t.Fatalf("first update on %s servers: tokens %d, ratio [%v %v] mean %v, approx KL %v", tc.protocol, m.Tokens, m.RatioMin, m.RatioMax, m.RatioMean, m.ApproxKLOld)
			}
			if !strings.Contains(stdout.String(), "weightsync") {
				t.Fatalf("weight sync was not in the loop:\n%s", stdout.String())
			}
		})
	}
}

// TestDemoPolicyUsage: bad --policy values are usage errors naming the
// flag.
func TestDemoPolicyUsage(t *testing.T) {
	for _, tc := range []struct{ args, want string }{
		{"--policy http://127.0.0.1:1", "--policy-protocol"},
		{"--policy tgi://127.0.0.1:1", "unknown protocol"},
		{"--policy sglang://127.0.0.1:1,vllm://127.0.0.1:2", "two protocols"},
		{"--policy-protocol sglang", "need --policy"},
		{"--policy sglang://127.0.0.1:1 --llamacpp-router true", "--llamacpp-router is for llamacpp"},
		{"--tasks text", "--tasks text needs a language model"},
		{"--tasks text --policy llamacpp://127.0.0.1:1", "needs --no-train"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), append([]string{"demo", "--out", t.TempDir()}, strings.Fields(tc.args)...), &stdout, &stderr)
		if code == 0 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("demo %s: exit %d, stderr %q; want it to mention %q", tc.args, code, stderr.String(), tc.want)
		}
	}
}

// policyContract writes the demo contract with a policy section naming
// one replica of protocol at url, and returns its path.
func policyContract(t *testing.T, protocol, url string) string {
	t.Helper()
	c := contract.Default()
	c.Policy.Protocol, c.Policy.Endpoints = protocol, []string{url}
	c.Policy.Router = protocol == contract.PolicyLlamaCpp
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	return testkit.ContractFile(t, c)
}

// TestFleetOnPolicyServer runs the loop as separate processes —
// `trajflow run dispatch|rollout|validate|reward|advantage|pack|train|
// weightsync --contract F` — whose contract's policy section names a
// `trajflow serve policy --protocol vllm` process: the batches are those
// of the in-process demo, bit for bit.
func TestFleetOnPolicyServer(t *testing.T) { fleet(t, 3, 0, contract.PolicyVLLM) }
